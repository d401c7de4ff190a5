"""decoder_svc.session.audio: every container and codec FFmpeg reads (PyAV), the libsndfile fast path, mixdown,
resampling, the limits, and the errors users see."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile as sf
from helpers.audio_files import FORMATS, SAME_AS_WAV, encode_file, silent_flac, video_only_mp4, wav_bytes

from decoder_svc.session.audio import AudioError, AudioLimits, decode_audio, pcm_to_array
from encdec import DATA_DIR

# faster-whisper's decode_audio returns s16 samples / 32768; ours keep s32 from the same resampler (audio_av).
FW_TOLERANCE = 2.0**-15


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


@pytest.fixture(scope="module")
def speech():
    return decode_audio((DATA_DIR / "sample.wav").read_bytes())  # [N] float32, 16 kHz


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
    _assert_close_to_tone(out, seconds, amp=0.3)  # mean of the two channels (FFmpeg's normalised downmix too)


def test_six_channels_take_ffmpegs_normalised_downmix():
    """5.1 goes through FFmpeg: the tone on the centre channel only comes out at the centre's share of the
    unit-gain matrix (1 / (1 + 2 x 1/sqrt(2) + 2 x 1/2): front left/right at -3 dB, surrounds at -6 dB... as
    libswresample builds it), not at a sixth of it as a channel mean would."""
    tone = _tone(48_000, 1.0, amp=0.8)
    channels = np.zeros((len(tone), 6), np.float32)
    channels[:, 2] = tone  # WAV 5.1 order: FL FR FC LFE BL BR
    out = decode_audio(_encode(channels, 48_000, "WAV"))
    ratio = np.abs(out[2000:-2000]).max() / 0.8
    assert 0.25 < ratio < 0.45, ratio


def test_float_wav_and_max_duration():
    data = _encode(_tone(44_100, 2.0), 44_100, "WAV", subtype="FLOAT")
    assert len(decode_audio(data, max_duration_s=2.5)) == 32_000
    with pytest.raises(AudioError, match=r"2\.00s long by its header.*1\.00s \(--max-audio-s\)"):
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
        (b"this is not audio at all" * 10, "cannot be decoded"),
        (bytes(range(256)) * 4, "cannot be decoded"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "cannot be decoded"),
        (b"\x89PNG\r\n\x1a\n" + bytes(2000), "cannot be decoded"),
        (b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n", "cannot be decoded"),
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
    with pytest.raises(AudioError, match="no samples"):
        decode_audio(data)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_decodes_as_faster_whisper_does(speech, name):
    """Each container / codec decodes to the clip's length; those FFmpeg converts (all but mono / stereo WAV
    and FLAC) give faster-whisper's ``decode_audio`` samples within its s16 step."""
    fw_audio = pytest.importorskip("faster_whisper.audio")
    data = encode_file(speech, name)
    out = decode_audio(data)
    assert out.dtype == np.float32 and abs(len(out) - len(speech)) < 0.05 * 16_000  # codec padding only
    _, _, _, layout, lossless, _ = FORMATS[name]
    reference = fw_audio.decode_audio(io.BytesIO(data))
    assert len(out) == len(reference)
    if lossless and layout in ("mono", "stereo"):  # libsndfile + soxr: the resamplers differ a little
        np.testing.assert_allclose(out, reference, atol=1e-2)
    else:
        np.testing.assert_allclose(out, reference, atol=FW_TOLERANCE)


@pytest.mark.parametrize("name", ["flac-8k-mono", "flac-44k-stereo", "flac-48k-5.1"])
def test_lossless_formats_equal_the_wav(speech, name):
    np.testing.assert_array_equal(
        decode_audio(encode_file(speech, name)), decode_audio(encode_file(speech, SAME_AS_WAV[name]))
    )


def test_video_only_file_has_no_audio_stream():
    with pytest.raises(AudioError, match="has no audio stream"):
        decode_audio(video_only_mp4())


@pytest.mark.parametrize(
    "name, match",
    [
        ("wav-44k-stereo", "WAV file is truncated"),
        ("flac-48k-5.1", "corrupt or truncated"),
        ("m4a-aac-48k-mono", "corrupt, truncated or not audio"),
        ("webm-opus-48k-mono", "is truncated or damaged: its header declares 7.2"),
        ("ogg-opus-48k-stereo", "the Ogg file is truncated: its last page does not end the stream"),
        ("ogg-vorbis-44k-stereo", "the Ogg file is truncated"),
    ],
)
def test_truncated_files_are_refused(speech, name, match):
    data = encode_file(speech, name)
    with pytest.raises(AudioError, match=match):
        decode_audio(data[: int(len(data) * 0.9)])


@pytest.mark.parametrize("name", ["mp3-44k-stereo", "m4a-aac-48k-mono", "flac-48k-5.1", "ogg-vorbis-44k-stereo"])
def test_corrupt_middle_is_refused(speech, name):
    data = bytearray(encode_file(speech, name))
    middle = len(data) // 2
    data[middle : middle + 2000] = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    with pytest.raises(AudioError, match="corrupt|truncated"):
        decode_audio(bytes(data))


def test_rate_and_channel_limits_refuse_before_decoding():
    data = silent_flac(600, 384_000, 8)  # 600 s of 8 channels at 384 kHz, ~130 KB
    assert len(data) < 1_000_000
    with pytest.raises(AudioError, match=r"384000 Hz is above .* 192000 Hz \(--max-audio-sample-rate\)"):
        decode_audio(data, max_duration_s=600)
    with pytest.raises(AudioError, match=r"8 channels; .* at most 6 \(--max-audio-channels\)"):
        decode_audio(silent_flac(1, 48_000, 8), limits=AudioLimits(600, 192_000, 6))
    with pytest.raises(AudioError, match=r"7200\.00s long by its header; the maximum is 600\.00s"):
        decode_audio(silent_flac(1, 48_000, 8, declared_seconds=7200), max_duration_s=600)
    with pytest.raises(AudioError, match=r"7200\.00s long by its header"):  # mono: the libsndfile path
        decode_audio(silent_flac(1, 16_000, 1, declared_seconds=7200), max_duration_s=600)


