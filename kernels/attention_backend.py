"""The ``attention_backend`` switch: plain torch (default) or the Triton kernels.

Model call sites call ``paged_attention`` / ``contiguous_cross_attention`` from
here with ``backend=md.attention_backend``; arguments and results are those of
the torch references (``kernels.paged_attention``, ``kernels.cross_attention``)
whichever backend runs. The Triton module is imported on first use, so the
torch backend never needs triton installed.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels import cpu_paged_attention as _cpu_decode
from kernels import cross_attention as _torch_cross
from kernels import paged_attention as _torch_paged

ATTENTION_BACKENDS = ("torch", "triton")


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_attention_backend(backend: str, device: torch.device | str | None = None) -> None:
    """Checks that ``backend`` can run on this machine (and on ``device``, the KV cache's, if given).

    Raises:
        ValueError: unknown name; or ``triton`` without the triton package, or
            with neither a CUDA device nor ``TRITON_INTERPRET=1`` (the CPU
            interpreter, for tests only: it is orders of magnitude slower), or
            with a non-CUDA ``device`` outside the interpreter.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {backend!r}")
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend 'triton' needs the triton package: pip install 'encdec-serve[gpu]' "
                             "(or triton==3.9.0), or use attention_backend 'torch'")
        if not torch.cuda.is_available() and not _interpret():
            raise ValueError("attention_backend 'triton' needs a CUDA device (none is visible); on CPU set "
                             "TRITON_INTERPRET=1 (tests only, very slow) or use attention_backend 'torch'")
        if device is not None and torch.device(device).type != "cuda" and not _interpret():
            raise ValueError(f"attention_backend 'triton' runs on CUDA tensors but the KV cache is on {device}; "
                             "put the model and KV cache on the GPU or use attention_backend 'torch'")


def _module(backend: str):
    if backend == "torch":
        return _torch_paged, _torch_cross
    if backend == "triton":
        from kernels import triton_paged_attention  # imported lazily: triton is an optional extra

        return triton_paged_attention, triton_paged_attention
    raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {backend!r}")


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: torch.Tensor, *args, backend: str = "torch",
                    **kwargs) -> torch.Tensor:
    """``kernels.paged_attention.paged_attention`` run by ``backend`` (``torch`` or ``triton``).

    Backend ``torch``: float32 CPU caches run the C kernel
    ``kernels.cpu_paged_attention`` where it is built (blocks read in place,
    ~10x faster than the reference's gather + SDPA on a decode step), one
    kernel row per query (``query_rows``, kept in ``step_cache`` for the
    step's other layers) when a sequence has several: each query is computed
    as in a decode step, so a token's result does not depend on the rest of
    the batch nor on whether it is decoded or recomputed in a prefill.
    Everything else runs the torch reference. ``step_cache`` is used by the
    torch path only; the Triton kernel builds no masks and does not take it.

    Raises:
        ValueError: unknown backend (or what the implementation raises).
    """
    if backend == "torch":
        if not args and "scale" in kwargs and "causal" in kwargs and _cpu_decode.applies(query, k_cache, v_cache):
            tables, lens = block_tables, context_lens
            if not (kwargs.get("max_query_len") == 1 and query.shape[0] == block_tables.shape[0]):  # several queries a sequence
                cache = kwargs.get("step_cache")
                key = ("query_rows", query.shape[0], kwargs["causal"], id(block_tables), id(context_lens), id(query_start_loc))
                entry = cache.get(key) if cache is not None else None
                if entry is None:  # the entry keeps its inputs alive: their ids cannot be reused within the step
                    entry = (_cpu_decode.query_rows(block_tables, context_lens, query_start_loc, kwargs["causal"]),
                             (block_tables, context_lens, query_start_loc))
                    if cache is not None:
                        cache[key] = entry
                tables, lens = entry[0]
            return _cpu_decode.paged_decode_attention(query, k_cache, v_cache, tables, lens, kwargs["scale"],
                                                      kwargs.get("position_bias"))
    else:
        kwargs.pop("step_cache", None)
    return _module(backend)[0].paged_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, *args,
                                               **kwargs)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``kernels.paged_attention.write_kv`` (same arguments): float32 CPU caches take the C scatter
    (``kernels.cpu_paged_attention.write_kv``, ~10 us instead of ~200 us per layer of a t5-small batch-32 step);
    every other case (half precision, CUDA, the kernel not built) the torch reference."""
    if _cpu_decode.write_applies(k_cache, v_cache, key, value, slot_mapping):
        _cpu_decode.write_kv(k_cache, v_cache, key, value, slot_mapping)
    else:
        _torch_paged.write_kv(k_cache, v_cache, key, value, slot_mapping)


def cpu_decode_kernel_serves(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             backend: str = "torch") -> bool:
    """Whether ``paged_attention`` runs this call on the C kernel (``kernels.cpu_paged_attention``).

    It reads the blocks in place, one row per query, so callers that would otherwise take
    ``contiguous_cross_attention`` should take ``paged_attention`` then: ~2.4x faster for Whisper's 16 x 1500
    cross keys on a decode step (5.6 vs 13.4 ms per layer), and a prefill's rows get the decode step's numbers
    (batch invariance). The cross-attention call alone of a 16 x 4-token Whisper prefill is ~1.6x the contiguous
    SDPA's time, but the whole prefill step went 88-94 -> 66-82 ms (its self-attention left the gather + SDPA).
    """
    return backend == "torch" and _cpu_decode.applies(query, k_cache, v_cache)


def contiguous_cross_attention(*args, backend: str = "torch", **kwargs) -> torch.Tensor:
    """``kernels.cross_attention.contiguous_cross_attention`` run by ``backend``.

    Raises:
        ValueError: unknown backend.
    """
    return _module(backend)[1].contiguous_cross_attention(*args, **kwargs)
