"""Logits processors and warpers as pure tensor functions, each exactly as its HF ``transformers`` class.

``decoder_svc.core.sampler.Sampler`` applies them per row in HF ``generate``'s order
(its module docstring lists it). The processors and warpers take scores
``[..., V]`` (float32) and return scores of that shape, filtered tokens set to
``-inf``; ``banned_ngram_tokens`` returns the ids to filter.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

NEG_INF = -float("inf")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int, filter_value: float = NEG_INF) -> torch.Tensor:
    """``[..., V]``: keep scores >= the k-th largest (ties kept), as HF ``TopKLogitsWarper``."""
    if top_k <= 0:
        return logits
    k = min(max(top_k, 1), logits.size(-1))
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, filter_value)


def apply_top_p(logits: torch.Tensor, top_p: float, filter_value: float = NEG_INF) -> torch.Tensor:
    """``[..., V]``: nucleus filter exactly as HF ``TopPLogitsWarper`` (keeps at least one token)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cum_probs <= (1 - top_p)
    sorted_remove[..., -1:] = False
    remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
    return logits.masked_fill(remove, filter_value)


def apply_min_p(logits: torch.Tensor, min_p: float, filter_value: float = NEG_INF) -> torch.Tensor:
    """``[..., V]``: drop tokens with probability < ``min_p * p_max`` (HF ``MinPLogitsWarper``; the top token is kept)."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    remove = probs < min_p * top
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, filter_value)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Seq[int], penalty: float) -> torch.Tensor:
    """``[V]`` in place: every id in ``token_ids`` scores ``s / penalty`` if ``s >= 0`` else ``s * penalty``
    (HF ``RepetitionPenaltyLogitsProcessor``; ids outside ``[0, V)`` are ignored)."""
    if penalty == 1.0 or not token_ids:
        return logits
    v = logits.shape[-1]
    ids = torch.tensor(sorted({t for t in token_ids if 0 <= t < v}), dtype=torch.long, device=logits.device)
    scores = logits[ids]
    logits[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def banned_ngram_tokens(token_ids: Seq[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already in ``token_ids`` (HF ``NoRepeatNGramLogitsProcessor``).

    The last ``n - 1`` tokens are matched against every earlier window of
    ``n - 1`` tokens; each match bans the token that followed it. O(len * n).
    """
    cur = len(token_ids)
    if n <= 0 or cur < n:
        return []
    ids = list(token_ids)
    prefix = ids[cur - n + 1 :]
    return [ids[j + n - 1] for j in range(cur - n + 1) if ids[j : j + n - 1] == prefix]
