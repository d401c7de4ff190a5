"""End to end: every audio format a user has, through the real services (the session's tiny.en stack).

Files are made from a bundled clip with PyAV's encoders (``helpers.audio_files``). Lossless ones must give the
tokens of the WAV of the same rate and layout; lossy ones the text faster-whisper's ``decode_audio`` of the same
file gives when its samples are sent to our services as raw PCM (our FFmpeg path matches those samples within
s16's half step: tests/decoder/test_audio.py). Oversized, truncated, corrupt and non-audio uploads get
INVALID_ARGUMENT naming the problem, leave no block or Redis record behind, and the decoder's peak RSS (read from
/proc after resetting it) stays bounded while they decode.
"""

from __future__ import annotations

import io
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.audio_files import FORMATS, SAME_AS_WAV, encode_file, silent_flac, video_only_mp4, wav_bytes
from test_e2e_whisper import assert_all_blocks_free

from decoder_svc.session.audio import decode_audio
from encdec import DATA_DIR
from shared.proto import decoder_pb2

CLIP = "sample.wav"
RSS_GROWTH_LIMIT = 300 * 2**20  # bytes: the bound on the decoder's peak RSS growth


@pytest.fixture(scope="module")
def speech():
    return decode_audio((DATA_DIR / CLIP).read_bytes())  # [N] float32 16 kHz


def transcribe(stub, request_id: str = "", **inp) -> tuple[list[int], str]:
    request = decoder_pb2.GenerateRequest(request_id=request_id, **inp)
    messages = list(stub.Generate(request, timeout=180))
    assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP
    return [t for m in messages for t in m.token_ids], "".join(m.text for m in messages).strip()


