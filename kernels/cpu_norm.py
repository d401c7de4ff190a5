"""Row normalizations on CPU (``kernels/csrc/row_norm.c``): T5's RMS norm and LayerNorm.

A decode step normalizes a few rows (``[32, 512]`` for t5-small at batch
32) about 19 times. torch 2.13 is slow on each there (its reductions open an
OpenMP region even for 16k floats, and on 2 cores shared with the packed
kernels' workers that wake-up is most of the cost); the C kernel opens none
and splits only large inputs over threads (measured: docs/benchmarks.md,
Measurements formerly in docstrings).

``rms_norm`` / ``layer_norm`` take the C path for float32 CPU inputs with
float32 CPU parameters (any shape, made contiguous) and otherwise call their
torch references, ``reference_rms_norm`` (HF's ``T5LayerNorm``: variance in
float32, no mean subtraction, no bias) and ``F.layer_norm``.
tests/kernels/test_cpu_norm.py compares the two. Inference only: no autograd graph.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels._clib import CKernel

__all__ = ["is_available", "layer_norm", "reference_rms_norm", "rms_norm"]


def _declare(lib: ctypes.CDLL) -> None:
    size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
    lib.row_norm.argtypes = [ptr, ptr, ptr, ptr, size_t, size_t, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.row_norm.restype = ctypes.c_int


_KERNEL = CKernel("row_norm", _declare)
_library = _KERNEL.library
is_available = _KERNEL.is_available


def _serves(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    f32 = torch.float32
    if x.dtype != f32 or not x.is_cpu or x.dim() == 0 or (x.requires_grad and torch.is_grad_enabled()):
        return False
    d = x.shape[-1]
    return (weight is None or (weight.dtype == f32 and weight.is_cpu and weight.shape == (d,))) and (
        bias is None or (bias.dtype == f32 and bias.is_cpu and bias.shape == (d,))
    )


def _run(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool
) -> torch.Tensor:
    # Named locals: a strided weight's contiguous copy must outlive the C call (a temporary in the
    # argument list is freed once its data_ptr() is taken, and the kernel would read freed memory).
    x = x.contiguous()
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    out = torch.empty_like(x)
    d = x.shape[-1]
    _library().row_norm(
        x.data_ptr(),
        w.data_ptr() if w is not None else None,
        b.data_ptr() if b is not None else None,
        out.data_ptr(),
        x.numel() // d if d else 0,
        d,
        eps,
        int(rms),
        torch.get_num_threads(),
    )
    return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF ``T5LayerNorm``: ``weight * x / sqrt(mean(x^2, -1) + eps)``, the variance in float32; output in weight's dtype."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    y = x.float() * torch.rsqrt(var + eps)
    return weight * y.to(weight.dtype) if weight is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS norm over the last dim (``reference_rms_norm``).

    Args:
        x: ``[..., d]``.
        weight: ``[d]`` or None (no scale).
        eps: added to the mean square (T5: 1e-6).

    Returns:
        ``[..., d]``, a new contiguous tensor.
    """
    if _library() is None or not _serves(x, weight, None):
        return reference_rms_norm(x, weight, eps)
    return _run(x, weight, None, eps, True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``F.layer_norm(x, (d,), weight, bias, eps)`` over the last dim (biased variance).

    Args:
        x: ``[..., d]``.
        weight, bias: ``[d]`` or None.
        eps: added to the variance.

    Returns:
        ``[..., d]``, a new contiguous tensor.
    """
    if _library() is None or not _serves(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _run(x, weight, bias, eps, False)
