"""Audio input: WAV/FLAC bytes or raw float32 PCM -> mono float32 at 16 kHz.

Decoding uses libsndfile (``soundfile``); resampling uses libsoxr (``soxr``,
"HQ" quality). Every failure raises ``AudioError`` (a ``ValueError``) whose
message says what to send instead, so servicers can map it to
INVALID_ARGUMENT as is.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
import soxr

TARGET_SAMPLE_RATE = 16_000  # Hz; Whisper's feature extractor rate
MIN_SAMPLE_RATE = 1_000
MAX_SAMPLE_RATE = 384_000
# libsndfile container names we accept (WAV family and FLAC).
SUPPORTED_FORMATS = frozenset({"WAV", "WAVEX", "RF64", "W64", "FLAC"})


class AudioError(ValueError):
    """The audio cannot be used; the message says why and what to send."""


def decode_audio(
    data: bytes,
    target_sample_rate: int = TARGET_SAMPLE_RATE,
    max_duration_s: float | None = None,
) -> np.ndarray:
    """Decodes a WAV or FLAC file to mono float32 at ``target_sample_rate``.

    Args:
        data: the whole file's bytes.
        target_sample_rate: output rate in Hz.
        max_duration_s: if set, longer audio is refused (checked from the
            header, before decoding).

    Returns:
        ``[num_samples]`` float32, channels averaged, resampled with soxr.

    Raises:
        AudioError: empty or undecodable bytes, a format other than WAV/FLAC,
            no samples, NaN/inf samples, a bad sample rate, or too long.
    """
    if not data:
        raise AudioError("empty audio: received 0 bytes; send a WAV or FLAC file")
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        reason = getattr(e, "error_string", None) or "unrecognised format"
        raise AudioError(f"cannot decode audio ({len(data)} bytes): {reason}; send a WAV or FLAC file") from None
    if info.format not in SUPPORTED_FORMATS:
        raise AudioError(f"unsupported audio format {info.format} ({info.format_info}); send a WAV or FLAC file")
    _check_wav_complete(data)
    _check_sample_rate(info.samplerate)
    if info.frames <= 0:
        raise AudioError("audio has no samples (zero length); send at least one sample")
    _check_duration(info.frames, info.samplerate, max_duration_s)
    try:
        audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)  # [frames, channels]
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioError(f"cannot decode {info.format} audio: {e}; the file may be truncated or corrupt") from None
    if audio.shape[0] == 0:
        raise AudioError("audio has no samples (zero length); send at least one sample")
    mono = audio.mean(axis=1, dtype=np.float32) if audio.shape[1] > 1 else audio[:, 0]  # [frames]
    return _finish(mono, rate, target_sample_rate)


def pcm_to_array(
    samples: bytes,
    sample_rate: int,
    target_sample_rate: int = TARGET_SAMPLE_RATE,
    max_duration_s: float | None = None,
) -> np.ndarray:
    """Raw mono little-endian float32 PCM -> float32 at ``target_sample_rate``.

    Args:
        samples: the samples' bytes (4 bytes each, little-endian float32).
        sample_rate: their rate in Hz; resampled with soxr when different.
        max_duration_s: if set, longer audio is refused.

    Returns:
        ``[num_samples]`` float32.

    Raises:
        AudioError: empty, byte length not a multiple of 4, bad sample rate,
            NaN/inf samples, or too long.
    """
    _check_sample_rate(sample_rate)
    if len(samples) == 0:
        raise AudioError("empty audio: received 0 PCM bytes; send little-endian float32 mono samples")
    if len(samples) % 4:
        raise AudioError(
            f"PCM byte length {len(samples)} is not a multiple of 4; samples must be little-endian float32 (4 bytes each)"
        )
    _check_duration(len(samples) // 4, sample_rate, max_duration_s)
    audio = np.frombuffer(samples, dtype="<f4").astype(np.float32)  # [num_samples], native order copy
    return _finish(audio, sample_rate, target_sample_rate)


def _check_wav_complete(data: bytes) -> None:
    """Refuses a RIFF/WAVE file whose ``data`` chunk is shorter than its header says.

    libsndfile silently decodes what is there, which would transcribe part of
    a file cut off in transit.
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


def _check_sample_rate(rate: int) -> None:
    if (
        isinstance(rate, bool)
        or not isinstance(rate, (int, np.integer))
        or not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE
    ):
        raise AudioError(
            f"bad sample rate {rate!r} Hz; must be an integer between {MIN_SAMPLE_RATE} and {MAX_SAMPLE_RATE}"
        )


def _check_duration(num_samples: int, rate: int, max_duration_s: float | None) -> None:
    if max_duration_s is None:
        return
    duration = num_samples / rate
    if duration > max_duration_s:
        raise AudioError(f"audio is {duration:.2f}s long; the maximum is {max_duration_s:.2f}s; send a shorter clip")


def _finish(audio: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    if not np.isfinite(audio).all():
        raise AudioError("audio contains NaN or infinite samples; send finite float samples")
    if rate != target_rate:
        audio = soxr.resample(audio, rate, target_rate, quality="HQ")
    return np.ascontiguousarray(audio, dtype=np.float32)
