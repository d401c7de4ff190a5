"""decoder_svc.session.audio: WAV/FLAC decoding, mixdown, resampling and the errors users see."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile as sf

from decoder_svc.session.audio import AudioError, decode_audio, pcm_to_array


def _tone(rate: int, seconds: float, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _encode(audio: np.ndarray, rate: int, fmt: str, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _assert_close_to_tone(out: np.ndarray, seconds: float, amp: float, atol: float = 2e-3):
    ref = _tone(16_000, seconds, amp=amp)  # the same tone sampled directly at 16 kHz
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(len(out) - len(ref)) <= 1
    n = min(len(out), len(ref))
    edge = 400  # resampler filter edges
    np.testing.assert_allclose(out[edge : n - edge], ref[edge : n - edge], atol=atol)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_16k_mono_passes_through(fmt):
    tone = _tone(16_000, 1.0)
    out = decode_audio(_encode(tone, 16_000, fmt))
    assert len(out) == 16_000
    np.testing.assert_allclose(out, tone, atol=1 / 32768 + 1e-6)  # 16-bit quantisation only


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
@pytest.mark.parametrize("rate", [44_100, 8_000])
def test_stereo_is_mixed_down_and_resampled(fmt, rate):
    seconds = 1.5
    left = _tone(rate, seconds, amp=0.6)
    stereo = np.stack([left, np.zeros_like(left)], axis=1)  # [frames, 2]
    out = decode_audio(_encode(stereo, rate, fmt))
    assert len(out) == pytest.approx(16_000 * seconds, abs=1)
    _assert_close_to_tone(out, seconds, amp=0.3)  # mean of the two channels


def test_float_wav_and_max_duration():
    data = _encode(_tone(44_100, 2.0), 44_100, "WAV", subtype="FLOAT")
    assert len(decode_audio(data, max_duration_s=2.5)) == 32_000
    with pytest.raises(AudioError, match=r"2\.00s.*1\.00s"):
        decode_audio(data, max_duration_s=1.0)


def test_nan_samples_rejected():
    tone = _tone(16_000, 0.1)
    tone[5] = np.nan
    with pytest.raises(AudioError, match="NaN"):
        decode_audio(_encode(tone, 16_000, "WAV", subtype="FLOAT"))


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"this is not audio at all" * 10, "cannot decode"),
        (bytes(range(256)) * 4, "cannot decode"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "cannot decode"),
    ],
)
def test_garbage_rejected(data, match):
    with pytest.raises(AudioError, match=match):
        decode_audio(data)


def test_zero_length_audio_rejected():
    with pytest.raises(AudioError, match="no samples"):
        decode_audio(_encode(np.zeros(0, np.float32), 16_000, "WAV"))  # a 44-byte header, no data


def test_header_only_flac_rejected():
    # libsndfile writes nothing for an empty FLAC, so build the header by hand:
    # "fLaC" + STREAMINFO (16 kHz, mono, 16 bit, total samples 0 = unknown), no frames.
    bits = (16_000 << 44) | (0 << 41) | (15 << 36)
    streaminfo = struct.pack(">HH", 4096, 4096) + bytes(6) + bits.to_bytes(8, "big") + bytes(16)
    data = b"fLaC" + bytes([0x80, 0, 0, len(streaminfo)]) + streaminfo
    with pytest.raises(AudioError):
        decode_audio(data)


def test_unsupported_format_rejected():
    data = _encode(_tone(16_000, 0.5), 16_000, "OGG", subtype="VORBIS")
    with pytest.raises(AudioError, match="unsupported audio format OGG"):
        decode_audio(data)


def test_audio_error_is_value_error():
    assert issubclass(AudioError, ValueError)


def test_pcm_round_trip_and_resample():
    tone = _tone(16_000, 0.5)
    out = pcm_to_array(tone.astype("<f4").tobytes(), 16_000)
    np.testing.assert_array_equal(out, tone)
    out = pcm_to_array(_tone(44_100, 1.0).astype("<f4").tobytes(), 44_100)
    _assert_close_to_tone(out, 1.0, amp=0.5)


@pytest.mark.parametrize(
    "samples, rate, match",
    [
        (b"\x00\x00\x80\x3f\x00", 16_000, "not a multiple of 4"),
        (b"", 16_000, "empty"),
        (b"\x00" * 8, 0, "sample rate"),
        (b"\x00" * 8, -16_000, "sample rate"),
        (b"\x00" * 8, 10_000_000, "sample rate"),
        (np.array([0.0, np.inf], "<f4").tobytes(), 16_000, "infinite"),
        (np.zeros(32_000, "<f4").tobytes(), 16_000, r"2\.00s.*1\.00s"),
    ],
)
def test_pcm_errors(samples, rate, match):
    with pytest.raises(AudioError, match=match):
        pcm_to_array(samples, rate, max_duration_s=1.0)


def test_truncated_wav_is_refused():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(16000, dtype=np.float32), 16000, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    assert len(decode_audio(data)) == 16000
    with pytest.raises(AudioError, match="truncated"):
        decode_audio(data[: len(data) // 2])


def test_undecodable_message_has_no_python_reprs():
    with pytest.raises(AudioError) as info:
        decode_audio(b"definitely not audio" * 20)
    assert "BytesIO" not in str(info.value) and "WAV or FLAC" in str(info.value)
