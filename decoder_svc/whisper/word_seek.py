"""Where the next window starts once an accepted window's words are timed, and openai-whisper's
``hallucination_silence_threshold``.

openai-whisper's ``transcribe.py`` (PR #1838; faster-whisper #646 follows it), after ``add_word_timestamps``:

1. Unless the window ended on a single timestamp, ``seek`` moves to the end of its last word (when that lies
   past the window start), not to its last timestamp pair: the words are the finer clock.
2. With a threshold (seconds), a segment is an *anomaly* when its first 8 non-punctuation words score
   ``>= 3`` or ``>= len(words) - 0.01``; a word scores 1 for probability < 0.15, ``(0.133 - d) * 15`` for a
   duration ``d`` under 0.133 s and ``d - 2`` over 2 s (``word_anomaly_score``). Then:
   * the window's end: when more than the threshold is left after the last word, seek to that word's end,
     else to the window's end;
   * a first segment that is an anomaly after more than the threshold of silence from the window start:
     the whole window is dropped and decoding starts again at that segment's start;
   * an anomaly with silence (more than the threshold, or the start / end of the window within 2 s)
     before it and silence or another anomaly after it: it and everything after it are dropped and
     decoding starts again at ``max(window start + 1 s, its start)``, or at the end of the audio when
     less than the threshold is left after it.

Pure Python over the window's ``Segment`` s and their ``WordTiming`` s (seconds in the audio the model saw).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decoder_svc.whisper.segments import Segment
from decoder_svc.whisper.word_timing import WordTiming

FRAMES_PER_SECOND = 100
PUNCTUATION = "\"'“¿([{-\"'.。,，!！?？:：”)]}、"  # openai-whisper's, as transcribe() spells it


@dataclass(frozen=True)
class WordSeek:
    """The decision for one window.

    Attributes:
        keep: how many of the window's segments stay (those after are dropped as hallucinations).
        seek: the next window's first frame.
        drop_window: the whole window is dropped (its first segment was an anomaly after silence).
        last_speech_end: end (seconds) of the last kept word, or the previous value when none is kept.
    """

    keep: int
    seek: int
    drop_window: bool
    last_speech_end: float


def word_anomaly_score(word: WordTiming) -> float:
    """openai-whisper's ``word_anomaly_score``: improbable, very short or very long words score high."""
    duration = word.end - word.start
    score = 0.0
    if word.probability < 0.15:
        score += 1.0
    if duration < 0.133:
        score += (0.133 - duration) * 15
    if duration > 2.0:
        score += duration - 2.0
    return score


def is_segment_anomaly(words: Sequence[WordTiming] | None) -> bool:
    """openai-whisper's ``is_segment_anomaly`` over a segment's words (False without words)."""
    if not words:
        return False
    kept = [w for w in words if w.word not in PUNCTUATION][:8]
    score = sum(word_anomaly_score(w) for w in kept)
    return score >= 3 or score + 0.01 >= len(kept)


def _end(segments: Sequence[Segment], words: Sequence[Sequence[WordTiming]]) -> float | None:
    """openai-whisper's ``get_end``: the last word's end, else the last segment's end."""
    last_word = next((w[-1].end for w in reversed(words) if w), None)
    return last_word if last_word is not None else (segments[-1].end if segments else None)


def word_seek(
    segments: Sequence[Segment],
    words: Sequence[Sequence[WordTiming]],
    *,
    seek: int,
    num_frames: int,
    next_seek: int,
    single_timestamp_ending: bool,
    content_frames: int,
    last_speech_end: float,
    threshold: float | None,
) -> WordSeek:
    """Steps 1 and 2 of the module docstring for one accepted window.

    Args:
        segments, words: the window's segments and, per segment, its words.
        seek: the window's first frame. num_frames: its length in frames (its clip may cut it short).
        next_seek: the seek the timestamps gave (``split_window``'s advance added).
        single_timestamp_ending: the window ended on one timestamp after text.
        content_frames: frames of the whole recording.
        last_speech_end: end (seconds) of the last word of the windows before.
        threshold: ``hallucination_silence_threshold`` in seconds, or None (step 1 only).

    Returns:
        The ``WordSeek``.
    """
    time_offset = seek / FRAMES_PER_SECOND
    window_end_time = (seek + 3000) / FRAMES_PER_SECOND  # openai-whisper: a whole 30 s window from seek
    segment_duration = num_frames / FRAMES_PER_SECOND
    new_seek = next_seek
    if not single_timestamp_ending:
        end = _end(segments, words)
        if end is not None and end > time_offset:
            new_seek = round(end * FRAMES_PER_SECOND)
    keep = len(segments)
    if threshold is not None:
        if not single_timestamp_ending:
            end = _end(segments, words)
            if end is not None and end > time_offset:
                new_seek = round(end * FRAMES_PER_SECOND) if window_end_time - end > threshold else seek + num_frames
        first = next((i for i, w in enumerate(words) if w), None)
        if first is not None and is_segment_anomaly(words[first]):
            gap = segments[first].start - time_offset
            if gap > threshold:
                return WordSeek(0, seek + round(gap * FRAMES_PER_SECOND), True, last_speech_end)
        hal_last_end = last_speech_end
        for i, segment in enumerate(segments):
            if not words[i]:
                continue
            if is_segment_anomaly(words[i]):
                after = next((j for j in range(i + 1, len(segments)) if words[j]), None)
                next_start = words[after][0].start if after is not None else time_offset + segment_duration
                silence_before = (
                    segment.start - hal_last_end > threshold
                    or segment.start < threshold
                    or segment.start - time_offset < 2.0
                )
                silence_after = (
                    next_start - segment.end > threshold
                    or (after is not None and is_segment_anomaly(words[after]))
                    or window_end_time - segment.end < 2.0
                )
                if silence_before and silence_after:
                    new_seek = round(max(time_offset + 1, segment.start) * FRAMES_PER_SECOND)
                    if content_frames / FRAMES_PER_SECOND - segment.end < threshold:
                        new_seek = content_frames
                    keep = i
                    break
            hal_last_end = segment.end
    end = _end(segments[:keep], words[:keep])
    return WordSeek(keep, new_seek, False, end if end is not None else last_speech_end)
