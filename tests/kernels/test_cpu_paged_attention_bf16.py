"""kernels/cpu_paged_attention.py on bfloat16 KV caches (float32 query, math and output) against its references.

Two references: the torch one (``kernels.paged_attention``, which upcasts the cache to float32), to float rounding;
and the float32 C kernel on the same cache upcast, bit for bit (the bfloat16 kernel widens each element exactly and
keeps every sum in the float32 kernel's order). ``write_kv`` into a bfloat16 cache is ``Tensor.to(torch.bfloat16)``
bit for bit. The widening is AVX2 (vpmovzxwd + vpslld), the kernel's own requirement: no other flag to skip on.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_paged_attention import _case as case_of
from test_cpu_paged_attention import _reference

from kernels import attention_backend, cpu_paged_attention
from kernels.attention_backends.torch_backend import TorchAttentionBackend
from kernels.cpu_paged_attention import applies, is_available, paged_decode_attention, write_applies, write_kv
from kernels.paged_attention import paged_attention as reference
from kernels.paged_attention import write_kv as write_kv_reference

pytestmark = pytest.mark.skipif(
    not is_available(),
    reason="kernels/_cpu_kernels*.so not built (no C compiler at install, not x86-64 Linux) or no avx2/fma",
)

BF16 = torch.bfloat16


def _case(*args, **kwargs):
    """``test_cpu_paged_attention._case`` with bfloat16 caches (the same values, rounded)."""
    return case_of(*args, **kwargs, dtype=BF16)


# lengths 1, under / at / over a block, past the 8-lane vectors and the 4-key groups; head dims with a scalar
# tail (5, 20: the token-by-token path) and % 64 == 0 (64, 128: head-major, the served models')
@pytest.mark.parametrize("lens", [[1], [3, 16, 17, 40], [7, 1, 33, 8, 9, 64], [2, 0, 5]])
@pytest.mark.parametrize("heads,head_dim", [(2, 5), (3, 20), (8, 64), (2, 128)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_matches_the_references(lens, heads, head_dim, block_size):
    query, k, v, tables, lens_t = _case(lens, heads, head_dim, block_size, seed=len(lens) * 100 + head_dim + block_size)
    got = paged_decode_attention(query, k, v, tables, lens_t, head_dim**-0.5)
    assert got.dtype == torch.float32 and got.shape == (len(lens), heads, head_dim)
    assert torch.equal(got, paged_decode_attention(query, k.float(), v.float(), tables, lens_t, head_dim**-0.5))
    torch.testing.assert_close(got, _reference(query, k, v, tables, lens_t, head_dim**-0.5), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("head_dim", [20, 64])
def test_t5_position_bias_and_cross_lengths(head_dim):
    """Self-attention with T5's bias by causal distance, and cross-attention (no bias, every key seen) over the
    same bfloat16 pool: both as the float32 kernel upcast and near the reference."""
    query, k, v, tables, lens = _case([1, 9, 30, 17], 4, head_dim, 4, seed=head_dim)
    bias = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    for b, causal in ((bias, True), (None, False)):
        got = paged_decode_attention(query, k, v, tables, lens, 0.3, b)
        assert torch.equal(got, paged_decode_attention(query, k.float(), v.float(), tables, lens, 0.3, b))
        torch.testing.assert_close(
            got, _reference(query, k, v, tables, lens, 0.3, b, causal=causal), rtol=1e-5, atol=2e-6
        )


def test_whisper_cross_pool_shape():
    """1500 encoder frames in blocks of 16, Whisper-base heads; one sequence shorter by a partial block."""
    query, k, v, tables, lens = _case([1500, 1493, 1], 8, 64, 16, seed=7)
    got = paged_decode_attention(query * 20, k, v, tables, lens, 64**-0.5)
    assert torch.isfinite(got).all()
    assert torch.equal(got, paged_decode_attention(query * 20, k.float(), v.float(), tables, lens, 64**-0.5))
    torch.testing.assert_close(got, _reference(query * 20, k, v, tables, lens, 64**-0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [20, 64])
def test_a_sequence_alone_equals_it_in_a_batch(head_dim):
    """Batch invariance: each sequence's output is bit for bit the same decoded alone, in the batch, and under any
    thread split (including the split by heads of a batch smaller than 2 x threads)."""
    query, k, v, tables, lens = _case([5, 40, 1, 33, 2, 17], 4, head_dim, 4, seed=5)
    batch = paged_decode_attention(query, k, v, tables, lens, 0.25, num_threads=2)
    for threads in (1, 3, 64):
        assert torch.equal(paged_decode_attention(query, k, v, tables, lens, 0.25, num_threads=threads), batch)
    for b in range(len(lens)):
        for threads in (1, 2):
            alone = paged_decode_attention(
                query[b : b + 1], k, v, tables[b : b + 1], lens[b : b + 1], 0.25, num_threads=threads
            )
            assert torch.equal(alone[0], batch[b]), (b, threads)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_backend_runs_bfloat16_caches_here_self_and_cross(monkeypatch, head_dim):
    """``attention_backend.paged_attention`` (backend torch) sends bfloat16 caches with a float32 query to the C
    kernel, decode steps and prefills (one row per query), causal and cross; a prefill's rows equal decoding each
    token alone bit for bit. ``cross`` reads the blocks in place for them; float16 caches and a bfloat16 query keep
    the reference."""
    query, k, v, tables, lens = _case([7, 12], 3, head_dim, 4, seed=21)
    calls = []
    real = cpu_paged_attention.paged_decode_attention
    monkeypatch.setattr(
        cpu_paged_attention, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    bias = torch.randn(3, 9)
    q = torch.randn(6, 3, head_dim)  # sequence 0: 1 decode query (position 6); sequence 1: 5 queries (positions 7..11)
    qsl = torch.tensor([0, 1, 6])
    for causal, b in ((True, bias), (False, None)):
        step = attention_backend.paged_attention(
            q, k, v, tables, lens, qsl, causal=causal, scale=0.3, max_query_len=5, position_bias=b, step_cache={}
        )
        want = reference(q, k, v, tables, lens, qsl, causal=causal, scale=0.3, max_query_len=5, position_bias=b)
        torch.testing.assert_close(step, want, rtol=1e-5, atol=2e-6)
        rows = [(0, 7), (1, 8), (1, 9), (1, 10), (1, 11), (1, 12)] if causal else [(0, 7)] + [(1, 12)] * 5
        for row, (s, length) in enumerate(rows):
            alone = attention_backend.paged_attention(
                q[row : row + 1],
                k,
                v,
                tables[s : s + 1],
                torch.tensor([length]),
                torch.tensor([0, 1]),
                causal=causal,
                scale=0.3,
                max_query_len=1,
                position_bias=b,
            )
            assert torch.equal(step[row], alone[0]), (causal, row)
    assert len(calls) == 2 * 7
    assert applies(query, k, v) and TorchAttentionBackend().reads_blocks_in_place(query, k, v)
    assert not applies(query, k.half(), v.half()) and not applies(query.to(BF16), k, v)
    assert not applies(query, k, v.float())  # K and V of one dtype
    half = attention_backend.paged_attention(query, k.half(), v.half(), tables, lens, torch.arange(3), True, 0.3, 1)
    assert len(calls) == 14 and half.dtype == torch.float32


def test_non_finite_as_the_reference():
    """A NaN key makes its head NaN; a -inf bias over every key gives zeros; empty contexts give zeros."""
    query, k, v, tables, lens = _case([3, 6, 0], 2, 64, 4, seed=13)
    k_nan = k.clone()
    k_nan[tables[0, 0], 1, 0, 0] = float("nan")
    got = paged_decode_attention(query, k_nan, v, tables, lens, 0.5)
    assert torch.isnan(got[0, 0]).all() and not torch.isnan(got[1]).any()
    torch.testing.assert_close(
        got, _reference(query, k_nan, v, tables, lens, 0.5), equal_nan=True, rtol=1e-5, atol=2e-6
    )
    masked = paged_decode_attention(query, k, v, tables, lens, 1.0, torch.full((2, 4), float("-inf")))
    assert (masked == 0).all()
    assert (paged_decode_attention(query, k, v, tables, lens, 0.5)[2] == 0).all()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# float32 bit patterns whose rounding is a corner: NaNs (quiet, negative, signalling), +-inf, the largest float32
# (rounds to inf), a tie at the largest bfloat16's odd neighbour (to inf), ties to even (down) and to odd (up),
# just under / over a tie, subnormals and a subnormal tie, -0.
_CORNERS = [0x7FC00000, -0x3FFFFF, 0x7F800001, 0x7F800000, -0x800000, 0x7F7FFFFF, 0x7F7F8000, 0x3F808000]
_CORNERS += [0x3F818000, 0x3F807FFF, 0x3F808001, 0x00000001, 0x00008000, 0x00018000, -0x80000000]


def _patterns(n: int, row: int, g: torch.Generator) -> torch.Tensor:
    """``[n, row]`` float32 of random bit patterns over the whole range, a quarter of them ties, and ``_CORNERS``."""
    bits = torch.randint(-(2**31), 2**31, (n * row,), generator=g, dtype=torch.int64)
    bits[: n * row // 4] = (bits[: n * row // 4] & ~0xFFFF) | 0x8000  # low half exactly half an ulp of bfloat16
    bits[: len(_CORNERS)] = torch.tensor(_CORNERS)
    return bits.to(torch.int32).view(torch.float32).view(n, row)


@pytest.mark.parametrize("heads,head_dim", [(3, 64), (3, 5)])  # rows of 192 (vector body) and 15 (scalar tail)
def test_write_kv_rounds_as_torch_bit_for_bit(heads, head_dim):
    """Into bfloat16 caches: what the reference (``Tensor.to(torch.bfloat16)``) writes, bit for bit, a NaN as a NaN.
    Keys / values are strided views (a fused q/k/v product), a padding slot (-1) is skipped, other slots keep their
    contents."""
    g = torch.Generator().manual_seed(head_dim)
    n, row = 40, heads * head_dim
    qkv = torch.randn(n, 3 * row, generator=g)
    qkv[:, row : 2 * row] = _patterns(n, row, g)
    qkv[:, 2 * row :] = _patterns(n, row, g).flip(0)
    key, value = (t.view(n, heads, head_dim) for t in qkv[:, row:].split(row, dim=-1))
    assert not key.is_contiguous()
    slots = torch.randperm(6 * 8, generator=g)[:n]
    slots[3] = -1
    caches = [torch.randn(6, 8, heads, head_dim, generator=g).to(BF16) for _ in range(2)]
    want = [c.clone() for c in caches]
    write_kv_reference(want[0], want[1], key, value, slots)
    got = [c.clone() for c in caches]
    assert write_applies(got[0], got[1], key, value, slots)
    write_kv(got[0], got[1], key, value, slots)
    for c, w in zip(got, want):
        nan = torch.isnan(w)
        assert nan.any() and torch.equal(torch.isnan(c), nan)  # NaN stays NaN, nothing else becomes one
        assert torch.equal(_bits(c)[~nan], _bits(w)[~nan])
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))  # NaNs too


def test_write_kv_equals_to_bfloat16_and_nans_stay_nans():
    """Finite values against ``Tensor.to(torch.bfloat16)`` directly; a NaN of either sign is written as a NaN (0xffff
    here, the NaN torch's vectorized conversion writes)."""
    key = torch.randn(4, 2, 16) * torch.logspace(-44, 38, 4)[:, None, None]
    key[1, 0, :3] = torch.tensor([float("nan"), -float("nan"), float("inf")])
    value = -key
    k_cache, v_cache = torch.zeros(2, 4, 2, 16, dtype=BF16), torch.zeros(2, 4, 2, 16, dtype=BF16)
    write_kv(k_cache, v_cache, key, value, torch.tensor([6, 0, 3, 5]))
    for cache, src in ((k_cache, key), (v_cache, value)):
        got = cache.view(8, 2, 16)[[6, 0, 3, 5]]
        finite = ~torch.isnan(src)
        assert torch.equal(_bits(got)[finite], _bits(src.to(BF16))[finite])
        assert torch.isnan(got[~finite]).all()


def test_backend_write_kv_and_bad_inputs():
    """The backend's ``write_kv`` takes the C scatter for bfloat16 caches and float32 keys; bfloat16 keys, mixed
    caches and mixed query / caches are the reference's or refused, naming the dtypes."""
    key = value = torch.randn(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8, dtype=BF16), torch.zeros(2, 4, 1, 8, dtype=BF16)
    attention_backend.write_kv(k_cache, v_cache, key, value, torch.tensor([5, 0]))
    assert torch.equal(_bits(k_cache.view(8, 1, 8)[[5, 0]]), _bits(key.to(BF16)))
    assert not write_applies(k_cache, v_cache, key.to(BF16), value.to(BF16), torch.tensor([5, 0]))
    assert not write_applies(k_cache, v_cache.float(), key, value, torch.tensor([5, 0]))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        write_kv(k_cache, v_cache.float(), key, value, torch.tensor([5, 0]))
    with pytest.raises(ValueError, match="past the cache"):
        write_kv(k_cache, v_cache, key, value, torch.tensor([3, 8]))
    query, k, v, tables, lens = _case([5, 9], 2, 8, 4, seed=2)
    with pytest.raises(ValueError, match="float32 CPU query and float32 or bfloat16"):
        paged_decode_attention(query, k, v.float(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="float32 CPU query"):
        paged_decode_attention(query.to(BF16), k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_attention(query, k, v, torch.full_like(tables, k.shape[0]), lens, 1.0)
