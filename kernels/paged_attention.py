"""Plain-torch reference of paged attention (self and cross), used on CPU.

The KV cache of one layer is two tensors ``k_cache`` / ``v_cache`` of shape
``[num_blocks, block_size, num_heads, head_dim]``; slot ``s`` is block
``s // block_size``, offset ``s % block_size`` (see
``shared.attention_metadata.AttentionMetadata``). A sequence's keys are found
through its row of ``block_tables``: key ``j`` of sequence ``b`` lives in block
``block_tables[b, j // block_size]`` at offset ``j % block_size``.

Queries come as a flat varlen batch ``[T, H, D]``: sequence ``b`` owns rows
``query_start_loc[b]:query_start_loc[b+1]``. The reference pads them into
``[B, max_q, H, D]``, gathers each sequence's keys into a dense padded
``[B, L, H, D]``, masks, and calls ``F.scaled_dot_product_attention`` (softmax
in float32: half-precision inputs are upcast). No Python loop runs per token or
per sequence. Triton kernels that read blocks in place belong beside this file
and are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into their cache slots, in place.

    Args:
        k_cache: ``[num_blocks, block_size, H, D]``, written in place.
        v_cache: ``[num_blocks, block_size, H, D]``, written in place.
        key: ``[T, H, D]`` (cast to the cache dtype).
        value: ``[T, H, D]``.
        slot_mapping: ``[T]`` int64 slot of each token; negative slots
            (padding tokens) are skipped.

    Memory traffic: reads ``2*T*H*D`` elements, writes the same; the rest of
    the cache is untouched.
    """
    if key.shape[0] == 0:
        return
    h, d = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, h, d)  # [num_blocks * block_size, H, D]
    v_flat = v_cache.view(-1, h, d)
    slot_mapping = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """Copy each sequence's first ``max_len`` cache entries into a dense tensor.

    Args:
        cache: ``[num_blocks, block_size, H, D]``.
        block_tables: ``[B, M]`` int64 block ids (padding entries may be any
            valid block id; what they read is masked later).
        max_len: number of key positions to gather, ``<= M * block_size``.

    Returns:
        ``[B, max_len, H, D]``; rows past a sequence's length hold junk.

    Memory traffic: reads and writes ``B * ceil(max_len/block_size) *
    block_size * H * D`` elements.
    """
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(
            f"max_len {max_len} needs {num_blocks} blocks, block_tables has {block_tables.shape[1]} columns"
        )
    b = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1)
    if cache.is_contiguous():
        # Whole blocks as rows: index_select copies each row with one memcpy (faster on CPU than advanced
        # indexing, which copies element by element; measured: docs/benchmarks.md, Measurements formerly in docstrings).
        blocks = cache.view(cache.shape[0], -1).index_select(0, ids)  # [B * nb, block_size * H * D]
    else:
        blocks = cache[ids]
    return blocks.view(b, num_blocks * block_size, *cache.shape[2:])[:, :max_len]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    causal: bool,
    scale: float,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    position_bias: torch.Tensor | None = None,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """Attention of a flat varlen batch of queries over paged K/V.

    Causal (self-attention): query ``i`` of sequence ``b`` sits at position
    ``context_lens[b] - q_len_b + i`` and sees keys ``0..position``; its own
    K/V must already be written (``write_kv``). Non-causal (cross-attention):
    every query of sequence ``b`` sees keys ``0..context_lens[b]-1``.

    Args:
        query: ``[T, H, D]``.
        k_cache: ``[num_blocks, block_size, H, D]``.
        v_cache: ``[num_blocks, block_size, H, D]``.
        block_tables: ``[B, M]`` int64 block ids, padded with any valid id.
        context_lens: ``[B]`` int64 key count of each sequence.
        query_start_loc: ``[B + 1]`` int64 cumulative query lengths.
        causal: mask as self-attention (True) or cross-attention (False).
        scale: factor on ``q . k``, usually ``head_dim ** -0.5``.
        max_query_len: longest query run; computed (host sync) if None.
        max_context_len: longest ``context_lens``; if None, the full width
            ``M * block_size`` of ``block_tables`` is gathered (no host sync).
        position_bias: optional ``[H, N]`` additive bias by causal distance
            (T5 relative position bias): the score of a query at position
            ``p`` for key ``j <= p`` gets ``position_bias[:, min(p - j, N - 1)]``
            added before the softmax. Causal only.
        step_cache: optional dict that lives for one step
            (``AttentionMetadata.step_cache``): the masks, bias and index
            tensors that depend only on the step's metadata are built by the
            first call and reused by the others (every layer of the step).
            Entries are keyed by the query count, ``causal``, the lengths and
            the identity of ``block_tables`` / ``position_bias``. None builds them every call.

    Returns:
        ``[T, H, D]`` in the dtype of ``query``. A query with no visible key
        (``context_lens[b] == 0``) gets zeros.

    Memory traffic: gathers ``2 * B * L * H * D`` elements of K/V (``L`` =
    ``max_context_len`` rounded up to a block) and writes them once more as
    the dense copy; scores are ``B * H * max_q * L`` float32. A real kernel
    reads the blocks in place and never builds the dense copy.
    """
    t, h, d = query.shape
    b = block_tables.shape[0]
    if t == 0 or b == 0:
        return query.new_zeros(query.shape)
    device = query.device
    compute_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * k_cache.shape[1]
    max_context_len = max(int(max_context_len), 1)
    key = (
        t,
        causal,
        max_query_len,
        max_context_len,
        id(block_tables),
        None if position_bias is None else id(position_bias),
        compute_dtype,
    )
    plan = step_cache.get(key) if step_cache is not None else None
    if plan is None:
        plan = _plan(
            t,
            block_tables,
            context_lens,
            query_start_loc,
            causal,
            max_query_len,
            max_context_len,
            position_bias,
            compute_dtype,
            device,
        )
        if step_cache is not None:
            step_cache[key] = plan
    seq_of_tok, idx_in_seq, max_query_len, attn_mask, has_key, block_tables = plan

    if seq_of_tok is None:  # one query per sequence (a decode step): no padding to do
        q_pad = query.to(compute_dtype).reshape(b, 1, h, d)
    else:
        q_pad = query.new_zeros((b, max_query_len, h, d), dtype=compute_dtype)
        q_pad[seq_of_tok, idx_in_seq] = query.to(compute_dtype)
    k = gather_kv(k_cache, block_tables, max_context_len).to(compute_dtype)  # [B, L, H, D]
    v = gather_kv(v_cache, block_tables, max_context_len).to(compute_dtype)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, H, Q, D]
        k.transpose(1, 2),  # [B, H, L, D]
        v.transpose(1, 2),
        attn_mask=attn_mask,  # [B, 1 or H, Q, L]: bool mask, or float bias with -inf
        scale=scale,
    ).transpose(1, 2)  # [B, Q, H, D]
    out = out * has_key[:, :, None, None]
    if seq_of_tok is None:
        return out.reshape(t, h, d).to(query.dtype)
    return out[seq_of_tok, idx_in_seq].to(query.dtype)  # [T, H, D]


