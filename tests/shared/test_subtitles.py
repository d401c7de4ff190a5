"""SRT / WebVTT writers: exact bytes of openai-whisper's format, edge times, and each segment type accepted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shared.proto import decoder_pb2
from shared.subtitles import TimedText, format_timestamp, to_srt, to_vtt


@dataclass
class _Segment:
    start: float
    end: float
    text: str


def test_srt_and_vtt_exact_text():
    segments = [{"start": 1.0, "end": 2.5, "text": " Hello there. "}, {"start": 2.5, "end": 4.02, "text": "Bye."}]
    assert to_srt(segments) == (
        "1\n00:00:01,000 --> 00:00:02,500\nHello there.\n\n2\n00:00:02,500 --> 00:00:04,020\nBye.\n\n"
    )
    assert to_vtt(segments) == (
        "WEBVTT\n\n00:00:01.000 --> 00:00:02.500\nHello there.\n\n00:00:02.500 --> 00:00:04.020\nBye.\n\n"
    )


def test_empty_list():
    assert to_srt([]) == ""
    assert to_vtt([]) == "WEBVTT\n\n"


@pytest.mark.parametrize(
    ("seconds", "srt", "vtt"),
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (0.9995, "00:00:01,000", "00:00:01.000"),  # 999.5 ms rounds up into the next second
        (0.0004, "00:00:00,000", "00:00:00.000"),
        (59.9999, "00:01:00,000", "00:01:00.000"),  # carries into minutes
        (3599.9996, "01:00:00,000", "01:00:00.000"),  # carries into hours
        (3723.456, "01:02:03,456", "01:02:03.456"),
        (100 * 3600 + 1.5, "100:00:01,500", "100:00:01.500"),
    ],
)
def test_timestamps(seconds, srt, vtt):
    assert format_timestamp(seconds, ",") == srt
    assert format_timestamp(seconds, ".") == vtt


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_bad_times_rejected(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        to_srt([{"start": bad, "end": 1.0, "text": "x"}])


def test_text_made_safe():
    text = "  a --> b\n\nsecond line\n  "
    expected_text = "a -> b\nsecond line"
    assert to_srt([_Segment(0.0, 1.0, text)]) == f"1\n00:00:00,000 --> 00:00:01,000\n{expected_text}\n\n"
    vtt = to_vtt([_Segment(0.0, 1.0, text)])
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{expected_text}\n\n"
    assert vtt.count("-->") == 1  # only the timing line


def test_protobuf_segments_and_generators():
    messages = [decoder_pb2.Segment(id=i, start=i * 2.0, end=i * 2.0 + 1.25, text=f" part {i}") for i in range(3)]
    assert isinstance(messages[0], TimedText)
    srt = to_srt(iter(messages))  # any iterable, read once
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,250\npart 0\n\n2\n00:00:02,000 --> 00:00:03,250\npart 1\n\n")
    assert srt.endswith("3\n00:00:04,000 --> 00:00:05,250\npart 2\n\n")
    # float32 fields in the proto: 1.25 and 2.0 are exact, so the dataclass form gives the same text
    assert to_vtt(messages) == to_vtt([_Segment(m.start, m.end, m.text) for m in messages])


def test_missing_field_raises():
    with pytest.raises(KeyError):
        to_srt([{"start": 0.0, "end": 1.0}])
