"""Backend ``triton``: the kernels of ``kernels.triton_paged_attention``, reading K/V blocks in place on a GPU.

The Triton module is imported on the first call, so nothing imports triton unless this backend runs (and
``TRITON_INTERPRET=1``, the CPU interpreter for tests, can still be set before that). The kernels build no masks
and need no per-step plan: ``prepare`` does nothing and ``step_cache`` is not read.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels.attention_backends.base import AttentionBackend


def interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels (one program per query token and head; see ``kernels.triton_paged_attention``)."""

    name = "triton"

    @classmethod
    def check(cls, device: torch.device | str | None = None) -> None:
        """Raises ValueError: without the triton package; with neither a CUDA device nor ``TRITON_INTERPRET=1``
        (the CPU interpreter, for tests only: it is orders of magnitude slower); or with a non-CUDA ``device``
        outside the interpreter."""
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention_backend 'triton' needs the triton package: pip install 'encdec-serve[gpu]' "
                "(or triton==3.9.0), or use attention_backend 'torch'"
            )
        if not torch.cuda.is_available() and not interpret():
            raise ValueError(
                "attention_backend 'triton' needs a CUDA device (none is visible); on CPU set "
                "TRITON_INTERPRET=1 (tests only, very slow) or use attention_backend 'torch'"
            )
        if device is not None and torch.device(device).type != "cuda" and not interpret():
            raise ValueError(
                f"attention_backend 'triton' runs on CUDA tensors but the KV cache is on {device}; "
                "put the model and KV cache on the GPU or use attention_backend 'torch'"
            )

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
        """``kernels.triton_paged_attention.paged_attention`` (``step_cache`` unused).

        Raises:
            ValueError: ``position_bias`` with ``causal=False``, or tensors off CUDA outside the interpreter.
        """
        return _kernels().paged_attention(
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
        )

    def contiguous_cross_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spans: list[tuple[int, int, int, int]],
        scale: float,
    ) -> torch.Tensor:
        """``kernels.triton_paged_attention.contiguous_cross_attention``."""
        return _kernels().contiguous_cross_attention(query, k_cache, v_cache, spans, scale)


def _kernels():
    from kernels import triton_paged_attention  # imported lazily: triton is an optional extra

    return triton_paged_attention
