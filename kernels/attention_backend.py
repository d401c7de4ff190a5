"""The attention backend registry: ``torch`` (default) or ``triton``, chosen once per model runner by name.

``make_attention_backend(name, device)`` checks that the backend runs here and returns the object the models'
layers call through the step's metadata (``kernels.attention_backends.base.AttentionBackend``: ``prepare`` once
per step, ``write_kv`` / ``paged`` / ``cross`` per layer). A ``flash_attn`` backend would be one more class in
``kernels/attention_backends/`` and one more entry here.

``paged_attention`` / ``write_kv`` / ``contiguous_cross_attention`` below run one call by backend name, with the
arguments and results of the torch references (``kernels.paged_attention``, ``kernels.cross_attention``): for
tests and scripts; model code calls the metadata's backend object.
"""

from __future__ import annotations

import torch

from kernels.attention_backends.base import AttentionBackend
from kernels.attention_backends.torch_backend import TorchAttentionBackend
from kernels.attention_backends.triton_backend import TritonAttentionBackend

_REGISTRY: dict[str, type[AttentionBackend]] = {b.name: b for b in (TorchAttentionBackend, TritonAttentionBackend)}
ATTENTION_BACKENDS = tuple(_REGISTRY)


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name not in _REGISTRY:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    return _REGISTRY[name]


def check_attention_backend(backend: str, device: torch.device | str | None = None) -> None:
    """Checks that ``backend`` can run on this machine (and on ``device``, the KV cache's, if given).

    Raises:
        ValueError: unknown name; or ``triton`` without the triton package, or
            with neither a CUDA device nor ``TRITON_INTERPRET=1`` (the CPU
            interpreter, for tests only: it is orders of magnitude slower), or
            with a non-CUDA ``device`` outside the interpreter.
    """
    backend_class(backend).check(device)


def make_attention_backend(backend: str, device: torch.device | str | None = None) -> AttentionBackend:
    """The backend ``backend`` for KV caches on ``device``, checked as ``check_attention_backend`` does.

    Raises:
        ValueError: as ``check_attention_backend``.
    """
    return backend_class(backend)(device)


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
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """``kernels.paged_attention.paged_attention`` run by ``backend`` (its ``paged_attention``).

    Raises:
        ValueError: unknown or unavailable backend (or what the implementation raises).
    """
    return make_attention_backend(backend).paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        causal=causal,
        scale=scale,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        position_bias=position_bias,
        step_cache=step_cache,
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``kernels.paged_attention.write_kv`` (same arguments) as every backend writes: the C scatter for float32 or
    bfloat16 CPU caches and float32 keys / values (a fraction of the reference's time: docs/benchmarks.md,
    Measurements formerly in docstrings), else the torch reference."""
    TorchAttentionBackend().write_slots(k_cache, v_cache, key, value, slot_mapping)


def contiguous_cross_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    scale: float,
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """``kernels.cross_attention.contiguous_cross_attention`` run by ``backend``.

    Raises:
        ValueError: unknown or unavailable backend.
    """
    return make_attention_backend(backend).contiguous_cross_attention(query, k_cache, v_cache, spans, scale)
