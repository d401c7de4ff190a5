"""SubRip (SRT) and WebVTT subtitles from transcription segments: the ``response_format`` "srt" and "vtt" bodies.

Follows openai-whisper's ``WriteSRT`` / ``WriteVTT`` (``whisper/utils.py``) as OpenAI's API answers them: cues
numbered from 1 in SRT, a ``WEBVTT`` header in VTT, times ``HH:MM:SS,mmm`` (SRT) / ``HH:MM:SS.mmm`` (VTT) with the
hours always written, milliseconds from Python's ``round`` (half to even), text stripped and ``-->`` written as
``->`` so it cannot read as a cue timing line. Beyond openai-whisper, a blank line inside a text (which would end
the cue early) is removed.

Segments are anything with ``start``, ``end`` (seconds) and ``text``: dataclasses, protobuf ``Segment`` messages
(attribute access) or mappings with those keys.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

_BLANK_LINES = re.compile(r"\n\s*\n")


@runtime_checkable
class TimedText(Protocol):
    """A segment as the writers read it: ``start`` and ``end`` in seconds from the start of the audio, ``text``."""

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...

    @property
    def text(self) -> str: ...


def format_timestamp(seconds: float, decimal_marker: str) -> str:
    """``seconds`` as ``HH:MM:SS<marker>mmm``; hours grow past two digits when needed (openai-whisper's format).

    Raises:
        ValueError: ``seconds`` is negative or not finite.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"subtitle times must be finite and >= 0 seconds, got {seconds}")
    milliseconds = round(seconds * 1000.0)
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{milliseconds:03d}"


def _fields(segment: TimedText | Mapping) -> tuple[float, float, str]:
    if isinstance(segment, Mapping):
        return float(segment["start"]), float(segment["end"]), str(segment["text"])
    return float(segment.start), float(segment.end), str(segment.text)


def _cue_text(text: str) -> str:
    return _BLANK_LINES.sub("\n", text.strip()).replace("-->", "->")


def _cues(segments: Iterable[TimedText | Mapping], decimal_marker: str) -> list[str]:
    cues = []
    for segment in segments:
        start, end, text = _fields(segment)
        timing = f"{format_timestamp(start, decimal_marker)} --> {format_timestamp(end, decimal_marker)}"
        cues.append(f"{timing}\n{_cue_text(text)}\n\n")
    return cues


def to_srt(segments: Iterable[TimedText | Mapping]) -> str:
    """SubRip text: ``1\\n00:00:01,000 --> 00:00:02,500\\ntext\\n\\n`` per segment; ``""`` for none.

    Raises:
        ValueError: a negative or non-finite time.
        KeyError / AttributeError: a segment without ``start``, ``end`` or ``text``.
    """
    return "".join(f"{number}\n{cue}" for number, cue in enumerate(_cues(segments, ","), start=1))


def to_vtt(segments: Iterable[TimedText | Mapping]) -> str:
    """WebVTT text: ``WEBVTT\\n\\n`` then ``00:00:01.000 --> 00:00:02.500\\ntext\\n\\n`` per segment.

    Raises:
        ValueError: a negative or non-finite time.
        KeyError / AttributeError: a segment without ``start``, ``end`` or ``text``.
    """
    return "WEBVTT\n\n" + "".join(_cues(segments, "."))
