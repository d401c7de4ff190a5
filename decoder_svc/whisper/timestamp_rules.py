"""Whisper's timestamp logits rules (the decoder predicts ``<|t0|> text <|t1|>`` segments).

The rules are HF ``WhisperTimeStampLogitsProcessor`` (``transformers/generation/logits_process.py``),
itself openai-whisper's ``ApplyTimestampRules`` (``whisper/decoding.py``, PR #914 for monotonicity).
Over the generated part of a sequence (the tokens from ``begin_index`` on), at each step:

1. ``<|notimestamps|>`` is banned.
2. Timestamps come in pairs: after two timestamps in a row (or one, as the only generated
   token) the next token is text (every timestamp banned); after a single timestamp that
   follows text the next is a timestamp or ``<|endoftext|>`` (every id below
   ``<|endoftext|>`` banned; the specials between it and ``<|0.00|>`` are left as HF leaves them).
3. Timestamps never decrease: those below the last one are banned, and the last one itself
   too unless it would close an open pair.
4. The first generated token is a timestamp no later than ``max_initial_timestamp_index``
   steps (0.02 s each) from ``<|0.00|>``.
5. If the summed probability of all timestamps beats the likeliest non-timestamp token,
   every non-timestamp token is banned (HF ``_detect_timestamp_from_logprob``, on by default).

Banned positions are set to ``-inf``; every other score is left bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from shared.models.whisper_specials import MAX_INITIAL_TIMESTAMP_INDEX, WhisperSpecials

# Rule 5's float64 decision stands when it clears this many nats (``TimestampRules._timestamps_win``); closer
# calls go to HF's float32 ops. Chosen far above float32 rounding (~1e-6 of logits of magnitude tens), far below
# any margin a real decision turns on.
RULE5_MARGIN = 1e-3


class TimestampRules:
    """The timestamp rules of one decode (one prompt length), applied per step.

    Args:
        specials: the checkpoint's special token ids (``<|endoftext|>``, ``<|notimestamps|>``,
            ``<|0.00|>`` = ``timestamp_begin``).
        begin_index: index of the first generated token = the decoder prompt's length, including a
            ``<|startofprev|>`` prefix (HF ``set_begin_index(decoder_input_ids.shape[-1])``).
        max_initial_timestamp_index: the latest first timestamp, in 0.02 s steps; 50 (1.0 s) is
            the openai checkpoints' ``generation_config.json`` value, None removes the cap (HF's
            behaviour when the generation config has no such attribute).

    Raises:
        ValueError: a negative ``begin_index`` or ``max_initial_timestamp_index``.
    """

    def __init__(
        self,
        specials: WhisperSpecials,
        begin_index: int,
        max_initial_timestamp_index: int | None = MAX_INITIAL_TIMESTAMP_INDEX,
    ) -> None:
        if begin_index < 0:
            raise ValueError(f"begin_index must be >= 0, got {begin_index}")
        if max_initial_timestamp_index is not None and max_initial_timestamp_index < 0:
            raise ValueError(f"max_initial_timestamp_index must be >= 0 or None, got {max_initial_timestamp_index}")
        self.specials = specials
        self.begin_index = begin_index
        self.max_initial_timestamp_index = max_initial_timestamp_index
        self._vocab_ids: dict[tuple[torch.device, int], torch.Tensor] = {}

    def row_bounds(self, token_ids: Sequence[int], vocab_size: int) -> tuple[int, int, int]:
        """What the rules 2-4 ban for one sequence, as three bounds (pure Python over the history).

        Args:
            token_ids: every decoder token of the sequence so far (prompt + generated).
            vocab_size: the scores' width ``V``.

        Returns:
            ``(text_end, ts_low, ts_high)``: ids ``< text_end`` are banned, and timestamps
            outside ``[ts_low, ts_high)``. ``<|notimestamps|>`` and rule 5 come on top.
        """
        ts_begin = self.specials.timestamp_begin
        seq = token_ids[self.begin_index :]
        last_was_ts = len(seq) >= 1 and seq[-1] >= ts_begin
        penultimate_was_ts = len(seq) < 2 or seq[-2] >= ts_begin
        text_end, ts_low, ts_high = 0, ts_begin, vocab_size
        if last_was_ts:
            if penultimate_was_ts:
                ts_low = vocab_size
            else:
                text_end = self.specials.eot
        last_ts = next((t for t in reversed(seq) if t >= ts_begin), None)
        if last_ts is not None:
            # an open pair may close on the same time; otherwise strictly later (no second <|0.00|>)
            ts_low = max(ts_low, last_ts if last_was_ts and not penultimate_was_ts else last_ts + 1)
        if len(token_ids) == self.begin_index:
            text_end = ts_begin
            if self.max_initial_timestamp_index is not None:
                ts_high = min(ts_high, ts_begin + self.max_initial_timestamp_index + 1)
        return text_end, ts_low, ts_high

    def apply(self, scores: torch.Tensor, token_ids: Sequence[int]) -> None:
        """Applies the rules to one sequence's logits row, in place.

        Args:
            scores: ``[V]`` logits (float32; any float dtype works, rule 5 is computed in float32).
            token_ids: every decoder token of that sequence so far (prompt + generated; HF's
                ``input_ids`` row); the first step is ``len(token_ids) == begin_index``.

        Raises:
            ValueError: ``scores`` is not 1-D or has no timestamp tokens.
        """
        if scores.dim() != 1:
            raise ValueError(f"scores must be [V], got shape {tuple(scores.shape)}")
        self.apply_batch(scores.unsqueeze(0), [token_ids])

    def apply_batch(self, scores: torch.Tensor, rows: Sequence[Sequence[int]]) -> None:
        """Applies the rules to ``N`` sequences at once, in place (one small host-to-device copy of the row bounds, no device sync).

        Args:
            scores: ``[N, V]`` logits, row ``i`` belonging to ``rows[i]``.
            rows: ``N`` token histories (prompt + generated), all with this object's ``begin_index``.

        Raises:
            ValueError: ``scores`` is not ``[len(rows), V]`` with ``V > timestamp_begin``.
        """
        if scores.dim() != 2 or scores.shape[0] != len(rows):
            raise ValueError(f"scores must be [{len(rows)}, V], got shape {tuple(scores.shape)}")
        vocab_size = scores.shape[1]
        ts_begin = self.specials.timestamp_begin
        if vocab_size <= ts_begin:
            raise ValueError(f"scores have {vocab_size} columns: no timestamp tokens (<|0.00|> is {ts_begin})")
        if not rows:
            return
        if scores.device.type == "cpu":
            for i, r in enumerate(rows):
                self._apply_row(scores[i : i + 1], self.row_bounds(r, vocab_size))
        else:
            self._apply_batched(scores, rows)

    def _apply_batched(self, scores: torch.Tensor, rows: Sequence[Sequence[int]]) -> None:
        """``apply_batch`` as ``[N, V]`` masks: no per-row op, no device sync (GPUs)."""
        vocab_size, ts_begin = scores.shape[1], self.specials.timestamp_begin
        bounds = torch.tensor([self.row_bounds(r, vocab_size) for r in rows], dtype=torch.long)
        bounds = bounds.to(scores.device, non_blocking=True)  # [N, 3]
        text_end, ts_low, ts_high = bounds[:, 0:1], bounds[:, 1:2], bounds[:, 2:3]  # [N, 1] each
        v = self._vocab(scores.device, vocab_size)  # [V]
        is_ts = v >= ts_begin
        banned = (v < text_end) | (is_ts & ((v < ts_low) | (v >= ts_high)))  # [N, V]
        banned[:, self.specials.no_timestamps] = True
        scores.masked_fill_(banned, float("-inf"))

        # rule 5, with HF's ops (log_softmax, then logsumexp against max) so ties resolve as HF's
        logprobs = torch.log_softmax(scores.float(), dim=-1)  # [N, V]
        ts_logprob = logprobs[:, ts_begin:].logsumexp(dim=-1)  # [N]
        text_max = logprobs[:, :ts_begin].amax(dim=-1)  # [N]
        scores[:, :ts_begin].masked_fill_((ts_logprob > text_max).unsqueeze(-1), float("-inf"))

    def _apply_row(self, row: torch.Tensor, bounds: tuple[int, int, int]) -> None:
        """``apply_batch`` for one ``[1, V]`` CPU row: the bans as slice fills (the same positions as the batched
        masks), rule 5 decided as ``_timestamps_win`` says, so the row is bit-identical to the batched path's.

        A float32 row is handled through its numpy view: a handful of numpy calls in place of a dozen small
        torch ops, each of which can pay for waking torch's OpenMP workers between the decode step's C
        kernels (measured: docs/benchmarks.md)."""
        text_end, ts_low, ts_high = bounds
        ts_begin, inf = self.specials.timestamp_begin, float("-inf")
        x = row[0].numpy() if row.dtype == torch.float32 and row.is_contiguous() else row[0]
        x[:text_end] = inf
        x[ts_begin : max(ts_low, ts_begin)] = inf
        x[max(ts_high, ts_begin) :] = inf
        x[self.specials.no_timestamps] = inf
        if self._timestamps_win(row, x):
            x[:ts_begin] = inf

    def _timestamps_win(self, row: torch.Tensor, x) -> bool:
        """Rule 5 on one banned ``[1, V]`` row (``x``: its ``[V]`` numpy view, or the tensor row itself): whether
        ``logsumexp(log_softmax(row)[ts:]) > max(log_softmax(row)[:ts])``, the decision of HF's ops.

        The shift by the row's log-sum-exp cancels on both sides, so for a float32 view the decision is first
        taken in float64 from the raw scores, ``logsumexp(x[ts:]) - max(x[:ts])``: where that margin is wider
        than ``RULE5_MARGIN`` nats, HF's float32 ops (whose rounding is of the order of 1e-6 of the scores'
        magnitude) cannot decide otherwise. A margin that close, a row with NaN or ``+inf``, or a tensor row
        is decided by HF's own ops (log_softmax, then logsumexp against amax), so ties resolve as HF's."""
        ts_begin = self.specials.timestamp_begin
        if isinstance(x, np.ndarray):
            ts, text_max = x[ts_begin:], float(x[:ts_begin].max())
            ts_max = float(ts.max())
            if ts_max == -math.inf:  # every timestamp banned: logsumexp is -inf, never greater
                return False
            if math.isfinite(ts_max) and not math.isnan(text_max) and text_max != math.inf:
                if text_max == -math.inf:  # every text token banned: any finite timestamp mass wins
                    return True
                margin = ts_max + math.log(float(np.exp(ts.astype(np.float64) - ts_max).sum())) - text_max
                if abs(margin) > RULE5_MARGIN:
                    return margin > 0
        logprobs = torch.log_softmax(row.float(), dim=-1)  # [1, V]
        # amax: the same value as max(dim).values (a maximum rounds nothing) without its [1] index tensor
        return bool(logprobs[:, ts_begin:].logsumexp(dim=-1) > logprobs[:, :ts_begin].amax(dim=-1))

    def _vocab(self, device: torch.device, vocab_size: int) -> torch.Tensor:
        key = (device, vocab_size)
        if key not in self._vocab_ids:
            self._vocab_ids[key] = torch.arange(vocab_size, device=device)
        return self._vocab_ids[key]
