"""CPU decode-step products with a pre-packed weight (``kernels/csrc/packed_linear.c``).

A decode step multiplies a few rows (one per running sequence) by the
``[vocab_size, d_model]`` output projection. MKL's sgemm re-packs that weight
on every call before computing, so a few-row product (Whisper tiny's
``[51864, 384]`` at 16 rows) took well over the time of reading the 80 MB
weight once plus the math. ``PackedWeight`` packs it once into
16-feature panels (k-major) and ``packed_linear`` streams it once per step
(measured against ``shared.models.linear``, ms per product: docs/benchmarks.md,
Measurements formerly in docstrings).

The decoder layers' products of a decode step use it too (``shared.models.linear``:
``Linear.pack``, ``pack_fused`` for self-attention q/k/v; measured in the same
section); no per-call transposes either.
Prefills of the decoder run it as well (any row count, ``MAX_ROWS`` rows per
kernel call): a row's sums do not depend on the other rows, so a token gets
the same numbers in a prefill, a batch or alone (batch invariance).

The torch reference is ``F.linear`` (``reference_linear``);
tests/kernels/test_packed_linear.py compares the two on irregular shapes. Results
differ from it by float32 rounding only (one running sum per output).

The C library is built by ``pip install`` (setup.py, x86-64 only); where it
is missing or the CPU lacks AVX2/FMA, ``is_available()`` is False and callers
keep ``F.linear``. Inference only: outputs carry no autograd graph.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._clib import CKernel

__all__ = ["ACTIVATIONS", "MAX_ROWS", "PackedWeight", "activate", "is_available", "packed_linear", "reference_linear"]

MAX_ROWS = 64  # rows per kernel call: a larger input runs in chunks of MAX_ROWS rows (the chunk's x stays in cache)
_UNAVAILABLE = (
    "the packed_linear kernel is not available: kernels/_cpu_kernels*.so was not built (no C compiler "
    "when the package was installed, or not x86-64 Linux) or this CPU lacks AVX2/FMA"
)


def _declare(lib: ctypes.CDLL) -> None:
    size_t, ptr = ctypes.c_size_t, ctypes.c_void_p
    lib.packed_linear_packed_size.argtypes = [size_t, size_t]
    lib.packed_linear_packed_size.restype = size_t
    lib.packed_linear_pack.argtypes = [ptr, ptr, size_t, size_t]
    lib.packed_linear_pack.restype = None
    lib.packed_linear.argtypes = [ptr, ptr, ptr, ptr, ptr, size_t, size_t, size_t, ctypes.c_int, ctypes.c_int]
    lib.packed_linear.restype = ctypes.c_int
    lib.packed_linear_isa.restype = ctypes.c_int
    lib.packed_linear_set_isa.argtypes = [ctypes.c_int]
    lib.packed_linear_set_isa.restype = ctypes.c_int


_KERNEL = CKernel("packed_linear", _declare)
_library = _KERNEL.library
is_available = _KERNEL.is_available

ISAS = {"avx2": 1, "avx512": 2}  # the micro-kernel's instruction sets (kernels/csrc/packed_linear.c ISA_*)


def isa() -> str | None:
    """The instruction set the micro-kernel runs on this CPU (``avx2`` or ``avx512``; the best present is chosen at
    load), None when the kernel is not available."""
    if not is_available():
        return None
    code = _library().packed_linear_isa()
    return next((name for name, value in ISAS.items() if value == code), None)


def use_isa(name: str | None) -> str:
    """Runs the micro-kernel on ``name`` (``avx2``, ``avx512``; None: the best this CPU has) from now on, in this
    process; both give bit-identical results (the tests compare each with ``F.linear`` and with each other).

    Returns:
        The instruction set now in use.

    Raises:
        RuntimeError: the kernel is not available.
        ValueError: an unknown name, or one this CPU lacks (the message says which it has).
    """
    if not is_available():
        raise RuntimeError(_UNAVAILABLE)
    if name is not None and name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}; choose from {', '.join(ISAS)}")
    if _library().packed_linear_set_isa(0 if name is None else ISAS[name]) < 0:
        raise ValueError(f"this CPU cannot run the {name} micro-kernel (best available: {_best_isa()})")
    return isa()


def _best_isa() -> str:
    current = _library().packed_linear_isa()
    _library().packed_linear_set_isa(0)
    best = isa()
    _library().packed_linear_set_isa(current)
    return best


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` float32 weight packed for ``packed_linear``.

    ``data`` holds ``ceil(out_features / 16) * 16 * in_features`` floats: a
    second copy of the weight (e.g. +80 MB for Whisper tiny's projection).
    """

    data: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        """Raises ValueError unless ``data`` is a contiguous float32 CPU tensor of the packed size (the kernel trusts it)."""
        size = -(-self.out_features // 16) * 16 * self.in_features
        if (
            self.out_features < 0
            or self.in_features < 0
            or self.data.dtype != torch.float32
            or self.data.device.type != "cpu"
            or not self.data.is_contiguous()
            or self.data.numel() != size
        ):
            raise ValueError(
                f"PackedWeight data must be {size} contiguous float32 CPU values for a [{self.out_features}, "
                f"{self.in_features}] weight; build it with PackedWeight.pack"
            )

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        """Packs a contiguous-or-not ``[N, K]`` float32 CPU weight.

        Raises:
            RuntimeError: the kernel is not available (see ``is_available``).
            ValueError: ``weight`` is not a 2-D float32 CPU tensor.
        """
        lib = _library()
        if lib is None:
            raise RuntimeError(_UNAVAILABLE)
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(
                f"PackedWeight.pack takes a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
            )
        n, k = weight.shape
        w = weight.detach().contiguous()
        data = torch.empty(lib.packed_linear_packed_size(n, k), dtype=torch.float32)
        lib.packed_linear_pack(w.data_ptr(), data.data_ptr(), n, k)
        return cls(data, n, k)


ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2}
"""Activations ``packed_linear`` applies in its epilogue, after the bias: ``relu`` (``torch.relu``) and ``gelu``
(``F.gelu``, the exact erf form; erf per Abramowitz & Stegun 7.1.26 as ATen's AVX2 vectorized float erf, |error| <= 1.5e-7;
within 2.3e-7 of the float64 GELU, closer than ATen's AVX-512 kernel at the tails: see ``kernels/csrc/simd_math.h``)."""


