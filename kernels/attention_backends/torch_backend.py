"""Backend ``torch`` (the default): the C kernel for float32 / bfloat16 CPU caches, the torch references otherwise.

Float32 queries over float32 or bfloat16 CPU caches run ``kernels.cpu_paged_attention`` where it is built (blocks
read in place, much faster than the reference's gather + SDPA on a decode step; measured: docs/benchmarks.md,
Measurements formerly in docstrings), one kernel row per query (``query_rows``) when a sequence has
several: each query is computed as in a decode step, so a token's result does not depend on the rest of the batch
nor on whether it is decoded or recomputed in a prefill. Everything else (float16 caches, half-precision
queries, CUDA, the kernel not built) runs ``kernels.paged_attention`` / ``kernels.cross_attention``.
"""

from __future__ import annotations

import torch

from kernels import cpu_paged_attention
from kernels import cross_attention as reference_cross
from kernels import paged_attention as reference
from kernels.attention_backends.base import AttentionBackend


class TorchAttentionBackend(AttentionBackend):
    """Plain torch and the optional C kernel; runs on any device (see the module docstring)."""

    name = "torch"

    def prepare(self, md) -> None:
        """Builds the step's ``query_rows`` (self: causal over ``seq_lens``; cross: over ``encoder_lens``) into
        ``md.step_cache`` when the C kernel is built, the metadata is on the CPU and a sequence has several queries.

        The reference's masks and T5 bias also depend on the layer's ``position_bias`` and query dtype: the first
        layer builds them (``kernels.paged_attention``'s ``step_cache``) and the others reuse them.
        """
        qsl = md.query_start_loc
        if qsl.device.type != "cpu" or not cpu_paged_attention.is_available():
            return
        t = int(qsl[-1])
        if t == 0 or (md.max_query_len == 1 and t == md.num_seqs):  # a decode step: one kernel row per sequence
            return
        _query_rows(md.step_cache, md.block_tables, md.seq_lens, qsl, True, t)
        _query_rows(md.step_cache, md.cross_block_tables, md.encoder_lens, qsl, False, t)

    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        max_query_len: int | None = None,
        max_context_len: int | None = None,
        position_bias: torch.Tensor | None = None,
        step_cache: dict | None = None,
    ) -> torch.Tensor:
        """``kernels.paged_attention.paged_attention``: the C kernel where ``cpu_paged_attention.applies`` (a float32
        query, float32 or bfloat16 CPU caches), else the reference.

        Raises:
            ValueError: what the kernel or the reference raises (shapes, lengths, block ids).
        """
        if cpu_paged_attention.applies(query, k_cache, v_cache):
            tables, lens = block_tables, context_lens
            if not (max_query_len == 1 and query.shape[0] == block_tables.shape[0]):  # several queries a sequence
                tables, lens = _query_rows(
                    step_cache, block_tables, context_lens, query_start_loc, causal, query.shape[0]
                )
            return cpu_paged_attention.paged_decode_attention(
                query, k_cache, v_cache, tables, lens, scale, position_bias
            )
        return reference.paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            query_start_loc,
            causal,
            scale,
            max_query_len,
            max_context_len,
            position_bias,
            step_cache,
        )

    def contiguous_cross_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: list[tuple[int, int, int, int]],
        scale: float,
    ) -> torch.Tensor:
        """``kernels.cross_attention.contiguous_cross_attention`` itself."""
        return reference_cross.contiguous_cross_attention(query, k_cache, v_cache, spans, scale)

    def reads_blocks_in_place(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether ``paged_attention`` runs this call on the C kernel (``kernels.cpu_paged_attention``).

        It reads the blocks in place, one row per query, so ``cross`` takes it over ``contiguous_cross_attention``
        then: faster for Whisper's 16 x 1500 cross keys on a decode step, and a prefill's rows get the decode
        step's numbers (batch invariance). The cross-attention call alone of a 16 x 4-token Whisper prefill is
        slower than the contiguous SDPA, but the whole prefill step got faster (its self-attention left the gather
        + SDPA). Measured: docs/benchmarks.md, Measurements formerly in docstrings.
        """
        return cpu_paged_attention.applies(query, k_cache, v_cache)


def _query_rows(
    step_cache: dict | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    causal: bool,
    t: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.cpu_paged_attention.query_rows`` of these ``t`` queries, kept in ``step_cache`` (if given) for the
    step's other layers: keyed by the query count, ``causal`` and the identity of the three index tensors."""
    key = ("query_rows", t, causal, id(block_tables), id(context_lens), id(query_start_loc))
    entry = step_cache.get(key) if step_cache is not None else None
    if entry is None:  # the entry keeps its inputs alive: their ids cannot be reused within the step
        entry = (
            cpu_paged_attention.query_rows(block_tables, context_lens, query_start_loc, causal),
            (block_tables, context_lens, query_start_loc),
        )
        if step_cache is not None:
            step_cache[key] = entry
    return entry[0]
