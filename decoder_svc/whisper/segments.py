"""Splitting one decoded Whisper window into timestamped segments, and how far to seek.

This is HF transformers' ``WhisperGenerationMixin._retrieve_segment`` (``models/whisper/generation_whisper.py``),
itself openai-whisper's ``transcribe.py`` segment loop. Units:

* ``seek`` counts mel frames of 10 ms (hop 160 samples at 16 kHz); a window covers at most 3000 of them.
* One timestamp token step is 0.02 s = 2 frames (the encoder's conv stride 2, HF ``input_stride``).
* A window's ``time_offset`` is ``seek * 0.02 / 2`` seconds, computed in float64 as HF does, and segment
  times are ``time_offset + index * 0.02``.

The cases, over the generated ids with the final ``<|endoftext|>`` removed:

* Two timestamps in a row close one segment and open the next. Each segment runs from its first token
  to its closing timestamp. If the window ends on a lone timestamp after text ("single timestamp
  ending": nothing left to say), the last segment ends there and the seek moves past the whole window.
  Otherwise the text after the last pair is dropped (it is cut mid-speech) and the seek moves to the
  last pair's first timestamp, from where the next window decodes it again.
* No pair at all: the whole window is one segment from ``time_offset``, ending at its last timestamp
  (unless that is ``<|0.00|>``) or else at the window's end, and the seek moves past the whole window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.models.whisper_specials import TIME_PRECISION, WhisperSpecials

SAMPLE_RATE = 16_000
HOP_LENGTH = 160  # samples per mel frame (10 ms): WhisperFeatureExtractor / openai-whisper audio.py
FRAME_SECONDS = 0.01  # HF time_precision_features
N_FRAMES = 3000  # frames of one 30 s window (HF num_segment_frames = input_stride * max_source_positions)
INPUT_STRIDE = 2  # mel frames per encoder position = per timestamp step (HF input_stride, conv2 stride)


def time_offset(seek: int) -> float:
    """Seconds at mel frame ``seek``: HF's ``seek.to(float64) * time_precision / input_stride``."""
    return float(seek) * TIME_PRECISION / INPUT_STRIDE


@dataclass
class Segment:
    """One timestamped piece of a transcript (HF's segment dict, plus openai-whisper's per-segment numbers).

    Attributes:
        seek: the mel frame (10 ms) where the window that produced it starts.
        start, end: seconds from the start of the audio (float64, as HF computes them).
        tokens: HF's segment ``tokens``: its ids with its timestamp tokens (the opening one, the
            closing one, and the second of a closing pair on the window's last segment).
        temperature, avg_logprob, compression_ratio, no_speech_prob: of the accepted attempt of that
            window (``quality.Judgement``); None until ``LongFormState`` fills them in.
        text: the decoded text; the caller fills it in with a tokenizer.
    """

    seek: int
    start: float
    end: float
    tokens: list[int]
    temperature: float | None = None
    avg_logprob: float | None = None
    compression_ratio: float | None = None
    no_speech_prob: float | None = None
    text: str = ""


def _window_end_steps(seek_num_frames: int) -> int:
    # HF: int(seek_num_frames * time_precision_features / time_precision) on a long tensor, i.e. in float32
    return int(np.float32(np.float32(seek_num_frames) * np.float32(FRAME_SECONDS)) / np.float32(TIME_PRECISION))


def split_window(
    generated: Sequence[int],
    specials: WhisperSpecials,
    seek: int,
    seek_num_frames: int,
) -> tuple[list[Segment], int]:
    """The segments of one accepted window and the seek advance (HF ``_retrieve_segment``).

    Args:
        generated: the ids produced after the prompt; one final ``<|endoftext|>`` is removed first
            (HF removes it before splitting).
        specials: the checkpoint's ids (``timestamp_begin`` = ``<|0.00|>``, ``eot``).
        seek: the window's first mel frame.
        seek_num_frames: the window's length in mel frames, ``min(total_frames - seek, 3000)``
            (shorter for the last window).

    Returns:
        ``(segments, advance)``: the segments in order (``seek`` set, quality fields None) and the
        number of mel frames to add to ``seek``. The advance can exceed ``seek_num_frames`` when the
        model puts a timestamp past the end of a short last window (HF does the same).

    Raises:
        ValueError: ``seek`` < 0 or ``seek_num_frames`` <= 0.
    """
    if seek < 0 or seek_num_frames <= 0:
        raise ValueError(f"need seek >= 0 and seek_num_frames > 0, got {seek}, {seek_num_frames}")
    tokens = [int(t) for t in generated]
    if tokens and tokens[-1] == specials.eot:
        tokens = tokens[:-1]
    ts_begin = specials.timestamp_begin
    offset = time_offset(seek)
    is_ts = [t >= ts_begin for t in tokens]
    single_timestamp_ending = is_ts[-2:] == [False, True]
    # index of the second timestamp of every consecutive pair = where a new segment starts
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]

    if not cuts:
        steps = float(_window_end_steps(seek_num_frames))
        last_ts = next((t for t in reversed(tokens) if t >= ts_begin), None)
        if last_ts is not None and last_ts != ts_begin:
            steps = float(last_ts - ts_begin)
        return [Segment(seek, offset, offset + steps * TIME_PRECISION, tokens)], seek_num_frames

    if single_timestamp_ending:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1  # the last segment keeps both timestamps of its closing pair
    segments = []
    begin = 0
    for k, cut in enumerate(cuts):
        piece = tokens[begin:cut]
        closing = piece[-2] if k == len(cuts) - 1 and not single_timestamp_ending else piece[-1]
        segments.append(
            Segment(
                seek,
                offset + float(piece[0] - ts_begin) * TIME_PRECISION,
                offset + float(closing - ts_begin) * TIME_PRECISION,
                piece,
            )
        )
        begin = cut
    if single_timestamp_ending:
        return segments, seek_num_frames
    # seek to the first timestamp of the last pair; the text after it is decoded again by the next window
    return segments, (tokens[begin - 2] - ts_begin) * INPUT_STRIDE