def refused(stub, **inp) -> str:
    """The INVALID_ARGUMENT details of a request; checks no Redis record was left behind."""
    request_id = f"bad-audio-{uuid.uuid4().hex[:8]}"
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(decoder_pb2.GenerateRequest(request_id=request_id, **inp), timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    return info.value.details()


def peak_rss(pid: int) -> int:
    """VmHWM of ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak_rss(pid: int) -> int:
    """Resets ``pid``'s VmHWM to its current RSS (``clear_refs`` 5, Linux >= 4.0); returns it in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return peak_rss(pid)


def test_every_format_transcribes_as_its_reference(tiny_stub, speech):
    files = {name: encode_file(speech, name) for name in FORMATS}
    import faster_whisper.audio

    references = {
        name: faster_whisper.audio.decode_audio(io.BytesIO(data))
        for name, data in files.items()
        if not FORMATS[name][4]  # lossy: faster-whisper's samples, sent as raw PCM
    }
    with ThreadPoolExecutor(4) as pool:
        ours = {name: pool.submit(transcribe, tiny_stub, audio=data) for name, data in files.items()}
        theirs = {
            name: pool.submit(
                transcribe, tiny_stub, pcm=decoder_pb2.PcmAudio(samples=pcm.astype("<f4").tobytes(), sample_rate=16_000)
            )
            for name, pcm in references.items()
        }
        original = pool.submit(transcribe, tiny_stub, audio=(DATA_DIR / CLIP).read_bytes())
        ours = {name: f.result() for name, f in ours.items()}
        theirs = {name: f.result() for name, f in theirs.items()}
    _, original_text = original.result()
    for name, wav_name in SAME_AS_WAV.items():
        assert ours[name][0] == ours[wav_name][0], name  # lossless: the WAV's tokens
    for name, (_, text) in theirs.items():
        assert ours[name][1] == text, name  # lossy: faster-whisper's decoding of the same file
    assert len(original_text) > 20
    for name, (_, text) in ours.items():  # every format still says the clip's words
        assert text.lower()[:20] == original_text.lower()[:20], (name, text, original_text)
    assert_all_blocks_free(tiny_stub)


def test_pcm_s16le_gives_the_wavs_tokens(tiny_stub, speech):
    as_int16 = np.round(np.clip(speech, -1, 1) * 32767).astype("<i2")
    wav = wav_bytes(as_int16.astype(np.float32) / 32768)
    pcm = decoder_pb2.PcmAudio(samples=as_int16.tobytes(), sample_rate=16_000, encoding="pcm_s16le")
    assert transcribe(tiny_stub, pcm=pcm)[0] == transcribe(tiny_stub, audio=wav)[0]
    details = refused(tiny_stub, pcm=decoder_pb2.PcmAudio(samples=b"\x00" * 64, sample_rate=16_000, encoding="ulaw"))
    assert "unknown PCM encoding 'ulaw'" in details and "pcm_s16le" in details


def test_float_pcm_that_is_not_audio_is_invalid_argument(tiny_stub, speech):
    """Float samples of 1e38 (once decoded to 446 "!" tokens), inf / NaN, or beyond +-64 in a float WAV are refused
    before any decoding, with a message saying what to send."""
    cases = {
        "1e38": (np.array([0.1, 1e38] * 8000, "<f4"), "reach 1e+38"),
        "inf": (np.array([0.1, np.inf] * 8000, "<f4"), "NaN or infinite"),
        "nan": (np.array([np.nan, 0.0] * 8000, "<f4"), "NaN or infinite"),
        "65": (np.full(16_000, 65.0, "<f4"), "reach 65"),
    }
    for name, (samples, words) in cases.items():
        details = refused(tiny_stub, pcm=decoder_pb2.PcmAudio(samples=samples.tobytes(), sample_rate=16_000))
        assert words in details and "[-1, 1]" in details and "pcm_s16le" in details, (name, details)
    details = refused(tiny_stub, audio=wav_bytes(np.clip(speech * 1000, -100, 100), subtype="FLOAT"))
    assert "reach 100" in details and "+-64" in details, details
    assert_all_blocks_free(tiny_stub)


def test_bad_files_get_invalid_argument_and_leak_nothing(tiny_stub, speech):
    wav = encode_file(speech, "wav-44k-stereo")
    webm = encode_file(speech, "webm-opus-48k-mono")
    m4a = bytearray(encode_file(speech, "m4a-aac-48k-mono"))
    m4a[len(m4a) // 2 : len(m4a) // 2 + 2000] = bytes(2000)  # a zeroed stretch in the middle of the AAC data
    cases = {
        "truncated WAV": (wav[: len(wav) // 2], "truncated"),
        "truncated webm": (webm[: int(len(webm) * 0.9)], "truncated"),
        "corrupt m4a": (bytes(m4a), "corrupt"),
        "zero-length": (b"", "empty"),
        "header-only WAV": (wav_bytes(np.zeros(0, np.float32)), "no samples"),
        "text": (b"this is a text file, not audio\n" * 40, "audio cannot be decoded"),
        "PNG": (b"\x89PNG\r\n\x1a\n" + bytes(4000), "audio cannot be decoded"),
        "video without audio": (video_only_mp4(), "no audio stream"),
    }
    for name, (data, words) in cases.items():
        details = refused(tiny_stub, audio=data)
        assert words in details, (name, details)
    assert transcribe(tiny_stub, audio=(DATA_DIR / CLIP).read_bytes())[1]  # still serving
    assert_all_blocks_free(tiny_stub)


def test_oversized_uploads_are_refused_while_the_decoder_serves(tiny_services, tiny_stub):
    """600 s x 8 channels x 384 kHz (under 1 MB of FLAC) is over --max-audio-sample-rate: 8 sent at once are all
    refused from the header; a header claiming 2 hours is refused before its frames are read; a request beside
    them completes."""
    pid = tiny_services.process("decoder").pid
    huge = silent_flac(600, 384_000, 8)
    claims_hours = silent_flac(2, 48_000, 2, declared_seconds=7200)
    assert len(huge) < 25_000_000
    before = reset_peak_rss(pid)
    with ThreadPoolExecutor(9) as pool:
        bursts = [pool.submit(refused, tiny_stub, audio=huge) for _ in range(8)]
        beside = pool.submit(transcribe, tiny_stub, audio=(DATA_DIR / CLIP).read_bytes())
        for future in bursts:
            assert "384000 Hz is above this server's limit of 192000 Hz (--max-audio-sample-rate)" in future.result()
        assert beside.result()[1]
    assert "7200.00s long by its header; the maximum is 600.00s (--max-audio-s)" in refused(
        tiny_stub, audio=claims_hours
    )
    assert peak_rss(pid) - before < RSS_GROWTH_LIMIT
    assert_all_blocks_free(tiny_stub)


def test_large_uploads_decode_in_bounded_memory(tiny_services, tiny_stub):
    """A 600 s x 8-channel x 48 kHz silent FLAC (28.8 M frames: 922 MB as float32 at once) decodes with the
    decoder's peak RSS growing by less than 300 MB and transcribes to nothing (the VAD hears no speech); then a
    burst of four such uploads (120 s each) queues on the decode pool while a request beside them completes."""
    pid = tiny_services.process("decoder").pid
    before = reset_peak_rss(pid)
    assert transcribe(tiny_stub, audio=silent_flac(600, 48_000, 8))[1] == ""
    growth = peak_rss(pid) - before
    print(f"decoder peak RSS growth for a 600 s x 8 ch x 48 kHz FLAC: {growth / 2**20:.0f} MB")
    assert growth < RSS_GROWTH_LIMIT, f"peak RSS grew {growth / 2**20:.0f} MB"
    burst = silent_flac(120, 48_000, 8)
    with ThreadPoolExecutor(5) as pool:
        silent = [pool.submit(transcribe, tiny_stub, audio=burst) for _ in range(4)]
        beside = pool.submit(transcribe, tiny_stub, audio=(DATA_DIR / CLIP).read_bytes())
        assert beside.result()[1]
        assert all(f.result()[1] == "" for f in silent)
    assert_all_blocks_free(tiny_stub)