def test_decode_cost_is_the_headers_input_samples_and_refuses_from_the_header(speech):
    from decoder_svc.session.audio import decode_cost

    limits = AudioLimits(600)
    assert decode_cost(encode_file(speech, "wav-44k-stereo"), limits) == pytest.approx(
        len(speech) * 44_100 / 16_000 * 2, abs=4
    )
    assert decode_cost(silent_flac(10, 48_000, 8), limits) == pytest.approx(10 * 48_000 * 8)
    assert decode_cost(encode_file(speech, "m4a-aac-48k-mono"), limits) == pytest.approx(7.27 * 48_000, rel=0.01)
    for data, words in [
        (silent_flac(600, 384_000, 8), "--max-audio-sample-rate"),
        (silent_flac(1, 48_000, 8, declared_seconds=7200), "7200.00s long by its header"),
        (b"", "audio is empty"),
        (b"not audio" * 50, "audio cannot be decoded"),
    ]:
        with pytest.raises(AudioError, match=words):
            decode_cost(data, limits)


def test_every_error_message_starts_with_audio():
    assert str(AudioError("the Ogg file is truncated")) == "audio: the Ogg file is truncated"
    assert str(AudioError("audio is empty")) == "audio is empty"


def test_decoding_stops_at_the_duration_limit(speech):
    mp3 = encode_file(speech, "mp3-44k-stereo")  # mp3 states no exact length: caught while decoding
    with pytest.raises(AudioError, match=r"longer than the maximum of 3\.00s .*decoding stopped at 3\.0"):
        decode_audio(mp3, max_duration_s=3.0)


def test_many_channels_high_rate_decode_in_bounded_memory():
    """600 s x 8 channels at 48 kHz (28.8 M frames, 922 MB as float32 at once) decodes to its 16 kHz output;
    the whole input is never materialised (tracemalloc sees numpy's allocations)."""
    import tracemalloc

    data = silent_flac(600, 48_000, 8)
    tracemalloc.start()
    try:
        out = decode_audio(data, max_duration_s=600)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(out) == 600 * 16_000 and not out.any()
    assert peak < 3 * out.nbytes, peak  # the output, its pieces before they are joined, one frame


def test_audio_error_is_value_error():
    assert issubclass(AudioError, ValueError)


def test_pcm_round_trip_and_resample():
    tone = _tone(16_000, 0.5)
    out = pcm_to_array(tone.astype("<f4").tobytes(), 16_000)
    np.testing.assert_array_equal(out, tone)
    out = pcm_to_array(_tone(44_100, 1.0).astype("<f4").tobytes(), 44_100)
    _assert_close_to_tone(out, 1.0, amp=0.5)


def test_pcm_s16le_equals_the_wav():
    tone = _tone(16_000, 0.5)
    as_int16 = np.round(tone * 32767).astype("<i2")
    out = pcm_to_array(as_int16.tobytes(), 16_000, encoding="pcm_s16le")
    np.testing.assert_array_equal(out, decode_audio(wav_bytes(as_int16.astype(np.float32) / 32768)))


@pytest.mark.parametrize(
    "samples, rate, encoding, match",
    [
        (b"\x00\x00\x80\x3f\x00", 16_000, "", "not a multiple of 4"),
        (b"\x00\x00\x00", 16_000, "pcm_s16le", "not a multiple of 2"),
        (b"", 16_000, "", "empty"),
        (b"\x00" * 8, 0, "", "sample rate"),
        (b"\x00" * 8, -16_000, "", "sample rate"),
        (b"\x00" * 8, 10_000_000, "", "above this server's limit"),
        (b"\x00" * 8, 16_000, "mulaw", "unknown PCM encoding 'mulaw'"),
        (np.array([0.0, np.inf], "<f4").tobytes(), 16_000, "", "infinite"),
        (np.array([0.0, np.nan], "<f4").tobytes(), 16_000, "", "NaN"),
        (np.array([0.1, 1e38], "<f4").tobytes(), 16_000, "", r"reach 1e\+38.*\[-1, 1\].*beyond \+-64.*pcm_s16le"),
        (np.array([-64.5, 0.0], "<f4").tobytes(), 16_000, "pcm_f32le", r"reach 64\.5"),
        (np.zeros(32_000, "<f4").tobytes(), 16_000, "", r"2\.00s.*1\.00s"),
    ],
)
def test_pcm_errors(samples, rate, encoding, match):
    with pytest.raises(AudioError, match=match):
        pcm_to_array(samples, rate, max_duration_s=1.0, encoding=encoding)


def test_float_pcm_within_the_amplitude_bound_is_taken():
    """Float samples overshooting full scale (clipped mixes, +30 dB) are audio; only beyond +-64 is refused."""
    loud = np.array([0.5, -1.5, 30.0, -64.0], "<f4")
    np.testing.assert_array_equal(pcm_to_array(loud.tobytes(), 16_000), loud)


def test_float_wav_samples_beyond_the_amplitude_bound_are_refused():
    tone = _tone(16_000, 0.1)
    tone[7] = 1e6
    with pytest.raises(AudioError, match=r"reach 1e\+06.*beyond \+-64.*scaled to \[-1, 1\]"):
        decode_audio(_encode(tone, 16_000, "WAV", subtype="FLOAT"))


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
    assert "BytesIO" not in str(info.value) and "mp3, m4a" in str(info.value)
