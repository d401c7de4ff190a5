"""Any audio or video file FFmpeg's libraries read, through PyAV (``av``): the first audio stream, decoded
frame by frame, downmixed and resampled to mono at 16 kHz by FFmpeg's resampler (libswresample via
``av.AudioResampler``).

That is faster-whisper's ``decode_audio`` (``faster_whisper/audio.py``) and openai-whisper's ``load_audio``
(``ffmpeg -ac 1 -ar 16000 -f s16le``) conversion, so a file gives the samples those runtimes transcribe: an
integer output format makes libswresample normalise its downmix matrix to unit gain (stereo: (L + R) / 2; 5.1:
FFmpeg's centre / surround levels scaled to sum to 1, LFE dropped). The output is s32, not their s16, so
samples differ from theirs by at most s16's half step (2^-16).

Memory is bounded by the output (at most ``max_duration_s`` of 16 kHz float32) plus one decoded frame,
whatever the input's rate and channel count: frames are converted as they come and decoding stops the moment
the decoded length passes the limit. The demuxers probed are a fixed list of audio / video containers
(``DEMUXERS``), and no demuxer may open another file or URL (``protocol_whitelist``), so an upload cannot
name a playlist or a local path.
"""

from __future__ import annotations

import io

import av
import numpy as np

from decoder_svc.session.audio_limits import FORMATS_HINT, AudioError, AudioLimits
from decoder_svc.session.pcm_buffer import PcmBuffer

# The containers probed (FFmpeg demuxer names). Raw PCM variants (s16le, alaw...) cannot be probed from bytes;
# playlists and multi-file demuxers (hls, concat, image2...) are left out on purpose.
DEMUXERS = (
    "wav,w64,flac,mp3,aac,ac3,eac3,mov,mp4,m4a,ogg,matroska,webm,aiff,caf,amr,au,wv,ape,tta,asf,avi,flv,"
    "mpeg,mpegts,dts,voc,mpc,mpc8,shn,rm,dsf,tak"
)
_OPEN_OPTIONS = {"format_whitelist": DEMUXERS, "protocol_whitelist": "none"}
# Demuxers whose header states the stream's length exactly (sample counts, not a bitrate estimate): a file
# that decodes to less than it declares was cut off, and one that declares more than the limit is refused
# before decoding. FFmpeg names the QuickTime family "mov,mp4,m4a,3gp,3g2,mj2" and Matroska "matroska,webm".
_EXACT_LENGTH = ("wav", "w64", "flac", "mov", "matroska", "ogg", "aiff", "caf", "wv", "tta", "ape")
# Of those, the lossless ones count every sample in the header: any shortfall is a cut-off or damaged file
# (FFmpeg's FLAC decoder skips a frame it cannot read and resyncs on the next).
_EXACT_SAMPLES = ("wav", "w64", "flac", "aiff", "caf", "wv", "tta", "ape")
# A decoded length this much shorter than the declared one is a cut-off or damaged file (seconds). Lossy codecs'
# priming and padding differ from the header by a frame or two, far below 0.5 s; lossless ones by nothing.
_TRUNCATION_SLACK_S = 0.5
_EXACT_SLACK_S = 0.001


def decode_av(data: bytes, limits: AudioLimits, target_sample_rate: int) -> np.ndarray:
    """Decodes the first audio stream of a file FFmpeg reads to mono float32.

    Args:
        data: the whole file's bytes.
        limits: the longest duration, highest sample rate and most channels accepted.
        target_sample_rate: output rate in Hz.

    Returns:
        ``[num_samples]`` float32 in [-1, 1) at ``target_sample_rate``.

    Raises:
        AudioError: not a container of ``DEMUXERS``, no audio stream, a rate / channel count / declared or
            decoded length over ``limits``, a corrupt or cut-off stream, no samples, NaN / inf samples.
    """
    with _open(data) as container:
        stream, kind, names, declared_s = _checked_stream(container, limits)
        audio, decoded_s = _decode_stream(container, stream, limits, target_sample_rate, kind, declared_s)
    exact = any(name in _EXACT_LENGTH for name in names)
    slack_s = _EXACT_SLACK_S if any(name in _EXACT_SAMPLES for name in names) else _TRUNCATION_SLACK_S
    if audio.size == 0:
        raise AudioError(f"the {kind} file decodes to no samples (zero length); send audio with at least one sample")
    if "ogg" in names and not _ogg_ends(data):
        raise AudioError(
            f"the {kind} file is truncated: its last page does not end the stream (no end-of-stream flag) after "
            f"{decoded_s:.3f} s; send the whole file"
        )
    if exact and declared_s is not None and decoded_s < declared_s - slack_s:
        raise AudioError(
            f"the {kind} file is truncated or damaged: its header declares {declared_s:.3f} s but only "
            f"{decoded_s:.3f} s could be decoded; send the whole file"
        )
    return audio


