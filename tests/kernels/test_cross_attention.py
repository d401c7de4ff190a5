"""In-place cross attention over contiguous block runs vs the paged torch reference."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.core.block_manager import BlockPool
from kernels.cross_attention import contiguous_cross_attention
from kernels.paged_attention import paged_attention

H, D = 3, 8


@pytest.mark.parametrize("block_size", [1, 4, 7])
@pytest.mark.parametrize(
    "case",
    [
        [(1, 13)],  # one decode token
        [(3, 5), (1, 1), (2, 29)],  # mixed prefill/decode, a one-position encoder output
        [(1, 16), (1, 15), (1, 17)],
    ],
)
def test_matches_paged_reference(block_size, case):
    g = torch.Generator().manual_seed(len(case) * 10 + block_size)
    num_blocks = sum(-(-kv // block_size) for _, kv in case) + 5
    k_cache = torch.randn(num_blocks, block_size, H, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, H, D, generator=g)
    q_lens = [q for q, _ in case]
    query = torch.randn(sum(q_lens), H, D, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    tables, spans, next_block = [], [], 2  # runs start past block 0 so slot offsets matter
    for b, (_q, kv) in enumerate(case):
        nb = -(-kv // block_size)
        tables.append(list(range(next_block, next_block + nb)))
        spans.append((int(qsl[b]), int(qsl[b + 1]), next_block * block_size, kv))
        next_block += nb
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor([kv for _, kv in case])
    ref = paged_attention(query, k_cache, v_cache, block_tables, lens, qsl, causal=False, scale=D**-0.5)
    got = contiguous_cross_attention(query, k_cache, v_cache, spans, scale=D**-0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pool_prefers_contiguous_runs_and_falls_back():
    pool = BlockPool("cross", 10)
    a = pool.allocate_contiguous(4)
    b = pool.allocate_contiguous(3)
    assert a == [0, 1, 2, 3] and b == [4, 5, 6]
    pool.free(a)
    c = pool.allocate_contiguous(2)
    assert c == [0, 1]
    # Free: 2, 3, 7, 8, 9 -> no run of 5, any free blocks are handed out instead.
    d = pool.allocate_contiguous(5)
    assert sorted(d) == [2, 3, 7, 8, 9] and pool.num_free == 0
    pool.free(b + c + d)
    assert pool.num_free == 10 and all(r == 0 for r in pool.ref_counts)
