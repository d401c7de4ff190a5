"""Cross-attention over K/V read in place from the paged cache (torch, CPU).

When a sequence's cross-attention blocks are one ascending run of ids (the
block manager allocates them so whenever it can), its cross K/V is a plain
slice of the flat cache ``[num_blocks * block_size, H, D]``: attention can read
it in place instead of gathering a dense copy first. For Whisper's fixed 1500
encoder positions this removes ``2 * B * 1500 * H * D`` elements of copying per
layer and decode step (the gather was most of the step time at batch 16).

Reference: ``kernels.paged_attention.paged_attention`` with ``causal=False``;
``tests/kernels/test_cross_attention.py`` compares the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def contiguous_cross_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Non-causal attention of each sequence's queries over its in-place K/V slice.

    Args:
        query: ``[T, H, D]`` flat varlen queries.
        k_cache: ``[num_blocks, block_size, H, D]``.
        v_cache: ``[num_blocks, block_size, H, D]``.
        spans: per sequence ``(query_start, query_end, first_slot, kv_len)``:
            queries ``query[query_start:query_end]`` attend to the flat cache
            slots ``first_slot : first_slot + kv_len`` (all of them).
        scale: factor on ``q . k``.

    Returns:
        ``[T, H, D]`` in the dtype of ``query``.

    Memory traffic: reads each sequence's ``2 * kv_len * H * D`` K/V elements
    once, in place; no dense copy.
    """
    h, d = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, h, d)  # [num_blocks * block_size, H, D]
    v_flat = v_cache.view(-1, h, d)
    out = torch.empty_like(query)
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    for q_start, q_end, first, kv_len in spans:
        q = query[q_start:q_end].transpose(0, 1)[None].to(compute_dtype)  # [1, H, q, D]
        k = k_flat[first : first + kv_len].transpose(0, 1)[None].to(compute_dtype)  # [1, H, L, D] (strided view)
        v = v_flat[first : first + kv_len].transpose(0, 1)[None].to(compute_dtype)
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [1, H, q, D]
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out
