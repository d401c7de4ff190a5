"""Audio input: an audio or video file's bytes, or raw PCM -> mono float32 at 16 kHz.

Two paths, chosen from the file's header:

* A mono or stereo WAV / FLAC (what recorders, phones' voice memos in WAV and Whisper pipelines write) is read
  by libsndfile (``soundfile``) block by block, its channels averaged, and resampled when its rate is not
  16 kHz with libsoxr (``soxr``, "HQ" quality, streamed): the fastest path. Its downmix is FFmpeg's normalised
  one below; only the resampler differs (soxr's is about twice as fast; at 16 kHz nothing is resampled).
* Everything else (mp3, AAC in m4a / mp4, Opus / Vorbis in ogg / webm, video files, WAV / FLAC with more than
  two channels...) goes through FFmpeg's libraries in PyAV (``decoder_svc.session.audio_av``): the decoders,
  downmix and resampler faster-whisper and openai-whisper use.

Either way memory is bounded by the output (16 kHz float32 of at most ``--max-audio-s``) plus a fixed buffer,
and decoding stops as soon as a limit is passed. Every failure raises ``AudioError`` (a ``ValueError``) whose
message says what was wrong and what to send, so servicers can map it to INVALID_ARGUMENT as is.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import soundfile as sf
import soxr

from decoder_svc.session.audio_av import decode_av, probe_av
from decoder_svc.session.audio_limits import (
    FORMATS_HINT,
    MIN_SAMPLE_RATE,
    AudioError,
    AudioLimits,
    check_float_samples,
)
from decoder_svc.session.pcm_buffer import PcmBuffer

__all__ = [
    "AudioError",
    "AudioLimits",
    "MIN_SAMPLE_RATE",
    "PCM_ENCODINGS",
    "TARGET_SAMPLE_RATE",
    "decode_audio",
    "decode_cost",
    "pcm_to_array",
]

TARGET_SAMPLE_RATE = 16_000  # Hz; Whisper's feature extractor rate
# libsndfile container names read on the fast path (WAV family and FLAC), mono or stereo.
SNDFILE_FORMATS = frozenset({"WAV", "WAVEX", "RF64", "W64", "FLAC"})
# Raw PCM sample encodings (FFmpeg's names; "" = pcm_f32le): numpy dtype and the scale to [-1, 1).
PCM_ENCODINGS = {"pcm_f32le": ("<f4", 1.0), "pcm_s16le": ("<i2", 1 / 32768)}
# libsndfile's frame count of a FLAC whose STREAMINFO leaves the length unknown (SF_COUNT_MAX): FFmpeg decodes it.
_UNKNOWN_FRAMES = 2**62
_BLOCK_FRAMES = 1 << 18  # libsndfile block size of the resampled fast path (frames; 1 MiB of mono float32)


def decode_audio(
    data: bytes,
    target_sample_rate: int = TARGET_SAMPLE_RATE,
    max_duration_s: float | None = None,
    limits: AudioLimits | None = None,
) -> np.ndarray:
    """Decodes an audio or video file to mono float32 at ``target_sample_rate``.

    Args:
        data: the whole file's bytes.
        target_sample_rate: output rate in Hz.
        max_duration_s: if set, longer audio is refused (from the header where it states the length, else
            while decoding, which stops there); overrides ``limits.max_duration_s``.
        limits: the accepted rates, channels and duration (default ``AudioLimits()``).

    Returns:
        ``[num_samples]`` float32.

    Raises:
        AudioError: empty or undecodable bytes, no audio stream, no samples, NaN / inf samples or float samples
            beyond +-``MAX_FLOAT_AMPLITUDE`` (64; ``audio_limits``), a cut-off file, a rate, channel count or
            length over the limits.
    """
    limits = _limits(limits, max_duration_s)
    info = _sndfile_info(data)
    if info is not None and info.channels <= 2:
        return _decode_sndfile(data, info, limits, target_sample_rate)
    return decode_av(data, limits, target_sample_rate)


def decode_cost(data: bytes, limits: AudioLimits) -> float:
    """The input samples (frames x channels) decoding ``data`` will read, from its header alone (a fraction of
    a millisecond to a few): how ``decoder_svc.session.decode_pool`` orders waiting decodes, cheapest first.

    Raises:
        AudioError: what the header alone shows ``decode_audio`` would refuse (empty, not a container, no audio
            stream, a rate, channel count or declared length over ``limits``), at once instead of after a wait.
    """
    info = _sndfile_info(data)
    if info is None:
        return probe_av(data, limits)
    _check_header(info, limits)
    return float(info.frames * info.channels)


def _limits(limits: AudioLimits | None, max_duration_s: float | None) -> AudioLimits:
    """``limits`` (default ``AudioLimits()``) with ``max_duration_s`` in place of its own when that is set."""
    limits = limits or AudioLimits()
    return limits if max_duration_s is None else dataclasses.replace(limits, max_duration_s=max_duration_s)


def _check_header(info, limits: AudioLimits) -> None:
    """What a libsndfile header alone shows over ``limits``: its rate, channels and stated length."""
    limits.check_rate(info.samplerate)
    limits.check_channels(info.channels)
    limits.check_duration(info.frames / info.samplerate, " by its header")


def _sndfile_info(data: bytes):
    """libsndfile's header of a WAV / FLAC that states its length (``soundfile._SoundFileInfo``), else None
    (FFmpeg's turn). Refuses empty bytes and a WAV whose data chunk is cut short."""
    if not data:
        raise AudioError(f"audio is empty: received 0 bytes; {FORMATS_HINT}")
    _check_wav_complete(data)
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError):
        return None  # not a format libsndfile reads
    ok = info.format in SNDFILE_FORMATS and 0 < info.frames < _UNKNOWN_FRAMES
    return info if ok else None


