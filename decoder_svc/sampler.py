"""Per-row token sampling over a batch of logits.

Order follows HF ``generate``: logits processors first (Whisper's
``SuppressTokensLogitsProcessor`` on every step and
``SuppressTokensAtBeginLogitsProcessor`` on the first generated token, both
setting scores to ``-inf``; BART-family ``ForcedBOSTokenLogitsProcessor`` at
``cur_len == 1`` and ``ForcedEOSTokenLogitsProcessor`` at
``cur_len == max_length - 1``, leaving only the forced token), then warpers in HF order: temperature, top-k,
top-p (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``
with ``min_tokens_to_keep=1``), then greedy argmax or a multinomial draw from
each request's own ``torch.Generator`` so a seeded request gets the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from shared.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of a batch: its request, params, and whether it samples its first token."""

    request_id: str
    params: SamplingParams
    is_first_token: bool
    num_tokens: int = 0  # decoder tokens so far (prompt + output): HF's cur_len
    max_len: int = 0  # the sequence's max tokens (prompt + output); 0 = unknown
    num_output_tokens: int = 0  # generated tokens so far (``min_tokens`` counts these)
    stop_token_ids: tuple[int, ...] = ()  # ids masked while num_output_tokens < params.min_tokens

    @classmethod
    def from_sequence(cls, seq) -> "SamplingRow":
        """The row of a ``decoder_svc.sequence.Sequence`` about to sample its next token."""
        return cls(seq.request_id, seq.sampling_params, seq.num_output_tokens == 0, seq.num_tokens, seq.max_len,
                   seq.num_output_tokens, seq.stop_token_ids)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int, filter_value: float = -float("inf")) -> torch.Tensor:
    """``[..., V]``: keep scores >= the k-th largest (ties kept), as HF ``TopKLogitsWarper``."""
    if top_k <= 0:
        return logits
    k = min(max(top_k, 1), logits.size(-1))
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, filter_value)


def apply_top_p(logits: torch.Tensor, top_p: float, filter_value: float = -float("inf")) -> torch.Tensor:
    """``[..., V]``: nucleus filter exactly as HF ``TopPLogitsWarper`` (keeps at least one token)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cum_probs <= (1 - top_p)
    sorted_remove[..., -1:] = False
    remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
    return logits.masked_fill(remove, filter_value)


class Sampler:
    """Picks one token per row.

    Args:
        suppress_tokens: ids masked to ``-inf`` on every step.
        begin_suppress_tokens: ids masked on a sequence's first generated token.
        forced_bos_token_id: the only allowed token when ``row.num_tokens == 1``.
        forced_eos_token_id: the only allowed token when ``row.num_tokens == row.max_len - 1``.
    """

    def __init__(self, suppress_tokens: Seq[int] = (), begin_suppress_tokens: Seq[int] = (),
                 forced_bos_token_id: int | None = None, forced_eos_token_id: int | None = None) -> None:
        self.suppress_tokens = torch.tensor(sorted(set(suppress_tokens)), dtype=torch.long)
        self.begin_suppress_tokens = torch.tensor(sorted(set(begin_suppress_tokens)), dtype=torch.long)
        self.forced_bos_token_id = forced_bos_token_id
        self.forced_eos_token_id = forced_eos_token_id
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, seed: int | None) -> torch.Generator:
        """The request's own generator, created (seeded) on first use."""
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forgets a finished or aborted request's generator."""
        self._generators.pop(request_id, None)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """``[N, V]`` float32 -> ``[N, V]`` after suppression and forced tokens (processors only, no warpers)."""
        logits = logits.float().clone()
        for i, r in enumerate(rows):
            if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids:  # HF MinNewTokensLengthLogitsProcessor
                logits[i, list(r.stop_token_ids)] = -float("inf")
        if self.suppress_tokens.numel():
            logits[:, self.suppress_tokens] = -float("inf")
        first = [i for i, r in enumerate(rows) if r.is_first_token]
        if first and self.begin_suppress_tokens.numel():
            idx = torch.tensor(first, dtype=torch.long)
            logits[idx[:, None], self.begin_suppress_tokens[None, :]] = -float("inf")
        for i, r in enumerate(rows):
            forced = None
            if self.forced_bos_token_id is not None and r.num_tokens == 1:
                forced = self.forced_bos_token_id
            if self.forced_eos_token_id is not None and r.max_len and r.num_tokens == r.max_len - 1:
                forced = self.forced_eos_token_id
            if forced is not None:
                logits[i] = -float("inf")
                logits[i, forced] = 0.0
        return logits

    @staticmethod
    def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """``[..., V]`` -> warped scores: temperature, then top-k, then top-p."""
        logits = apply_temperature(logits, params.temperature)
        logits = apply_top_k(logits, params.top_k)
        return apply_top_p(logits, params.top_p)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """``logits``: ``[N, V]`` (row i for ``rows[i]``) -> N token ids."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return []
        logits = self.process_logits(logits, rows)
        out = logits.argmax(dim=-1).tolist()  # greedy rows are done in one batched op
        for i, row in enumerate(rows):
            if row.params.greedy:
                continue
            probs = self.warp(logits[i], row.params).softmax(dim=-1)  # [V]
            gen = self.generator(row.request_id, row.params.seed)
            if not bool(torch.isfinite(probs).all()):  # never let one row's overflow fail the whole batch
                continue  # keeps the row's argmax
            out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        return out
