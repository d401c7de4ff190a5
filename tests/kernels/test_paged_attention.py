"""kernels.paged_attention against naive per-sequence dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.paged_attention import gather_kv, paged_attention, write_kv


def _naive(query, keys, values, q_lens, ctx_lens, causal, scale):
    """Per-sequence dense attention; keys[b] / values[b] are ``[ctx_b, H, D]``."""
    out, start = [], 0
    for b, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        q = query[start : start + q_len].double()  # [q, H, D]
        start += q_len
        k, v = keys[b].double(), values[b].double()  # [ctx, H, D]
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            q_pos = torch.arange(ctx - q_len, ctx)[:, None]
            s = s.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(out).to(query.dtype)


def _setup(q_lens, ctx_lens, block_size, heads=3, head_dim=8, dtype=torch.float32, seed=0, extra_blocks=5):
    """Random K/V per sequence written into shuffled blocks; returns everything both paths need."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(c / block_size) for c in ctx_lens]
    total = sum(n_blocks) + extra_blocks
    perm = torch.randperm(total, generator=g).tolist()
    k_cache = torch.randn(total, block_size, heads, head_dim, generator=g).to(dtype)  # junk everywhere
    v_cache = torch.randn(total, block_size, heads, head_dim, generator=g).to(dtype)
    keys, values, tables, slots = [], [], [], []
    for c, nb in zip(ctx_lens, n_blocks):
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        keys.append(torch.randn(c, heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(c, heads, head_dim, generator=g).to(dtype))
        slots.append(
            torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.long)
        )
    width = max(1, max(n_blocks))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values), torch.cat(slots))
    query = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.long)
    return query, k_cache, v_cache, block_tables, torch.tensor(ctx_lens), qsl, keys, values


CASES = {
    # name: (q_lens, ctx_lens, block_size)
    "decode_irregular": ([1, 1, 1, 1], [1, 17, 5, 33], 4),
    "prefill_only": ([7, 3], [7, 3], 16),
    "mixed_prefill_decode": ([5, 1, 9, 1, 2], [5, 40, 9, 7, 13], 6),
    "one_token_each": ([1, 1], [1, 1], 3),
    "block_size_one": ([2, 1], [4, 3], 1),
    "chunked_prefill": ([4, 3], [11, 20], 5),  # queries continue a cached context
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
def test_matches_naive(name, causal):
    q_lens, ctx_lens, bs = CASES[name]
    query, kc, vc, bt, ctx, qsl, keys, values = _setup(q_lens, ctx_lens, bs)
    scale = query.shape[-1] ** -0.5
    ref = _naive(query, keys, values, q_lens, ctx_lens, causal, scale)
    got = paged_attention(query, kc, vc, bt, ctx, qsl, causal=causal, scale=scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # Explicit maxima (no host sync) must give the same result.
    got2 = paged_attention(
        query,
        kc,
        vc,
        bt,
        ctx,
        qsl,
        causal=causal,
        scale=scale,
        max_query_len=max(q_lens),
        max_context_len=max(ctx_lens),
    )
    torch.testing.assert_close(got2, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["decode_irregular", "mixed_prefill_decode"])
def test_step_cache_reused_across_layers(name):
    """Two "layers" (different K/V and queries, same step metadata) through one step_cache give what
    each gives alone; with a position bias too (built once, then reused)."""
    q_lens, ctx_lens, bs = CASES[name]
    first = _setup(q_lens, ctx_lens, bs, seed=1)
    bt, ctx, qsl = first[3], first[4], first[5]
    second = tuple(torch.randn_like(t) for t in first[:3])  # another layer: other queries and caches
    bias = torch.randn(first[0].shape[1], 50)
    for position_bias in (None, bias):
        cache: dict = {}
        for query, kc, vc, *_ in (first, second, first):
            kw = dict(
                causal=True,
                scale=0.5,
                max_query_len=max(q_lens),
                max_context_len=max(ctx_lens),
                position_bias=position_bias,
            )
            alone = paged_attention(query, kc, vc, bt, ctx, qsl, **kw)
            torch.testing.assert_close(
                paged_attention(query, kc, vc, bt, ctx, qsl, step_cache=cache, **kw), alone, atol=0, rtol=0
            )
        assert len(cache) == 1  # built by the first call only


def test_cross_attention_whisper_shape():
    """Encoder length 1500 with a block size that does not divide it, 2 decode queries + a prefill."""
    q_lens, ctx_lens = [1, 3, 1], [1500, 1500, 700]
    query, kc, vc, bt, ctx, qsl, keys, values = _setup(q_lens, ctx_lens, 16, heads=6, head_dim=64)
    ref = _naive(query, keys, values, q_lens, ctx_lens, False, 0.125)
    got = paged_attention(query, kc, vc, bt, ctx, qsl, causal=False, scale=0.125, max_context_len=1500)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_softmax_in_float32(dtype):
    q_lens, ctx_lens = [3, 1], [10, 25]
    query, kc, vc, bt, ctx, qsl, keys, values = _setup(q_lens, ctx_lens, 4, dtype=dtype)
    ref = _naive(query.float(), [k.float() for k in keys], [v.float() for v in values], q_lens, ctx_lens, True, 0.3)
    got = paged_attention(query, kc, vc, bt, ctx, qsl, causal=True, scale=0.3)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def test_empty_batch_slot_and_zero_context():
    """A sequence with no query tokens is skipped; one with no keys yields zeros, not NaN."""
    query, kc, vc, bt, ctx, qsl, keys, values = _setup([2, 1], [2, 6], 4)
    # Insert an empty sequence between the two (no query tokens, zero context).
    bt3 = torch.stack([bt[0], torch.zeros_like(bt[0]), bt[1]])
    ctx3 = torch.tensor([2, 0, 6])
    qsl3 = torch.tensor([0, 2, 2, 3])
    ref = _naive(query, keys, values, [2, 1], [2, 6], True, 0.5)
    torch.testing.assert_close(paged_attention(query, kc, vc, bt3, ctx3, qsl3, causal=True, scale=0.5), ref)
    # Non-causal query over zero keys.
    out = paged_attention(query[:1], kc, vc, bt[:1], torch.tensor([0]), torch.tensor([0, 1]), causal=False, scale=0.5)
    assert torch.equal(out, torch.zeros_like(out))
    assert paged_attention(query[:0], kc, vc, bt, ctx, torch.tensor([0, 0, 0]), causal=True, scale=0.5).shape == (
        0,
        3,
        8,
    )


def test_write_kv_slots_and_padding():
    kc = torch.zeros(3, 4, 2, 5)
    vc = torch.zeros(3, 4, 2, 5)
    key = torch.randn(3, 2, 5)
    value = torch.randn(3, 2, 5)
    write_kv(kc, vc, key, value, torch.tensor([9, -1, 2]))  # -1 is a padding token: skipped
    torch.testing.assert_close(kc[2, 1], key[0])
    torch.testing.assert_close(vc[0, 2], value[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2


def test_gather_kv_order():
    cache = torch.arange(5 * 3).float().view(5, 3, 1, 1)  # entry value = slot id
    out = gather_kv(cache, torch.tensor([[4, 1], [2, 0]]), 5)
    assert out.flatten(1).tolist() == [[12, 13, 14, 3, 4], [6, 7, 8, 0, 1]]
