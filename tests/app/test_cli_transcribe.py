"""``encdec transcribe``: a file that fails is named in its error line; the Whisper flags become ``WhisperOptions``;
``--format json / srt / vtt`` and ``--timestamps word`` through real services (Whisper tiny.en, real CLI
processes), each output checked against the gRPC Generate of the same options.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from encdec import DATA_DIR
from encdec.cli import _whisper_options
from encdec.client import Transcript, render
from encdec.parser import build_parser
from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.subtitles import to_srt, to_vtt

ROOT = Path(__file__).resolve().parents[2]
CLIP = DATA_DIR / "sample.wav"
SEGMENT, WORD = decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT, decoder_pb2.TIMESTAMP_GRANULARITY_WORD


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "encdec.cli", "transcribe", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    missing = tmp_path / "missing.wav"
    result = cli("--address", "127.0.0.1:1", str(missing))
    assert result.returncode == 1
    assert f"error: {missing}: cannot read the file: No such file or directory" in result.stderr, result.stderr


# --- flags -> WhisperOptions (no services) -----------------------------------------------------------------------


def options(*argv: str) -> decoder_pb2.WhisperOptions | None:
    return _whisper_options(build_parser().parse_args(["transcribe", "a.wav", *argv]))


def test_no_whisper_flags_send_no_options():
    assert options() is None
    assert options("--temperature", "0.3") == decoder_pb2.WhisperOptions(temperatures=[0.3])


def test_whisper_flags_map_onto_whisper_options():
    got = options(
        *("--language", "de", "--task", "translate", "--prompt", "Names: Ada."),
        *("--timestamps", "word", "--vad", "--temperature", "0,0.5", "--no-condition-on-previous-text"),
        *("--compression-ratio-threshold", "2.0", "--logprob-threshold", "-0.5", "--no-speech-threshold", "0.7"),
    )
    want = decoder_pb2.WhisperOptions(
        language="de",
        task="translate",
        prompt="Names: Ada.",
        timestamps=WORD,
        vad_filter=True,
        temperatures=[0.0, 0.5],
        condition_on_previous_text=False,
        compression_ratio_threshold=2.0,
        logprob_threshold=-0.5,
        no_speech_threshold=0.7,
    )
    assert got == want
    got = options(
        *("--decoding-rules", "openai", "--best-of", "3", "--no-vad-gate", "--vad-gate-min-silence-s", "5"),
        *(
            "--hallucination-silence-threshold",
            "2",
            "--clip-timestamps",
            "0,12.5,30",
            "--language-detection-segments",
            "2",
        ),
    )
    want = decoder_pb2.WhisperOptions(
        decoding_rules="openai",
        best_of=3,
        vad_gate=False,
        vad_gate_min_silence_s=5.0,
        hallucination_silence_threshold=2.0,
        clip_timestamps=[0.0, 12.5, 30.0],
        language_detection_segments=2,
    )
    assert got == want
    assert options("--decoding-rules", "hf") == decoder_pb2.WhisperOptions(decoding_rules="hf")


@pytest.mark.parametrize("fmt", ["json", "srt", "vtt"])
def test_formats_other_than_text_ask_for_segments(fmt):
    assert options("--format", fmt).timestamps == SEGMENT
    assert options("--format", fmt, "--timestamps", "word").timestamps == WORD


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--format", "srt", "--timestamps", "none", "a.wav"], "needs segment timestamps"),
        (["--format", "vtt", "a.wav", "b.wav"], "needs --output-dir"),
        (["--format", "json", "--output-dir", "out", "x/a.wav", "y/a.flac"], "same name stem"),
        (["--temperature", "0,1.5", "a.wav"], "each temperature must be in [0, 1]"),
        (["--clip-timestamps", "0,x", "a.wav"], "expected seconds separated by commas"),
    ],
)
def test_contradictory_flags_exit_2(argv, message):
    result = cli("--address", "127.0.0.1:1", *argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_render_writes_float32_fields_as_their_shortest_decimal():
    word = decoder_pb2.Word(word=" Hello", start=0.1, end=0.42, probability=0.9)
    segment = decoder_pb2.Segment(id=0, start=0.0, end=1.3, text=" Hello.", tokens=[1, 2], avg_logprob=-0.25)
    segment.words.append(word)
    t = Transcript("a.wav", "r", " Hello.", [1, 2], "stop", 2, 0.1, segments=[segment], language="en", duration=1.5)
    body = json.loads(render(t, "json"))
    assert body["text"] == "Hello." and body["language"] == "en" and body["duration"] == 1.5
    assert body["segments"][0]["end"] == 1.3 and body["segments"][0]["words"] == [
        {"word": " Hello", "start": 0.1, "end": 0.42, "probability": 0.9}
    ]
    assert render(t, "srt") == "1\n00:00:00,000 --> 00:00:01,300\nHello.\n\n"


# --- through real services ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper(tiny_services):
    return tiny_services.decoder_address  # the session's tiny.en stack (tests/conftest.py)


def grpc_segments(address: str, clip: Path, timestamps: int) -> tuple[list, decoder_pb2.GenerateResponse]:
    request = decoder_pb2.GenerateRequest(
        audio=clip.read_bytes(), whisper=decoder_pb2.WhisperOptions(timestamps=timestamps)
    )
    with grpc.insecure_channel(address) as channel:
        messages = list(decoder_pb2_grpc.DecoderServiceStub(channel).Generate(request, timeout=120))
    return [s for m in messages for s in m.segments], messages[-1]


def test_json_with_word_timestamps_equals_grpc(whisper):
    result = cli("--address", whisper, "--format", "json", "--timestamps", "word", str(CLIP))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1  # one JSON object per file, on one line
    body = json.loads(lines[0])
    want, last = grpc_segments(whisper, CLIP, WORD)
    assert want and (body["file"], body["language"]) == (str(CLIP), "en")
    assert body["duration"] == pytest.approx(last.duration) and body["duration"] > 7
    assert body["text"] == "".join(s.text for s in want).strip()
    assert body["usage"]["completion_tokens"] == last.usage.completion_tokens > 0
    assert len(body["segments"]) == len(want)
    for ours, s in zip(body["segments"], want):
        assert (ours["text"], ours["tokens"], np.float32(ours["start"]), np.float32(ours["end"])) == (
            s.text,
            list(s.tokens),
            np.float32(s.start),
            np.float32(s.end),
        )
        assert ours["words"] and "".join(w["word"] for w in ours["words"]).strip() == ours["text"].strip()
        # Each word inside its segment (by its middle: a word's end may pass the segment's last timestamp).
        assert all(ours["start"] <= (w["start"] + w["end"]) / 2 <= ours["end"] for w in ours["words"])
        assert all(w["start"] <= w["end"] <= body["duration"] for w in ours["words"])


@pytest.mark.parametrize("fmt, writer", [("srt", to_srt), ("vtt", to_vtt)])
def test_subtitles_equal_the_grpc_segments(whisper, fmt, writer):
    result = cli("--address", whisper, "--format", fmt, str(CLIP))
    assert result.returncode == 0, result.stderr
    want, _ = grpc_segments(whisper, CLIP, SEGMENT)
    assert want and result.stdout == writer(want)


def test_word_timestamps_stream_the_same_text(whisper):
    result = cli("--address", whisper, "--timestamps", "word", str(CLIP))
    assert result.returncode == 0, result.stderr
    want, _ = grpc_segments(whisper, CLIP, WORD)
    assert result.stdout.strip() == "".join(s.text for s in want).strip()


def test_output_dir_gets_one_subtitle_file_per_clip(whisper, tmp_path):
    clips = [CLIP, DATA_DIR / "short.wav"]
    result = cli("--address", whisper, "--format", "srt", "--output-dir", str(tmp_path), *map(str, clips))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    for clip in clips:
        assert (tmp_path / f"{clip.stem}.srt").read_text() == to_srt(grpc_segments(whisper, clip, SEGMENT)[0])


def test_prompt_reaches_the_server(whisper):
    # This prompt turns numbers.wav's digits into words, so a prompt lost on the way shows.
    prompt, clip = "one two three, four five. Numbers written as words", DATA_DIR / "numbers.wav"
    result = cli("--address", whisper, "--prompt", prompt, str(clip))
    assert result.returncode == 0, result.stderr
    want = decoder_pb2.GenerateRequest(audio=clip.read_bytes(), whisper=decoder_pb2.WhisperOptions(prompt=prompt))
    with grpc.insecure_channel(whisper) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        prompted = "".join(m.text for m in stub.Generate(want, timeout=120)).strip()
        plain = "".join(m.text for m in stub.Generate(decoder_pb2.GenerateRequest(audio=clip.read_bytes()))).strip()
    assert result.stdout.strip() == prompted != plain


@pytest.mark.parametrize("flag", [("--language", "de"), ("--task", "translate")])
def test_what_tiny_en_cannot_do_is_the_servers_invalid_argument(whisper, flag):
    result = cli("--address", whisper, *flag, str(DATA_DIR / "short.wav"))
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "English-only" in result.stderr, result.stderr


def test_an_m4a_voice_memo_transcribes_as_over_grpc(whisper, tmp_path):
    """Any format the decoder reads goes through the CLI as is (here AAC in m4a, what phones record)."""
    from helpers.audio_files import encode_file

    from decoder_svc.session.audio import decode_audio

    memo = tmp_path / "memo.m4a"
    memo.write_bytes(encode_file(decode_audio(CLIP.read_bytes()), "m4a-aac-48k-mono"))
    result = cli("--address", whisper, "--timestamps", "segment", str(memo))
    assert result.returncode == 0, result.stderr
    want, _ = grpc_segments(whisper, memo, SEGMENT)
    assert want and result.stdout.strip() == "".join(s.text for s in want).strip()