def packed_linear(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
    num_threads: int | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + act(F.linear(x, W, bias))`` for the weight ``W`` that ``weight`` packs.

    Args:
        x: ``[..., in_features]`` float32 CPU; any row count (``MAX_ROWS`` rows per kernel call). Each row's
            outputs are one running sum over ``in_features`` in a fixed order, so a row's result does not depend
            on the other rows (a prefill's rows equal the same rows in decode steps, bit for bit).
        weight: the packed ``[out_features, in_features]`` weight.
        bias: ``[out_features]`` float32 or None.
        num_threads: threads to split the output features over (default
            ``torch.get_num_threads()``).
        activation: None, ``relu`` or ``gelu`` (``ACTIVATIONS``), applied to
            each output as it is stored (no second pass over the output).
        residual: None, or ``[..., out_features]`` float32 CPU (the shape of
            the result) added after the activation: a transformer layer's
            residual connection without a separate add (bit-identical to
            ``residual + packed_linear(x, ...)``: one float32 rounding).

    Returns:
        ``[..., out_features]`` float32, contiguous.

    Raises:
        RuntimeError: the kernel is not available (see ``is_available``).
        ValueError: wrong dtype, device, feature count, an activation not in ``ACTIVATIONS`` or a residual of another shape.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError(_UNAVAILABLE)
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"packed_linear activation must be one of {sorted(a for a in ACTIVATIONS if a)} or None, got {activation!r}"
        )
    if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != weight.in_features:
        raise ValueError(
            f"packed_linear takes float32 CPU [..., {weight.in_features}] input, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    rows = x.numel() // weight.in_features if weight.in_features else x.shape[:-1].numel()
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.out_features,)):
        raise ValueError(f"bias must be float32 [{weight.out_features}], got {bias.dtype} {tuple(bias.shape)}")
    out_shape = (*x.shape[:-1], weight.out_features)
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_cpu or residual.shape != out_shape):
        raise ValueError(
            f"residual must be float32 CPU {list(out_shape)}, got {residual.dtype} {tuple(residual.shape)} on {residual.device}"
        )
    if weight.in_features == 0:  # empty sums: the bias alone, as F.linear
        out = activate(torch.zeros(out_shape) + (bias if bias is not None else 0.0), activation)
        return out + residual if residual is not None else out
    x2 = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(out_shape, dtype=torch.float32)
    b = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    r = residual if residual is None or residual.is_contiguous() else residual.contiguous()
    k, n, threads = weight.in_features, weight.out_features, num_threads or torch.get_num_threads()
    for r0 in range(0, rows, MAX_ROWS):  # float32 offsets into the contiguous [rows, k] / [rows, n] operands
        m = min(MAX_ROWS, rows - r0)
        lib.packed_linear(
            x2.data_ptr() + 4 * r0 * k,
            weight.data.data_ptr(),
            b.data_ptr() if b is not None else None,
            r.data_ptr() + 4 * r0 * n if r is not None else None,
            out.data_ptr() + 4 * r0 * n,
            m,
            n,
            k,
            threads,
            ACTIVATIONS[activation],
        )
    return out


_ACTIVATION_FNS = {None: lambda y: y, "relu": torch.relu, "gelu": F.gelu}


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The torch reference of the epilogue: ``activation`` (a key of ``ACTIVATIONS``) applied to ``y``."""
    return _ACTIVATION_FNS[activation](y)


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """The torch reference of ``packed_linear``: ``F.linear`` on the unpacked weight, then the activation."""
    return activate(F.linear(x, weight, bias), activation)
