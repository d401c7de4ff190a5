"""Word timestamps from Whisper's alignment-head cross-attention: median filter, DTW, words.

Sources: HF ``_extract_token_timestamps`` (``generation_whisper.py``, with its
``_median_filter`` and ``_dynamic_time_warping``) for token timestamps; openai-whisper
``timing.py`` (``find_alignment``, ``merge_punctuations``) and ``tokenizer.py``
(``split_to_word_tokens``) for words and their probabilities. Constants: median
filter width 7 (HF ``median_filter_width``, openai ``medfilt_width``), ``qk_scale`` 1
(the model's own softmax, as HF), 0.02 s per encoder frame, two mel frames per frame.

Token sequence. Under openai rules (the default) the weights are computed over openai-whisper's
``find_alignment`` sequence: ``[*sot_sequence, <|notimestamps|>, *text_tokens, <|endoftext|>]``
(``segment_output.alignment_sequence``), the "prompt" below being the sot sequence and ``<|notimestamps|>``.
Under HF rules they are computed over the sequence the window decoded,
as HF does: ``[*prompt, *generated]``, where ``prompt`` is the decoder prompt
(``WhisperSpecials.decoder_prompt``: previous text, ``<|startoftranscript|>``,
language, task, ``<|notimestamps|>`` when timestamps are off) and ``generated``
every sampled token, timestamp tokens and the final ``<|endoftext|>`` included.
With timestamps off and no previous text this is openai's
``[*sot_sequence, no_timestamps, *text_tokens, eot]``.

Row ``i`` of the weights is the query at position ``i``, which predicts token
``i + 1``; ``token_timestamps`` gives token ``i`` the frame where the DTW path
enters row ``i``: where token ``i + 1`` starts, i.e. where token ``i`` ends (HF's
own pipeline gives token ``i`` the span ``(ts[i - 1], ts[i])``). HF drops every
prompt row, so its first generated token is always 0.0 and the first word's
end is lost. ``find_words`` keeps the last prompt row too, which is openai's
row set (``find_alignment``: ``matrix[len(sot_sequence):-1]``, from the
``<|notimestamps|>`` query on): on the bundled clips that changes no HF token
time but the first one, which becomes the first token's real end. A word then
runs from its first token's start (the previous token's time; 0.0 for the first
token, as openai) to its last token's end.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.models.whisper_specials import TIME_PRECISION, WhisperSpecials

__all__ = [
    "APPEND_PUNCTUATIONS",
    "MEDIAN_FILTER_WIDTH",
    "PREPEND_PUNCTUATIONS",
    "WordTiming",
    "dtw",
    "find_words",
    "median_filter",
    "merge_punctuations",
    "split_to_word_tokens",
    "token_timestamps",
]

MEDIAN_FILTER_WIDTH = 7
# openai-whisper transcribe() defaults (HF _combine_tokens_into_words: the same, with "¡" also prepended).
PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
# openai tokenizer.split_to_word_tokens: languages written without spaces are split per unicode character.
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class WordTiming:
    """One word: its text (leading space kept), token ids, seconds in the audio, mean token probability."""

    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """Median over a sliding window of ``width`` along the last dim, edges reflect-padded (HF ``_median_filter``).

    ``[..., N]`` -> same shape; returned unchanged when ``N <= width // 2``.

    Raises:
        ValueError: ``width`` is not a positive odd number.
    """
    if width <= 0 or width % 2 != 1:
        raise ValueError(f"median filter width must be a positive odd number, got {width}")
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    lead, n = x.shape[:-1], x.shape[-1]
    padded = torch.nn.functional.pad(x.reshape(1, -1, n), (pad, pad), mode="reflect")  # [1, rows, N + 2p]
    if width == 7 and not bool(torch.isnan(x).any()):
        # the width-7 windows' 4th smallest by a sorting network of elementwise min / max over 7 shifted views:
        # the same values as sorting each window (a minimum or maximum rounds nothing), ~6x faster than sort on a
        # window's [heads, tokens, 1500] scores; NaN (which sort puts last) takes the sort below
        views = [padded[0, :, i : i + n] for i in range(7)]
        for i, j in _SORT7:
            views[i], views[j] = torch.minimum(views[i], views[j]), torch.maximum(views[i], views[j])
        return views[3].reshape(*lead, n)
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad].reshape(*lead, n)


# A sorting network for 7 inputs with 16 comparators, the fewest possible (Knuth, TAOCP vol. 3, 5.3.4); this one
# sorts all 2^7 inputs of 0s and 1s (tests/models/test_whisper_word_timing.py), so by the 0-1 principle every input.
_SORT7 = ((0, 6), (2, 3), (4, 5), (0, 2), (1, 4), (3, 6), (0, 1), (2, 5), (3, 4), (1, 2), (4, 6), (2, 3), (4, 5),
          (1, 2), (3, 4), (5, 6))  # fmt: skip


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Monotonic alignment of minimum total ``cost`` (``[N, M]``) from ``(0, 0)`` to ``(N - 1, M - 1)``.

    The recurrence, float32 accumulated costs and tie-breaking are HF's ``_dynamic_time_warping`` /
    openai's ``dtw_cpu``; the cells are filled one anti-diagonal at a time (each depends only on the two
    before it), which gives the same numbers as their row-by-column loops.

    Returns:
        ``(text_indices, time_indices)``: int arrays of equal length, the path's rows and columns in order.
    """
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    acc[0, 0] = 0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for diag in range(2, n + m + 1):
        i = np.arange(max(1, diag - m), min(n, diag - 1) + 1)
        j = diag - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        best = np.choose(step, (c0, c1, c2))
        acc[i, j] = cost[i - 1, j - 1] + best  # float64 sum stored as float32, as the references
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = n, m
    rows, cols = [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        step = trace[i, j]  # 0: diagonal, 1: up (next token), 2: left (next frame)
        i, j = i - int(step != 2), j - int(step != 1)
    return np.array(rows[::-1]), np.array(cols[::-1])


def token_timestamps(
    weights: torch.Tensor,
    num_frames: int,
    num_prompt_tokens: int,
    time_precision: float = TIME_PRECISION,
    median_filter_width: int = MEDIAN_FILTER_WIDTH,
) -> list[float]:
    """Per-token times (seconds from the window start) as HF ``_extract_token_timestamps`` (one sequence).

    Rows ``num_prompt_tokens .. T - 2`` of ``weights`` (the generated tokens' queries but the last, which HF
    never computes) are cropped to the real audio's ``num_frames // 2`` encoder frames, normalised per
    head and frame over those rows (mean / population std), median-filtered along the frames, averaged
    over the heads; DTW of the negated matrix then gives each row the frame where its path enters it.

    Args:
        weights: ``[heads, T, S]`` alignment-head probabilities over ``[*prompt, *generated]``
            (``shared.models.whisper_alignment.alignment_weights``).
        num_frames: mel frames of real audio in the window: ``ceil(samples / 160)`` capped at 3000 (HF's
            ``attention_mask.sum()``); 3000 = no crop, HF's behaviour without an attention mask.
        num_prompt_tokens: length of the decoder prompt at the start of the sequence.

    Returns:
        ``T`` floats: 0.0 for the prompt tokens, then the generated tokens' times; the last token repeats the
        time before it. All zeros when fewer than two tokens were generated. A token's time is where the
        next token starts (see the module docstring). Where a frame's rows are all equal (std 0, e.g. one row)
        the normalised weights are 0 there instead of HF's NaN.

    Raises:
        ValueError: ``weights`` not 3-D, ``num_frames`` not in ``1 .. 2 * S``, or ``num_prompt_tokens`` not in ``0 .. T``.
    """
    if weights.dim() != 3:
        raise ValueError(f"weights must be [heads, T, S], got {list(weights.shape)}")
    _, t, s = weights.shape
    if not 0 < num_frames <= 2 * s:
        raise ValueError(f"num_frames must be in 1..{2 * s}, got {num_frames}")
    if not 0 <= num_prompt_tokens <= t:
        raise ValueError(f"num_prompt_tokens must be in 0..{t}, got {num_prompt_tokens}")
    out = [0.0] * t
    matrix = weights[:, num_prompt_tokens : t - 1, : num_frames // 2].float()  # [heads, rows, frames]
    if matrix.shape[1] == 0 or matrix.shape[2] == 0:
        return out
    std, mean = torch.std_mean(matrix, dim=-2, keepdim=True, unbiased=False)
    matrix = (matrix - mean) / std.clamp_min(torch.finfo(torch.float32).tiny)
    matrix = median_filter(matrix, median_filter_width).mean(dim=0)  # [rows, frames]
    text_idx, time_idx = dtw(-matrix.double().cpu().numpy())
    jumps = np.diff(text_idx, prepend=-1).astype(bool)  # first path cell of each row
    times = (time_idx[jumps] * time_precision).tolist()
    out[num_prompt_tokens : t - 1] = times
    out[t - 1] = times[-1]
    return out


def _split_on_unicode(tokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """openai ``split_tokens_on_unicode``: cut wherever the tokens so far decode to whole characters."""
    full = tokenizer.decode(tokens)
    words, word_tokens, current, offset = [], [], [], 0
    for token in tokens:
        current.append(token)
        text = tokenizer.decode(current)
        bad = text.find(_REPLACEMENT_CHAR)
        if bad < 0 or offset + bad >= len(full) or full[offset + bad] == _REPLACEMENT_CHAR:
            words.append(text)
            word_tokens.append(current)
            current = []
            offset += len(text)
    return words, word_tokens


def split_to_word_tokens(
    tokenizer, tokens: list[int], language: str | None = None
) -> tuple[list[str], list[list[int]]]:
    """openai ``Tokenizer.split_to_word_tokens`` over text token ids: ``(words, their token ids)``.

    Per unicode character for ``UNSPACED_LANGUAGES``; otherwise a new word at each leading space,
    punctuation mark or special token (unicode pieces in between are joined).
    """
    pieces, piece_tokens = _split_on_unicode(tokenizer, tokens)
    if language in UNSPACED_LANGUAGES:
        return pieces, piece_tokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for piece, ids in zip(pieces, piece_tokens):
        special = ids[0] >= tokenizer.eos_token_id
        if special or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def merge_punctuations(words: list[WordTiming], prepended: str, appended: str) -> list[WordTiming]:
    """openai ``merge_punctuations``: leading marks join the next word, trailing marks the previous one.

    The word absorbing a mark keeps its own start, end and probability. Returns the non-empty words.
    """
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        prev, nxt = words[i], words[j]
        if prev.word.startswith(" ") and prev.word.strip() in prepended:
            nxt.word, nxt.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            prev.word, prev.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        prev, nxt = words[i], words[j]
        if not prev.word.endswith(" ") and nxt.word in appended:
            prev.word, prev.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            nxt.word, nxt.tokens = "", []
        else:
            i = j
        j += 1
    return [w for w in words if w.word]


def find_words(
    tokenizer,
    specials: WhisperSpecials,
    token_ids: Sequence[int],
    num_prompt_tokens: int,
    token_probs: Sequence[float],
    weights: torch.Tensor,
    num_frames: int,
    window_offset_s: float = 0.0,
    language: str | None = None,
    prepend_punctuations: str = PREPEND_PUNCTUATIONS,
    append_punctuations: str = APPEND_PUNCTUATIONS,
) -> list[WordTiming]:
    """Words of one decoded window with their times and probabilities.

    Args:
        tokenizer: the Whisper tokenizer (``shared.models.whisper_features.load_tokenizer``).
        specials: the checkpoint's special tokens (text tokens are the ids below ``specials.eot``).
        token_ids: the ``T`` tokens ``weights`` was computed over: ``[*prompt, *generated]``.
        num_prompt_tokens: length of the prompt.
        token_probs: ``T - num_prompt_tokens`` probabilities, one per generated token (the sampled
            token's probability at its step).
        weights: ``[heads, T, S]`` from ``alignment_weights``.
        num_frames: mel frames of real audio in the window (``<= 3000``).
        window_offset_s: seconds from the audio start to the window start (added to every time).
        language: ISO code; ``UNSPACED_LANGUAGES`` split per character.

    Returns:
        Words in order, their texts concatenating to the decoded text of the generated text tokens.
        Token ``i``'s span is ``(ts[i - 1], ts[i])``, ``ts = token_timestamps(weights, num_frames,
        num_prompt_tokens - 1)`` (the module docstring says why; seconds, rounded to 0.01 as openai and
        HF do); a word runs from its first token's start to its last token's end, and its
        probability is the mean of its tokens' (both taken before punctuation is merged, as openai).
        Empty when the window has no text tokens.

    Raises:
        ValueError: ``token_probs`` or ``weights`` do not match ``token_ids``; see ``token_timestamps``.
    """
    t = len(token_ids)
    if weights.dim() != 3 or weights.shape[1] != t:
        raise ValueError(f"weights must be [heads, {t}, S] for {t} tokens, got {list(weights.shape)}")
    if len(token_probs) != t - num_prompt_tokens:
        raise ValueError(f"need {t - num_prompt_tokens} token_probs (one per generated token), got {len(token_probs)}")
    # From the last prompt token's query on (openai's rows), so the first generated token gets its real time.
    times = token_timestamps(weights, num_frames, max(num_prompt_tokens - 1, 0))
    positions = [i for i in range(num_prompt_tokens, t) if token_ids[i] < specials.eot]
    if not positions:
        return []
    texts, word_tokens = split_to_word_tokens(tokenizer, [int(token_ids[i]) for i in positions], language)
    words, k = [], 0
    for text, ids in zip(texts, word_tokens):
        span = positions[k : k + len(ids)]
        k += len(ids)
        start = times[span[0] - 1] if span[0] > 0 else 0.0
        words.append(
            WordTiming(
                word=text,
                tokens=ids,
                start=round(window_offset_s + start, 2),
                end=round(window_offset_s + times[span[-1]], 2),
                probability=float(np.mean([token_probs[i - num_prompt_tokens] for i in span])),
            )
        )
    return merge_punctuations(words, prepend_punctuations, append_punctuations)