def pcm_to_array(
    samples: bytes,
    sample_rate: int,
    target_sample_rate: int = TARGET_SAMPLE_RATE,
    max_duration_s: float | None = None,
    encoding: str = "pcm_f32le",
    limits: AudioLimits | None = None,
) -> np.ndarray:
    """Raw mono little-endian PCM -> float32 at ``target_sample_rate``.

    Args:
        samples: the samples' bytes.
        sample_rate: their rate in Hz; resampled with soxr when different.
        max_duration_s: if set, longer audio is refused; overrides ``limits.max_duration_s``.
        encoding: ``pcm_f32le`` (float32, the default; "" is the same) or ``pcm_s16le`` (int16, scaled by 1/32768).
        limits: the accepted rates and duration (default ``AudioLimits()``).

    Returns:
        ``[num_samples]`` float32.

    Raises:
        AudioError: an unknown encoding, empty, a byte length not a multiple of the sample size, a bad sample
            rate, NaN / inf float samples or any beyond +-``MAX_FLOAT_AMPLITUDE`` (64; ``audio_limits``), or
            too long.
    """
    limits = _limits(limits, max_duration_s)
    encoding = encoding or "pcm_f32le"
    if encoding not in PCM_ENCODINGS:
        raise AudioError(f"unknown PCM encoding {encoding[:64]!r}; use one of {', '.join(PCM_ENCODINGS)}")
    dtype, scale = PCM_ENCODINGS[encoding]
    width = np.dtype(dtype).itemsize
    limits.check_rate(sample_rate)
    kind = "little-endian float32" if encoding == "pcm_f32le" else "little-endian int16"
    if len(samples) == 0:
        raise AudioError(f"audio is empty: received 0 PCM bytes; send {kind} mono samples")
    if len(samples) % width:
        raise AudioError(
            f"PCM byte length {len(samples)} is not a multiple of {width}; {encoding} samples are {kind} "
            f"({width} bytes each)"
        )
    limits.check_duration(len(samples) // width / sample_rate)
    audio = np.frombuffer(samples, dtype=dtype).astype(np.float32)  # [num_samples], native order copy
    if scale != 1.0:
        audio *= np.float32(scale)
    else:
        check_float_samples(audio, "scale them to [-1, 1], or if they are int16 say encoding pcm_s16le")
    return _resample(audio, sample_rate, target_sample_rate)


def _decode_sndfile(data: bytes, info, limits: AudioLimits, target_rate: int) -> np.ndarray:
    """The fast path: a mono / stereo WAV or FLAC read by libsndfile in blocks, channels averaged, resampled by
    soxr as it streams."""
    _check_header(info, limits)
    rate = info.samplerate
    stream = None if rate == target_rate else soxr.ResampleStream(rate, target_rate, 1, dtype="float32", quality="HQ")
    out, read = PcmBuffer(info.frames * target_rate // rate + target_rate), 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            for block in f.blocks(blocksize=_BLOCK_FRAMES, dtype="float32", always_2d=True):  # [frames, channels]
                read += len(block)
                mono = block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0]
                check_float_samples(mono, f"the {info.format} file's float data must be scaled to [-1, 1]")
                out.append(mono if stream is None else stream.resample_chunk(mono, last=False))
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioError(f"cannot decode {info.format} audio: {e}; the file may be truncated or corrupt") from None
    if stream is not None:
        out.append(stream.resample_chunk(np.zeros(0, np.float32), last=True))
    if read < info.frames:
        raise AudioError(
            f"{info.format} file is truncated: its header declares {info.frames} samples but only {read} could be "
            "decoded; send the whole file"
        )
    return out.samples()


def _check_wav_complete(data: bytes) -> None:
    """Refuses a RIFF/WAVE file whose ``data`` chunk is shorter than its header says.

    libsndfile and FFmpeg silently decode what is there, which would transcribe part of a file cut off in
    transit.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if chunk == b"data":
            available = len(data) - pos - 8
            if size != 0xFFFFFFFF and size > available:
                raise AudioError(
                    f"WAV file is truncated: its data chunk declares {size} bytes but only {available} arrived; send the whole file"
                )
            return
        pos += 8 + size + (size & 1)


def _resample(audio: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    if rate != target_rate:
        audio = soxr.resample(audio, rate, target_rate, quality="HQ")
    return np.ascontiguousarray(audio, dtype=np.float32)