def token_index(query_start_loc: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of a flat varlen batch's ``t`` queries: its sequence and its index inside it (``[T]`` int64 each), from
    ``query_start_loc`` ``[B + 1]`` int64 (on the device the results go to)."""
    tok = torch.arange(t, device=query_start_loc.device)
    seq_of_tok = torch.searchsorted(query_start_loc[1:], tok, right=True)
    return seq_of_tok, tok - query_start_loc[seq_of_tok]


def _plan(
    t: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    causal: bool,
    max_query_len: int | None,
    max_context_len: int,
    position_bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> tuple:
    """What ``paged_attention`` needs besides Q/K/V, from the step's metadata alone.

    Returns ``(seq_of_tok, idx_in_seq, max_query_len, attn_mask, has_key, block_tables)``;
    ``seq_of_tok`` / ``idx_in_seq`` are None when every sequence has exactly one
    query; ``has_key`` ``[B, Q]`` tells whether each (padded) query sees any
    key (the output of one that sees none is zeroed).
    """
    b = block_tables.shape[0]
    query_start_loc = query_start_loc.to(device=device, dtype=torch.long)
    context_lens = context_lens.to(device=device, dtype=torch.long)
    block_tables = block_tables.to(device=device, dtype=torch.long)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    if max_query_len == 1 and t == b:
        seq_of_tok = idx_in_seq = None
    else:
        seq_of_tok, idx_in_seq = token_index(query_start_loc, t)

    key_pos = torch.arange(max_context_len, device=device)  # [L]
    mask = key_pos[None, None, :] < context_lens[:, None, None]  # [B, 1, L]
    if causal:
        q_pos = context_lens[:, None] - q_lens[:, None] + torch.arange(max_query_len, device=device)[None, :]  # [B, Q]
        mask = mask & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, L]
    else:
        mask = mask.expand(b, max_query_len, max_context_len)
    has_key = mask.any(-1)  # [B, Q]
    # Rows with no visible key would be NaN in softmax; let them see key 0 and zero them after.
    mask = mask | ~has_key[:, :, None]
    attn_mask = mask[:, None]  # [B, 1, Q, L]
    if position_bias is not None:
        if not causal:
            raise ValueError("position_bias is defined for causal (self) attention only")
        dist = (q_pos[:, :, None] - key_pos[None, None, :]).clamp(0, position_bias.shape[1] - 1)  # [B, Q, L]
        bias = position_bias.to(compute_dtype)[:, dist].permute(1, 0, 2, 3)  # [B, H, Q, L]
        attn_mask = bias.masked_fill(~attn_mask, float("-inf"))
    return seq_of_tok, idx_in_seq, max_query_len, attn_mask, has_key, block_tables
