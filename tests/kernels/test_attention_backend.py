"""The attention backend registry and object: made by name, checked when made, one plan per step."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_paged_attention
from kernels.attention_backend import ATTENTION_BACKENDS, make_attention_backend
from kernels.attention_backends.torch_backend import TorchAttentionBackend
from kernels.paged_attention import paged_attention as reference
from shared.attention_metadata import AttentionMetadata


def _step(q_lens, seq_lens, enc_lens, block_size=4, heads=2, head_dim=8, seed=0):
    """A step of ``len(q_lens)`` sequences over shuffled self and cross blocks: metadata, query, caches."""
    g = torch.Generator().manual_seed(seed)
    n_self = [-(-n // block_size) for n in seq_lens]
    n_cross = [-(-n // block_size) for n in enc_lens]
    perm_s = torch.randperm(sum(n_self), generator=g).tolist()
    perm_c = torch.randperm(sum(n_cross), generator=g).tolist()
    pad = lambda rows: torch.tensor([r + [0] * (max(map(len, rows)) - len(r)) for r in rows])  # noqa: E731
    tables = [[perm_s.pop() for _ in range(n)] for n in n_self]
    cross_tables = [[perm_c.pop() for _ in range(n)] for n in n_cross]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    slots = [
        tables[b][p // block_size] * block_size + p % block_size
        for b, (q, n) in enumerate(zip(q_lens, seq_lens))
        for p in range(n - q, n)
    ]
    md = AttentionMetadata(
        query_start_loc=qsl,
        slot_mapping=torch.tensor(slots),
        seq_lens=torch.tensor(seq_lens),
        block_tables=pad(tables),
        cross_block_tables=pad(cross_tables),
        encoder_lens=torch.tensor(enc_lens),
        logits_indices=qsl[1:] - 1,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        max_encoder_len=max(enc_lens),
    )
    self_kv = torch.randn(2, sum(n_self), block_size, heads, head_dim, generator=g)
    cross_kv = torch.randn(2, sum(n_cross), block_size, heads, head_dim, generator=g)
    query = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    return md, query, self_kv, cross_kv


def test_registry_makes_backends_by_name_and_refuses_others():
    assert ATTENTION_BACKENDS == ("torch", "triton")
    backend = make_attention_backend("torch", "cpu")
    assert isinstance(backend, TorchAttentionBackend) and backend.name == "torch"
    with pytest.raises(ValueError, match="must be one of torch, triton; got 'flash_attn'"):
        make_attention_backend("flash_attn")


def test_metadata_carries_a_torch_backend_by_default():
    md, *_ = _step([1], [3], [5])
    assert md.attn_backend.name == md.attention_backend == "torch"


@pytest.mark.skipif(not cpu_paged_attention.is_available(), reason="kernels/_cpu_kernels*.so not built")
def test_prepare_plans_query_rows_once_and_changes_no_number():
    """A prefill next to a decode row: ``prepare`` puts the self and cross query rows into the step cache, and the
    layer calls give exactly what they give unprepared (rows planned on first use) and what the reference gives."""
    backend = make_attention_backend("torch")
    results = []
    for prepared in (False, True):
        md, query, self_kv, cross_kv = _step([1, 4], [6, 9], [7, 13], seed=3)
        md.attn_backend = backend
        if prepared:
            backend.prepare(md)
            assert sum(k[0] == "query_rows" for k in md.step_cache) == 2
        results.append((backend.paged(query, self_kv, md, scale=0.5), backend.cross(query, cross_kv, md, scale=0.5)))
        assert sum(k[0] == "query_rows" for k in md.step_cache) == 2
    for got, again in zip(*results):
        assert torch.equal(got, again)
    want = reference(
        query, self_kv[0], self_kv[1], md.block_tables, md.seq_lens, md.query_start_loc, causal=True, scale=0.5
    )
    torch.testing.assert_close(results[1][0], want, rtol=1e-5, atol=2e-6)


def test_prepare_plans_nothing_for_a_decode_step():
    md, *_ = _step([1, 1], [6, 9], [7, 13])
    make_attention_backend("torch").prepare(md)
    assert md.step_cache == {}
