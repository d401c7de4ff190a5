"""Which stretches of a recording are decoded: ``clip_timestamps`` and the VAD gate.

Both give *clips*, ``(start_frame, end_frame)`` half-open ranges of mel frames (10 ms), sorted and apart.
The long-form loop (``decoder_svc.whisper.longform``) decodes only inside them: ``seek`` jumps to the next
clip's start, and a window never reaches past its clip's end (the rest of its 30 s is padding), as
openai-whisper's ``transcribe.py`` does with ``clip_timestamps`` ("start,end,start,end,..." seconds,
``round(t * 100)`` frames each, an odd count ending at the end of the audio).

The VAD gate is ours: silero-vad's speech regions (``decoder_svc.whisper.vad``), padded, merged where the
silence between two of them is shorter than ``min_silence_s``; longer silence (or noise the VAD hears no
speech in) between clips is never decoded, so no text can be invented there, the classic failure of
Whisper on long recordings (openai-whisper #1783, faster-whisper #646). Unlike ``vad_filter``
(faster-whisper's, which joins the speech regions into one shorter recording), the audio inside a clip is the
recording's own and its times need no mapping back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

HOP_LENGTH = 160  # samples per mel frame (16 kHz)
FRAMES_PER_SECOND = 100
N_FRAMES = 3000  # one 30 s window
MAX_CLIP_TIMESTAMPS = 2048
DEFAULT_GATE_MIN_SILENCE_S = 6.0
DEFAULT_GATE_PAD_S = 0.4  # faster-whisper's VadOptions.speech_pad_ms

Clip = tuple[int, int]


def parse_clip_timestamps(values: Sequence[float], total_frames: int) -> list[Clip]:
    """openai-whisper's ``clip_timestamps`` as clips of a recording of ``total_frames`` frames.

    Args:
        values: seconds ``start, end, start, end, ...``; an odd count's last clip ends at the end of the audio;
            empty = the whole recording.
        total_frames: the recording's mel frames (``samples // 160``).

    Returns:
        Clips within ``[0, total_frames]``; those empty after the cut are left out.

    Raises:
        ValueError: more than ``MAX_CLIP_TIMESTAMPS`` values, a value that is negative or not finite, or values
            that are not increasing (each clip's end after its start, each start at or after the previous end).
    """
    if len(values) > MAX_CLIP_TIMESTAMPS:
        raise ValueError(f"clip_timestamps has {len(values)} values; at most {MAX_CLIP_TIMESTAMPS} are allowed")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"clip_timestamps must be seconds >= 0, got {list(values)[:8]}")
    points = [round(v * FRAMES_PER_SECOND) for v in values] or [0]
    if len(points) % 2:
        points.append(max(total_frames, points[-1] + 1))
    clips = list(zip(points[::2], points[1::2], strict=True))
    for i, (start, end) in enumerate(clips):
        if end <= start or (i and start < clips[i - 1][1]):
            raise ValueError(
                "clip_timestamps must be increasing start,end pairs in seconds (each end after its start, each "
                f"clip after the previous one); clip {i} is {start / FRAMES_PER_SECOND}-{end / FRAMES_PER_SECOND} s"
            )
    return [(s, min(e, total_frames)) for s, e in clips if s < min(e, total_frames)]


def gate_clips(
    regions: Sequence[tuple[int, int]],
    num_samples: int,
    min_silence_s: float = DEFAULT_GATE_MIN_SILENCE_S,
    pad_s: float = DEFAULT_GATE_PAD_S,
) -> list[Clip]:
    """Clips of the speech in a recording: VAD regions padded, merged across silences shorter than ``min_silence_s``;
    a silence that short before the first clip or after the last one is kept too (the recording's start and end
    count as speech edges), so only silence of ``min_silence_s`` or more is ever left out: a clip that opens after
    a short lead-in is decoded from the recording's start, as openai-whisper and faster-whisper decode it.

    Args:
        regions: speech ``(start, end)`` sample ranges (``vad.speech_regions``), sorted.
        num_samples: the recording's length (16 kHz samples).
        min_silence_s: a silence between two regions at least this long (seconds, after padding) is left out.
        pad_s: seconds added before and after each region (within the recording).

    Returns:
        Clips in frames; empty when there is no speech.

    Raises:
        ValueError: ``min_silence_s`` or ``pad_s`` negative or not finite.
    """
    for name, value in (("min_silence_s", min_silence_s), ("pad_s", pad_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be seconds >= 0, got {value}")
    total = num_samples // HOP_LENGTH
    pad = round(pad_s * FRAMES_PER_SECOND)
    gap = round(min_silence_s * FRAMES_PER_SECOND)
    clips: list[list[int]] = []
    for start, end in regions:
        s, e = max(start // HOP_LENGTH - pad, 0), min(-(-end // HOP_LENGTH) + pad, total)
        if s >= e:
            continue
        if clips and s - clips[-1][1] < gap:
            clips[-1][1] = max(clips[-1][1], e)
        else:
            clips.append([s, e])
    if clips and clips[0][0] < gap:
        clips[0][0] = 0
    if clips and total - clips[-1][1] < gap:
        clips[-1][1] = total
    return [(s, e) for s, e in clips]


def intersect_clips(a: Sequence[Clip], b: Sequence[Clip]) -> list[Clip]:
    """The frames in both clip lists (``clip_timestamps`` within the VAD gate's clips), as clips."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip_frames(clips: Sequence[Clip]) -> int:
    """Frames the clips cover (what the long-form loop decodes)."""
    return sum(e - s for s, e in clips)


def window_at(seek: int, clip_end: int, num_samples: int) -> tuple[int, int]:
    """The window that starts at frame ``seek``: ``(num_frames, num_samples)``.

    ``num_frames = min(3000, total_frames - seek, clip_end - seek)`` (openai-whisper's ``segment_size``); the
    samples are ``num_frames * 160``, except that the recording's last window takes every remaining sample (up
    to 159 past its last whole frame), at most 30 s of them.

    Args:
        seek: first frame, inside the clip. clip_end: the clip's end frame. num_samples: the recording's samples.
    """
    total_frames = num_samples // HOP_LENGTH
    num_frames = min(total_frames - seek, N_FRAMES, clip_end - seek)
    start = seek * HOP_LENGTH
    last = seek + num_frames >= total_frames
    return num_frames, min(num_samples - start if last else num_frames * HOP_LENGTH, N_FRAMES * HOP_LENGTH)


def speech_windows(clips: Sequence[Clip] | None, num_samples: int, count: int) -> list[tuple[int, int]]:
    """The first ``count`` consecutive windows over the clips, ``(start_sample, num_samples)`` each: where
    language detection listens (faster-whisper's ``language_detection_segments``, here over speech only).

    Args:
        clips: the frames to decode, or None for the whole recording. num_samples: the recording's samples.
        count: windows wanted (fewer when the clips run out).
    """
    total = num_samples // HOP_LENGTH
    clips = list(clips) if clips is not None else [(0, total)]
    out = []
    for start, end in clips:
        seek, end = start, min(end, total)
        while seek < end and len(out) < count:
            frames, samples = window_at(seek, end, num_samples)
            out.append((seek * HOP_LENGTH, samples))
            seek += frames
    return out
