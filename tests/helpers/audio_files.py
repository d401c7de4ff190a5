"""Audio files for the decoding tests, made here: every container / codec a user sends, encoded with PyAV's
(FFmpeg's) encoders from 16 kHz mono samples, and silent FLAC files of any rate, channel count and declared
length written byte by byte (an encoder takes seconds per minute of 384 kHz x 8 channels; these take
milliseconds, and their header may claim more audio than the file holds).
"""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import soundfile as sf
import soxr

# name -> (PyAV container format, codec, sample rate Hz, channel layout, lossless, video track)
FORMATS = {
    "wav-8k-mono": ("wav", "pcm_s16le", 8_000, "mono", True, False),
    "flac-8k-mono": ("flac", "flac", 8_000, "mono", True, False),
    "wav-44k-stereo": ("wav", "pcm_s16le", 44_100, "stereo", True, False),
    "flac-44k-stereo": ("flac", "flac", 44_100, "stereo", True, False),
    "wav-48k-5.1": ("wav", "pcm_s16le", 48_000, "5.1", True, False),
    "flac-48k-5.1": ("flac", "flac", 48_000, "5.1", True, False),
    "mp3-44k-stereo": ("mp3", "libmp3lame", 44_100, "stereo", False, False),
    "m4a-aac-48k-mono": ("ipod", "aac", 48_000, "mono", False, False),  # FFmpeg's muxer name for .m4a
    "mp4-aac-48k-5.1": ("mp4", "aac", 48_000, "5.1", False, False),
    "ogg-opus-48k-stereo": ("ogg", "libopus", 48_000, "stereo", False, False),
    "webm-opus-48k-mono": ("webm", "libopus", 48_000, "mono", False, False),
    "ogg-vorbis-44k-stereo": ("ogg", "vorbis", 44_100, "stereo", False, False),
    "mp4-video-aac-44k-stereo": ("mp4", "aac", 44_100, "stereo", False, True),
}
# The lossless file each lossless format is compared with: the WAV of the same rate and layout.
SAME_AS_WAV = {"flac-8k-mono": "wav-8k-mono", "flac-44k-stereo": "wav-44k-stereo", "flac-48k-5.1": "wav-48k-5.1"}


def encode_file(pcm_16k: np.ndarray, name: str) -> bytes:
    """``pcm_16k`` (``[N]`` float32 at 16 kHz) as the file ``FORMATS[name]`` describes.

    The samples are resampled to the format's rate with soxr and put on every channel at half amplitude (so
    FFmpeg's downmix of 5.1, which sums the channels with gains up to 1, stays within [-1, 1]).
    """
    container_format, codec, rate, layout, _, video = FORMATS[name]
    audio = soxr.resample(pcm_16k.astype(np.float32), 16_000, rate, quality="HQ") if rate != 16_000 else pcm_16k
    channels = av.AudioLayout(layout).nb_channels
    planes = np.tile(0.5 * audio.astype(np.float32), (channels, 1))  # [channels, frames], fltp
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_format) as out:
        picture = None
        if video:
            picture = out.add_stream("mpeg4", rate=10)
            picture.width, picture.height, picture.pix_fmt = 64, 48, "yuv420p"
        stream = out.add_stream(codec, rate=rate, layout=layout)
        if codec == "vorbis":
            stream.codec_context.options = {"strict": "experimental"}  # FFmpeg's own vorbis encoder
        step = stream.codec_context.frame_size or 1024
        sample_fmt = stream.codec_context.format.name
        for start in range(0, planes.shape[1], step):
            block = planes[:, start : start + step]
            frame = av.AudioFrame.from_ndarray(_as_format(block, sample_fmt), format=sample_fmt, layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
        if picture is not None:
            for i in range(max(1, int(10 * len(audio) / rate))):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i % 255, np.uint8), format="rgb24")
                for packet in picture.encode(frame.reformat(format="yuv420p")):
                    out.mux(packet)
            for packet in picture.encode(None):
                out.mux(packet)
    return buf.getvalue()


def video_only_mp4() -> bytes:
    """Half a second of MPEG-4 video in an mp4, with no audio track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        for _ in range(5):
            for packet in video.encode(av.VideoFrame(64, 48, "yuv420p")):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _as_format(block: np.ndarray, sample_fmt: str) -> np.ndarray:
    """``[channels, n]`` float32 in the layout PyAV wants for ``sample_fmt`` (planar ``[channels, n]``, packed
    ``[1, n * channels]`` interleaved)."""
    planar = sample_fmt.endswith("p")
    if sample_fmt.startswith("s16"):
        block = np.clip(np.round(block * 32767), -32768, 32767).astype(np.int16)
    elif sample_fmt.startswith("s32"):
        block = np.clip(np.round(block * 2147483647.0), -(2**31), 2**31 - 1).astype(np.int32)
    else:
        block = block.astype(np.float32)
    return np.ascontiguousarray(block if planar else block.T.reshape(1, -1))


def wav_bytes(pcm: np.ndarray, rate: int = 16_000, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


# --- silent FLAC, byte by byte (https://xiph.org/flac/format.html) ---------------------------------------------

MAX_BLOCK = 65535  # FLAC's largest block (samples per channel per frame)


def silent_flac(seconds: float, rate: int, channels: int, declared_seconds: float | None = None) -> bytes:
    """A valid 16-bit FLAC of ``seconds`` of digital silence: STREAMINFO, then frames of CONSTANT subframes
    (3 bytes a channel), so 600 s of 8 channels at 384 kHz is about 130 KB.

    Args:
        seconds: the audio the frames hold.
        rate: sample rate in Hz (STREAMINFO's 20 bits: up to 655350).
        channels: 1 to 8.
        declared_seconds: the length STREAMINFO states (default ``seconds``): more than the frames hold makes
            a header that claims hours of audio.
    """
    total = round(seconds * rate)
    declared = round((seconds if declared_seconds is None else declared_seconds) * rate)
    info = struct.pack(">HH", MAX_BLOCK, MAX_BLOCK) + bytes(6)  # block sizes; frame sizes unknown
    bits = (rate << 44) | ((channels - 1) << 41) | (15 << 36) | declared  # rate, channels-1, bps-1, total samples
    info += bits.to_bytes(8, "big") + bytes(16)  # + MD5 unknown
    out = bytearray(b"fLaC" + bytes([0x80, 0, 0, len(info)]) + info)  # last metadata block: STREAMINFO
    for number, start in enumerate(range(0, total, MAX_BLOCK)):
        block = min(MAX_BLOCK, total - start)
        header = bytearray([0xFF, 0xF8, 0x70, ((channels - 1) << 4) | (0b100 << 1)])  # fixed blocks; 16 bit
        header += chr(number).encode("utf-8", "surrogatepass") + struct.pack(">H", block - 1)
        header.append(_crc8(header))
        frame = header + b"\x00\x00\x00" * channels  # CONSTANT subframe, value 0, per channel
        out += frame + struct.pack(">H", _crc16(frame))
    return bytes(out)


def _crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc
