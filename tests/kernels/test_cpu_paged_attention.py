"""kernels/cpu_paged_attention.py (C, AVX2) against its torch reference ``kernels.paged_attention``."""

from __future__ import annotations

import pytest
import torch

from kernels import attention_backend, cpu_paged_attention
from kernels.cpu_paged_attention import applies, is_available, paged_decode_attention, write_applies, write_kv
from kernels.paged_attention import paged_attention as reference
from kernels.paged_attention import write_kv as write_kv_reference

pytestmark = pytest.mark.skipif(
    not is_available(),
    reason="kernels/_cpu_kernels*.so not built (no C compiler at install, not x86-64 Linux) or no AVX2/FMA",
)


def _case(
    lens: list[int],
    heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
    spare_blocks: int = 5,
    dtype: torch.dtype = torch.float32,
):
    """Random ``dtype`` caches with each sequence's blocks at shuffled, non-contiguous ids (table columns past a
    length hold junk ids); a float32 query."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = len(lens) * width + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    query = torch.randn(len(lens), heads, head_dim, generator=g)
    return query, k_cache, v_cache, tables, torch.tensor(lens)


def _reference(query, k_cache, v_cache, tables, lens, scale, bias=None, causal=True):
    return reference(
        query,
        k_cache,
        v_cache,
        tables,
        lens,
        torch.arange(len(lens) + 1),
        causal=causal,
        scale=scale,
        max_query_len=1,
        position_bias=bias,
    )


# lengths under / at / over a block, 1, and past the 8-lane vectors; head dims under / at / past 8 lanes
@pytest.mark.parametrize("lens", [[1], [3, 16, 17, 40], [7, 1, 33, 8, 9, 64]])
@pytest.mark.parametrize(
    "heads,head_dim", [(1, 8), (2, 5), (3, 20), (8, 64), (2, 128)]
)  # % 64 == 0: the head-major path
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_matches_reference(lens, heads, head_dim, block_size):
    query, k, v, tables, lens_t = _case(
        lens, heads, head_dim, block_size, seed=len(lens) * 100 + heads * 10 + block_size
    )
    got = paged_decode_attention(query, k, v, tables, lens_t, head_dim**-0.5)
    ref = _reference(query, k, v, tables, lens_t, head_dim**-0.5)
    assert got.shape == (len(lens), heads, head_dim)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("bias_len", [1, 6, 200])
def test_t5_position_bias_by_distance(bias_len, head_dim):
    """T5: bias[h, min(query_pos - key_pos, N - 1)] added to the (unscaled) scores; distances past N clamp."""
    query, k, v, tables, lens = _case([1, 9, 30], 4, head_dim, 4, seed=bias_len)
    bias = torch.randn(4, bias_len, generator=torch.Generator().manual_seed(3)) * 3
    torch.testing.assert_close(
        paged_decode_attention(query, k, v, tables, lens, 1.0, bias),
        _reference(query, k, v, tables, lens, 1.0, bias),
        rtol=1e-5,
        atol=2e-6,
    )


def test_long_context_and_large_scores_stay_finite():
    """Whisper-like 1500 cross keys, and scores in the hundreds (the max is subtracted before exp)."""
    query, k, v, tables, lens = _case([1500, 1499, 3], 6, 64, 16, seed=7)
    query = query * 40
    got = paged_decode_attention(query, k, v, tables, lens, 64**-0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(query, k, v, tables, lens, 64**-0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_empty_context_gives_zeros_and_others_are_unharmed(head_dim):
    query, k, v, tables, lens = _case([0, 5, 0], 2, head_dim, 4, seed=11)
    got = paged_decode_attention(query, k, v, tables, lens, 0.3)
    assert (got[0] == 0).all() and (got[2] == 0).all()
    torch.testing.assert_close(got, _reference(query, k, v, tables, lens, 0.3), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("num_threads", [1, 2, 3, 64])
def test_thread_split_is_bitwise_the_same(num_threads, head_dim):
    """Work items are whole (sequence, head group) pairs: any split computes every output the same way."""
    query, k, v, tables, lens = _case([5, 20, 1, 33, 2], 4, head_dim, 4, seed=5)
    one = paged_decode_attention(query, k, v, tables, lens, 0.25, num_threads=1)
    assert torch.equal(paged_decode_attention(query, k, v, tables, lens, 0.25, num_threads=num_threads), one)


def test_bad_inputs_are_refused_before_reading():
    query, k, v, tables, lens = _case([5, 9], 2, 8, 4, seed=2)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_attention(query, k, v, torch.full_like(tables, k.shape[0]), lens, 1.0)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_attention(query, k, v, torch.full_like(tables, -1), lens, 1.0)
    with pytest.raises(ValueError, match="fit the block table"):
        paged_decode_attention(query, k, v, tables, torch.tensor([5, 4 * tables.shape[1] + 1]), 1.0)
    with pytest.raises(ValueError, match="fit the block table"):
        paged_decode_attention(query, k, v, tables, torch.tensor([-1, 5]), 1.0)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention(query.half(), k, v, tables, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(query, k.transpose(0, 1), v.transpose(0, 1), tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(query, k, v, tables[:1], lens, 1.0)
    with pytest.raises(ValueError, match="position_bias"):
        paged_decode_attention(query, k, v, tables, lens, 1.0, torch.zeros(2, 0))


def test_backend_sends_float32_cpu_calls_here_one_row_per_query(monkeypatch):
    """``attention_backend.paged_attention`` (backend torch): the C kernel for float32 CPU caches, a prefill (several
    queries a sequence) included, as one kernel row per query; half-precision caches keep the reference."""
    query, k, v, tables, lens = _case([4, 9], 2, 8, 4, seed=9)
    calls = []
    real = cpu_paged_attention.paged_decode_attention
    monkeypatch.setattr(
        cpu_paged_attention, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    qsl = torch.arange(3)
    got = attention_backend.paged_attention(query, k, v, tables, lens, qsl, causal=True, scale=0.5, max_query_len=1)
    assert calls == [1]
    torch.testing.assert_close(got, _reference(query, k, v, tables, lens, 0.5), rtol=1e-5, atol=2e-6)
    # A prefill: 3 queries of the second sequence (positions 6..8), 1 of the first; causal and cross.
    q3 = torch.randn(4, 2, 8)
    qsl3 = torch.tensor([0, 1, 4])
    for causal in (True, False):
        got = attention_backend.paged_attention(q3, k, v, tables, lens, qsl3, causal=causal, scale=0.5, max_query_len=3)
        torch.testing.assert_close(
            got,
            reference(q3, k, v, tables, lens, qsl3, causal=causal, scale=0.5, max_query_len=3),
            rtol=1e-5,
            atol=2e-6,
        )
    assert calls == [1, 1, 1]
    # One step_cache, the same tables and lengths, another split of the queries: not the first call's rows.
    cache = {}
    for split in (torch.tensor([0, 3, 4]), torch.tensor([0, 1, 4])):
        got = attention_backend.paged_attention(
            q3, k, v, tables, lens, split, causal=True, scale=0.5, max_query_len=3, step_cache=cache
        )
        torch.testing.assert_close(
            got, reference(q3, k, v, tables, lens, split, causal=True, scale=0.5, max_query_len=3), rtol=1e-5, atol=2e-6
        )
    assert calls == [1, 1, 1, 1, 1]
    half = attention_backend.paged_attention(
        q3, k.half(), v.half(), tables, lens, qsl3, causal=True, scale=0.5, max_query_len=3
    )
    assert calls == [1] * 5 and half.dtype == torch.float32
    assert not applies(query, k.half(), v.half()) and applies(query, k, v)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_prefill_rows_equal_decode_steps_bit_for_bit(head_dim):
    """Batch invariance: a 5-token prefill of one sequence next to another sequence's decode row gives, for each
    token, exactly what decoding that token alone (its causal length, one query) gives; T5's bias included."""
    query, k, v, tables, lens = _case([7, 12], 3, head_dim, 4, seed=21)
    bias = torch.randn(3, 9)
    q = torch.randn(6, 3, head_dim)  # sequence 0: 1 decode query (position 6); sequence 1: 5 queries (positions 7..11)
    qsl = torch.tensor([0, 1, 6])
    step = attention_backend.paged_attention(
        q, k, v, tables, lens, qsl, causal=True, scale=0.3, max_query_len=5, position_bias=bias, step_cache={}
    )
    for row, (b, length) in enumerate([(0, 7), (1, 8), (1, 9), (1, 10), (1, 11), (1, 12)]):
        alone = attention_backend.paged_attention(
            q[row : row + 1],
            k,
            v,
            tables[b : b + 1],
            torch.tensor([length]),
            torch.tensor([0, 1]),
            causal=True,
            scale=0.3,
            max_query_len=1,
            position_bias=bias,
        )
        assert torch.equal(step[row], alone[0]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_that_share_keys_equal_each_row_alone_bit_for_bit(dtype, with_bias):
    """Rows over the same keys (a prefill's cross-attention rows, best_of samples over one window's cross KV) take the
    row-tiled path: 19 rows of one sequence (tiles of 8, 8, 3), a row of another sequence between two runs, lengths
    that are not multiples of the key tile or of four (the dot tail), and a run of empty rows; every row equals that
    row computed alone, bit for bit, under any thread split, and the reference to float rounding."""
    if dtype == torch.bfloat16 and not cpu_paged_attention.is_available():
        pytest.skip("no C kernel")
    g = torch.Generator().manual_seed(3)
    heads, head_dim, block_size = 3, 64, 16
    query, k, v, tables, lens = _case([1500, 67, 0], heads, head_dim, block_size, seed=11, dtype=dtype)
    runs = [0] * 12 + [1] + [0] * 7 + [1] * 3 + [2] * 2  # sequence of each row
    q = torch.randn(len(runs), heads, head_dim, generator=g) * 4
    row_tables, row_lens = tables[runs], lens[runs]
    bias = torch.randn(heads, 40, generator=g) if with_bias else None
    got = paged_decode_attention(q, k, v, row_tables, row_lens, 0.125, bias, num_threads=2)
    for threads in (1, 3):
        assert torch.equal(paged_decode_attention(q, k, v, row_tables, row_lens, 0.125, bias, num_threads=threads), got)
    for r, b in enumerate(runs):
        alone = paged_decode_attention(q[r : r + 1], k, v, tables[b : b + 1], lens[b : b + 1], 0.125, bias)
        assert torch.equal(alone[0], got[r]), r
    want = _reference(q, k.float(), v.float(), row_tables, row_lens, 0.125, bias)  # one query a row: causal == all keys
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 64])
def test_non_finite_scores_as_the_reference(head_dim):
    """A NaN key or an infinite query makes that head NaN (not a silently finite answer); a head whose keys a -inf
    bias masks entirely gives zeros; lengths near INT64_MAX are refused, not overflowed."""
    query, k, v, tables, lens = _case([3, 6], 2, head_dim, 4, seed=13)
    k_nan = k.clone()
    k_nan[tables[0, 0], 1, 0, 0] = float("nan")
    q_inf = query.clone()
    q_inf[1, 1, 0] = float("inf")
    for q_, k_ in ((query, k_nan), (q_inf, k)):
        torch.testing.assert_close(
            paged_decode_attention(q_, k_, v, tables, lens, 0.5),
            _reference(q_, k_, v, tables, lens, 0.5),
            equal_nan=True,
            rtol=1e-5,
            atol=2e-6,
        )
    assert torch.isnan(paged_decode_attention(query, k_nan, v, tables, lens, 0.5)[0, 0]).all()
    masked = torch.full((2, 4), float("-inf"))
    torch.testing.assert_close(
        paged_decode_attention(query, k, v, tables, lens, 1.0, masked),
        _reference(query, k, v, tables, lens, 1.0, masked),
        rtol=0,
        atol=0,
    )
    for huge in (2**63 - 1, 2**63 - 3):
        with pytest.raises(ValueError, match="fit the block table"):
            paged_decode_attention(query, k, v, tables, torch.tensor([3, huge]), 1.0)


def test_write_kv_matches_the_reference():
    """The C scatter writes what ``kernels.paged_attention.write_kv`` writes: strided key/value views (the split of
    a fused q/k/v product), padding slots (-1) skipped, every other slot untouched."""
    g = torch.Generator().manual_seed(21)
    caches = [torch.randn(6, 4, 3, 64, generator=g) for _ in range(2)]
    kv = torch.randn(5, 3 * 3 * 64, generator=g).split(3 * 64, dim=-1)[1:]  # strided [5, 192] views
    key, value = (t.view(5, 3, 64) for t in kv)
    assert not key.is_contiguous()
    slots = torch.tensor([9, -1, 2, 23, 0])
    want = [c.clone() for c in caches]
    write_kv_reference(want[0], want[1], key, value, slots)
    got = [c.clone() for c in caches]
    write_kv(got[0], got[1], key, value, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_write_kv_refuses_a_slot_past_the_cache_before_writing():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key = value = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="past the cache"):
        write_kv(k_cache, v_cache, key, value, torch.tensor([3, 8]))
    assert not k_cache.any() and not v_cache.any()  # slot 3 was valid but nothing was written
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        write_kv(k_cache, v_cache, key, value, torch.tensor([3]))
    with pytest.raises(ValueError, match="float32"):
        write_kv(k_cache.half(), v_cache.half(), key.half(), value.half(), torch.tensor([0, 1]))