def probe_av(data: bytes, limits: AudioLimits) -> float:
    """The input samples (frames x channels) decoding ``data`` would read, from its header only: what
    ``decode_av`` takes time in proportion to. A stream that states no length counts ``limits.max_duration_s``
    (or an hour).

    Raises:
        AudioError: what ``decode_av`` refuses from the header (no container, no audio stream, a rate, channel
            count or declared length over ``limits``).
    """
    with _open(data) as container:
        stream, _, _, declared_s = _checked_stream(container, limits)
        seconds = declared_s if declared_s is not None else (limits.max_duration_s or 3600.0)
        cc = stream.codec_context
        return float(seconds * cc.sample_rate * cc.channels)


def _open(data: bytes):
    try:
        return av.open(io.BytesIO(data), mode="r", options=_OPEN_OPTIONS, metadata_errors="ignore")
    except av.FFmpegError as e:
        raise AudioError(
            f"audio cannot be decoded ({len(data)} bytes): FFmpeg cannot open it as an audio or video file "
            f"({_reason(e)}), so it is corrupt, truncated or not audio; {FORMATS_HINT}"
        ) from None


def _checked_stream(container, limits: AudioLimits):
    """The first audio stream, its container's name and demuxer names, and its declared length (seconds or
    None), after the checks its header allows: rate, channels, and the declared length where it is exact."""
    kind = container.format.long_name or container.format.name
    stream = next((s for s in container.streams if s.type == "audio"), None)
    if stream is None:
        raise AudioError(f"the {kind} file has no audio stream; {FORMATS_HINT}")
    cc = stream.codec_context
    limits.check_rate(cc.sample_rate)
    limits.check_channels(cc.channels)
    names = container.format.name.split(",")
    declared_s = _declared_s(container, stream)
    if declared_s is not None and any(name in _EXACT_LENGTH for name in names):
        limits.check_duration(declared_s, " by its header")
    return stream, kind, names, declared_s


def _decode_stream(
    container, stream, limits: AudioLimits, rate: int, kind: str, declared_s: float | None
) -> tuple[np.ndarray, float]:
    """Demuxes and decodes ``stream`` frame by frame; returns (``[N]`` float32 at ``rate``, seconds decoded)."""
    expected_s = min(declared_s or 0.0, limits.max_duration_s or float("inf"))
    out = PcmBuffer(int(expected_s * rate) + rate)  # written in place: the output is held once
    resampler, shape = None, None  # re-made when a frame's rate or layout changes mid-stream
    done_s, samples = 0.0, 0  # seconds before the current rate's run, samples within it (exact: no float drift)
    decoded_s = 0.0
    try:
        for packet in container.demux(stream):
            for frame in packet.decode():
                if (frame.sample_rate, frame.layout.name, frame.format.name) != shape:
                    limits.check_rate(frame.sample_rate)
                    limits.check_channels(frame.layout.nb_channels)
                    if resampler is not None:
                        _append(out, resampler.resample(None))
                        done_s, samples = decoded_s, 0
                    shape = (frame.sample_rate, frame.layout.name, frame.format.name)
                    resampler = av.AudioResampler(format="s32", layout="mono", rate=rate)
                samples += frame.samples
                decoded_s = done_s + samples / frame.sample_rate
                limits.check_duration(decoded_s, stopped=True)
                _append(out, resampler.resample(frame))
        if resampler is not None:
            _append(out, resampler.resample(None))
    except av.FFmpegError as e:
        at = f" after {decoded_s:.2f} s" if decoded_s else ""
        raise AudioError(
            f"cannot decode the {kind} file{at}: {_reason(e)}; the file is corrupt or truncated, send it again whole"
        ) from None
    return out.samples(), decoded_s


def _append(out: PcmBuffer, frames) -> None:
    for frame in frames:  # packed s32 mono: [1, samples] int32 each, scaled into [-1, 1)
        out.append(frame.to_ndarray().reshape(-1), 2.0**-31)


def _ogg_ends(data: bytes, tail: int = 1 << 16) -> bool:
    """Whether the last Ogg page in ``data`` carries the end-of-stream flag (RFC 3533 section 6: capture pattern
    "OggS", version 0, header type bit 0x04). FFmpeg takes an Ogg file's length from the last page it finds, so
    a file cut off "declares" only what arrived; its last page then lacks the flag (or is itself cut)."""
    pos = len(data)
    start = max(0, len(data) - tail)
    while True:
        pos = data.rfind(b"OggS", start, pos)
        if pos < 0:
            return False
        header = data[pos : pos + 27]
        if len(header) == 27 and header[4] == 0 and not header[5] & ~0x07:
            segments = header[26]
            table = data[pos + 27 : pos + 27 + segments]
            end = pos + 27 + segments + sum(table)
            return len(table) == segments and end <= len(data) and bool(header[5] & 0x04)
        # "OggS" inside a packet's data: keep looking before it


def _declared_s(container, stream) -> float | None:
    """The stream's length from the header, in seconds; None where the container does not state it."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _reason(e: av.FFmpegError) -> str:
    return (getattr(e, "strerror", None) or str(e)).rstrip(".").lower()
