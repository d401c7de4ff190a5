"""Triton paged attention: decode/varlen self-attention and cross-attention read in place.

Same signatures and semantics as the torch references beside this file:
``kernels.paged_attention.paged_attention`` (K/V found through a block table,
optional causal mask, optional T5 additive position bias) and
``kernels.cross_attention.contiguous_cross_attention`` (cross K/V read as one
run of flat cache slots per sequence). ``tests/kernels/test_triton_kernels.py``
compares them on irregular shapes.

Algorithm: one program per (query token, head), as in vLLM's PagedAttention
decode kernel (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023), extended to varlen batches by
giving each query token its own visible key count. Keys are visited in tiles
of ``BLOCK_N`` positions (a tile spans several cache blocks: each key's slot is
looked up through the block table, so the tile size is independent of the
block size) with the online softmax of FlashAttention (Dao et al. 2022;
Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018): a
running maximum ``m``, running denominator ``l`` and an unnormalised
accumulator rescaled by ``exp(m_old - m_new)`` per tile. Scores, softmax and
the accumulator are float32 whatever the cache dtype.

Memory traffic per (token, head): reads its visible ``2 * kv_len * D`` K/V
elements once, in place (no dense copy, unlike the torch reference), plus
``kv_len / block_size`` block-table entries; writes ``D`` outputs.

On CPU the kernels run only under ``TRITON_INTERPRET=1`` (set before this
module is imported), slowly: the interpreter's cost grows with the number of
program instances and tiles, so it is for tests, not serving.

Over 300 lines: one Triton kernel per file, with its launcher and the two entry points
(paged self-attention, contiguous cross-attention) that share it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per tile on a GPU: one tile covers several cache blocks; a [64, 64] fp32
# K tile is 16 KB of registers per program.
BLOCK_N = 64
# The interpreter pays per tile, not per element (a 1500-key Whisper cross
# attention runs far faster in one tile than in 64-key tiles; measured:
# docs/benchmarks.md, Measurements formerly in docstrings), so it takes the
# longest context in one tile, up to this many keys.
INTERPRET_MAX_BLOCK_N = 2048


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    first_slot_ptr,
    seq_idx_ptr,
    kv_len_ptr,
    q_pos_ptr,
    bias_ptr,
    scale,
    head_dim,
    num_bias,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_bias_h,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):
    """Program (t, h): output row ``out[t, h, :]``; see the module docstring."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(seq_idx_ptr + t).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + t).to(tl.int32)  # key positions fit int32; block ids are scaled in int64
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)  # [BLOCK_D]
    if HAS_BIAS:
        q_pos = tl.load(q_pos_ptr + t).to(tl.int32)
    if CONTIGUOUS:
        first_slot = tl.load(first_slot_ptr + b)

    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, kv_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # key positions of this tile
        n_mask = offs_n < kv_len
        if CONTIGUOUS:
            slot = first_slot + offs_n
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
        else:
            blk = tl.load(block_tables_ptr + b * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
            off = offs_n % BLOCK_SIZE
        blk = blk.to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + (blk * stride_kb + off * stride_ks + h * stride_kh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        s = tl.sum(q[None, :] * k, 1) * scale  # [BLOCK_N]
        if HAS_BIAS:
            dist = tl.minimum(tl.maximum(q_pos - offs_n, 0), num_bias - 1)
            s += tl.load(bias_ptr + h * stride_bias_h + dist, mask=n_mask, other=0.0)
        s = tl.where(n_mask, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: every tile holds a visible key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)  # [BLOCK_N]; 0 at masked keys
        v = tl.load(
            v_cache_ptr + (blk * stride_vb + off * stride_vs + h * stride_vh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)  # no visible key: acc is 0, output zeros
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _launch(
    query,
    k_cache,
    v_cache,
    seq_idx,
    kv_len,
    scale,
    *,
    block_tables=None,
    first_slot=None,
    q_pos=None,
    position_bias=None,
) -> torch.Tensor:
    """Runs the kernel over grid ``(T, H)``; per-token ``seq_idx`` / ``kv_len`` (/ ``q_pos``) are int64 ``[T]``."""
    t, h, d = query.shape
    if not _INTERPRET and query.device.type != "cuda":
        raise ValueError(
            f"the Triton attention kernels need CUDA tensors, got {query.device}; "
            "on CPU set TRITON_INTERPRET=1 before importing them (tests only) or use attention_backend 'torch'"
        )
    out = torch.empty_like(query)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must have a unit stride on head_dim")
    dummy = seq_idx  # stands in for pointers a constexpr branch never reads
    if position_bias is not None:
        position_bias = position_bias.to(device=query.device, dtype=torch.float32).contiguous()  # [H, N]
    contiguous = first_slot is not None
    _paged_attention_kernel[(t, h)](
        out,
        query,
        k_cache,
        v_cache,
        block_tables if block_tables is not None else dummy,
        first_slot if contiguous else dummy,
        seq_idx,
        kv_len,
        q_pos if q_pos is not None else dummy,
        position_bias if position_bias is not None else dummy,
        float(scale),
        d,
        position_bias.shape[1] if position_bias is not None else 1,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0) if block_tables is not None else 0,
        position_bias.stride(0) if position_bias is not None else 0,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=_block_n(kv_len),
        BLOCK_D=triton.next_power_of_2(d),
        HAS_BIAS=position_bias is not None,
        CONTIGUOUS=contiguous,
    )
    return out


# @triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set at import.
_INTERPRET = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _block_n(kv_len: torch.Tensor) -> int:
    if not _INTERPRET:
        return BLOCK_N
    return min(INTERPRET_MAX_BLOCK_N, triton.next_power_of_2(max(int(kv_len.max()), 16)))  # host sync: CPU only


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
) -> torch.Tensor:
    """Attention of a flat varlen batch of queries over paged K/V, read in place.

    Drop-in for ``kernels.paged_attention.paged_attention`` (same arguments,
    masking and output); no host sync.

    Args:
        query: ``[T, H, D]`` float32/float16/bfloat16.
        k_cache: ``[num_blocks, block_size, H, D]``, unit stride on ``D``.
        v_cache: ``[num_blocks, block_size, H, D]``.
        block_tables: ``[B, M]`` int block ids, padded with any valid id.
        context_lens: ``[B]`` int key count of each sequence (keys past
            ``M * block_size`` do not exist, as in the reference).
        query_start_loc: ``[B + 1]`` int cumulative query lengths.
        causal: query ``i`` of sequence ``b`` sits at position
            ``context_lens[b] - q_len_b + i`` and sees keys ``0..position``
            (self-attention); else every query sees ``context_lens[b]`` keys.
        scale: factor on ``q . k``.
        max_query_len: unused (the kernel needs no maxima); kept for the
            reference's signature.
        max_context_len: unused, as above.
        position_bias: optional ``[H, N]`` T5 bias by causal distance: the
            score of key ``j`` for a query at position ``p`` gets
            ``position_bias[:, min(p - j, N - 1)]`` added. Causal only.

    Returns:
        ``[T, H, D]`` in the dtype of ``query``; zeros for a query with no
        visible key.

    Raises:
        ValueError: ``position_bias`` with ``causal=False``.
    """
    del max_query_len, max_context_len
    if position_bias is not None and not causal:
        raise ValueError("position_bias is defined for causal (self) attention only")
    t = query.shape[0]
    b = block_tables.shape[0]
    if t == 0 or b == 0:
        return query.new_zeros(query.shape)
    device = query.device
    qsl = query_start_loc.to(device=device, dtype=torch.long)
    ctx = context_lens.to(device=device, dtype=torch.long).clamp(max=block_tables.shape[1] * k_cache.shape[1])
    tok = torch.arange(t, device=device)
    seq_idx = torch.searchsorted(qsl[1:], tok, right=True)  # [T]
    q_pos = ctx[seq_idx] - (qsl[seq_idx + 1] - tok)  # [T] absolute position of each query token
    kv_len = (q_pos + 1).clamp(min=0).minimum(ctx[seq_idx]) if causal else ctx[seq_idx]  # [T] visible keys
    return _launch(
        query,
        k_cache,
        v_cache,
        seq_idx,
        kv_len,
        scale,
        block_tables=block_tables.to(device=device, dtype=torch.long),
        q_pos=q_pos,
        position_bias=position_bias,
    )


def contiguous_cross_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Non-causal attention of each sequence's queries over its in-place K/V slot run.

    Drop-in for ``kernels.cross_attention.contiguous_cross_attention``.

    Args:
        query: ``[T, H, D]`` flat varlen queries.
        k_cache: ``[num_blocks, block_size, H, D]``, unit stride on ``D``.
        v_cache: ``[num_blocks, block_size, H, D]``.
        spans: per sequence ``(query_start, query_end, first_slot, kv_len)``:
            queries ``query[query_start:query_end]`` attend to the flat cache
            slots ``first_slot : first_slot + kv_len``.
        scale: factor on ``q . k``.

    Returns:
        ``[T, H, D]`` in the dtype of ``query``; rows no span covers are zeros.
    """
    t = query.shape[0]
    if t == 0 or not spans:
        return query.new_zeros(query.shape)
    seq_idx = [0] * t
    kv_len = [0] * t
    for b, (q_start, q_end, _, n) in enumerate(spans):
        seq_idx[q_start:q_end] = [b] * (q_end - q_start)
        kv_len[q_start:q_end] = [n] * (q_end - q_start)
    device = query.device
    first_slot = torch.tensor([s[2] for s in spans], dtype=torch.long, device=device)
    return _launch(
        query,
        k_cache,
        v_cache,
        torch.tensor(seq_idx, dtype=torch.long, device=device),
        torch.tensor(kv_len, dtype=torch.long, device=device),
        scale,
        first_slot=first_slot,
    )