def test_backend_write_kv_sends_half_caches_to_the_reference(monkeypatch):
    calls = []
    real = cpu_paged_attention.write_kv
    monkeypatch.setattr(cpu_paged_attention, "write_kv", lambda *a: calls.append(1) or real(*a))
    key = value = torch.randn(2, 1, 8)
    for dtype, expect in ((torch.float32, [1]), (torch.float16, [1])):
        k_cache, v_cache = torch.zeros(2, 4, 1, 8, dtype=dtype), torch.zeros(2, 4, 1, 8, dtype=dtype)
        attention_backend.write_kv(k_cache, v_cache, key, value, torch.tensor([5, 0]))
        assert calls == expect
        assert torch.equal(k_cache.view(8, 1, 8)[[5, 0]], key.to(dtype))


@pytest.mark.parametrize("head_dim", [8, 64])
def test_strided_query_rows_are_read_in_place(head_dim):
    """The query of a decode step is a view of the fused q/k/v product (rows 3 x H x D apart): same result as a copy."""
    _, k, v, tables, lens = _case([3, 17, 40], 2, head_dim, 4, seed=31)
    qkv = torch.randn(3, 3 * 2 * head_dim, generator=torch.Generator().manual_seed(5))
    query = qkv[:, : 2 * head_dim].view(3, 2, head_dim)
    assert not query.is_contiguous()
    assert torch.equal(
        paged_decode_attention(query, k, v, tables, lens, 0.5),
        paged_decode_attention(query.contiguous(), k, v, tables, lens, 0.5),
    )


def test_index_tensors_off_the_cpu_are_refused_not_read():
    """The C kernels read slots / block tables / lengths through host pointers: tensors on another device (``meta``
    stands in for CUDA here) never reach them."""
    query, k, v, tables, lens = _case([3, 6], 2, 8, 4, seed=17)
    meta = torch.empty(2, dtype=torch.long, device="meta")
    assert not write_applies(k, v, query, query, meta)
    with pytest.raises(ValueError, match="CPU slots"):
        write_kv(k, v, query, query, meta)
    with pytest.raises(ValueError, match="CPU block_tables"):
        paged_decode_attention(query, k, v, tables.to("meta"), lens, 1.0)
    with pytest.raises(ValueError, match="CPU block_tables"):
        paged_decode_attention(query, k, v, tables, lens, 1.0, torch.zeros(2, 3, device="meta"))
