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

bfloat16 weights (``PackedWeight.pack(w, dtype=torch.bfloat16)``, CPUs with
AVX-512 BF16 and no ``ENCDEC_MAX_CPU_ISA`` cap: ``bf16_available()``, the ``avx512_bf16`` flag) halve the bytes a
step streams. The panels hold k in pairs (``wp[p, q, j, h] = bf16(w[16 p + j,
2 q + h])``, K padded to even with a zero); each call rounds its x rows to
bfloat16 once (round to nearest even, as ``x.to(torch.bfloat16)``) and the
``vdpbf16ps`` instruction adds both products of a pair to a float32 sum (exact
products, a running float32 sum over k in a fixed order, so batch invariance
holds as above; denormals count as zero). Input, bias, residual and output stay
float32. Its torch reference is ``F.linear`` on the bfloat16-rounded operands
in float32 (``reference_linear_bf16``): results differ from it by float32
rounding only.

The C library is built by ``pip install`` (setup.py, x86-64 only); where it
is missing or the CPU lacks AVX2/FMA, ``is_available()`` is False and callers
keep ``F.linear``. Inference only: outputs carry no autograd graph.

Over 300 lines: one C kernel's wrapper per file (its ctypes declarations, both weight layouts'
``PackedWeight``, the argument checks, the instruction-set switch and the torch references).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._clib import MAX_CPU_ISA_ENV, MAX_CPU_ISAS, CKernel

__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "MAX_ROWS",
    "PackedWeight",
    "activate",
    "bf16_available",
    "is_available",
    "isas_present",
    "packed_linear",
    "packed_size",
    "reference_linear",
    "reference_linear_bf16",
]

MAX_ROWS = 64  # rows per kernel call: a larger input runs in chunks of MAX_ROWS rows (the chunk's x stays in cache)
_UNAVAILABLE = (
    "the packed_linear kernel is not available: kernels/_cpu_kernels*.so was not built (no C compiler "
    "when the package was installed, or not x86-64 Linux) or this CPU lacks AVX2/FMA"
)
_NO_BF16 = (
    "bfloat16 packed weights need AVX-512 BF16 (the avx512_bf16 flag of /proc/cpuinfo), which this CPU lacks "
    "(or ENCDEC_MAX_CPU_ISA caps it); "
    "pack the weight as float32 instead"
)
DTYPES = (torch.float32, torch.bfloat16)  # weight dtypes PackedWeight packs (the kernels' layouts)


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
    lib.packed_linear_bf16_supported.restype = ctypes.c_int
    lib.packed_linear_bf16_packed_size.argtypes = [size_t, size_t]
    lib.packed_linear_bf16_packed_size.restype = size_t
    for pack in (lib.packed_linear_bf16_pack, lib.packed_linear_bf16_pack_bf16):
        pack.argtypes = [ptr, ptr, size_t, size_t]
        pack.restype = None
    lib.packed_linear_bf16.argtypes = lib.packed_linear.argtypes
    lib.packed_linear_bf16.restype = ctypes.c_int
    lib.encdec_max_isa.restype = ctypes.c_int


_KERNEL = CKernel("packed_linear", _declare)
_library = _KERNEL.library
is_available = _KERNEL.is_available


def bf16_available() -> bool:
    """True if the kernel is available, this CPU has AVX-512 BF16 (``avx512_bf16``) and no ``ENCDEC_MAX_CPU_ISA`` cap
    is set: bfloat16 weights pack."""
    lib = _library()
    return lib is not None and bool(lib.packed_linear_bf16_supported())


ISAS = {"avx2": 1, "avx512": 2}  # the micro-kernel's instruction sets (kernels/csrc/packed_linear.c ISA_*)


def isa() -> str | None:
    """The instruction set the micro-kernel runs on this CPU (``avx2`` or ``avx512``; the best present under the
    ``ENCDEC_MAX_CPU_ISA`` cap is chosen at load), None when the kernel is not available."""
    if not is_available():
        return None
    code = _library().packed_linear_isa()
    return next((name for name, value in ISAS.items() if value == code), None)


def use_isa(name: str | None) -> str:
    """Runs the float32 micro-kernel on ``name`` (``avx2``, ``avx512``; None: the best this CPU has under the
    ``ENCDEC_MAX_CPU_ISA`` cap, see ``kernels._clib``) from now on, in this process; both give bit-identical results
    (the tests compare each with ``F.linear`` and with each other).
    bfloat16 weights have one micro-kernel (AVX-512 BF16), which this does not change.

    Returns:
        The instruction set now in use.

    Raises:
        RuntimeError: the kernel is not available.
        ValueError: an unknown name, one above the ``ENCDEC_MAX_CPU_ISA`` cap, or one this CPU lacks (the message
            says which it has).
    """
    if not is_available():
        raise RuntimeError(_UNAVAILABLE)
    if name is not None and name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}; choose from {', '.join(ISAS)}")
    code = _library().encdec_max_isa()  # the cap the library read when it loaded (-1: a bad value, taken as avx2)
    cap = MAX_CPU_ISAS[code - 1] if code > 0 else ("avx2" if code < 0 else None)
    if name is not None and cap is not None and ISAS[name] > ISAS[cap]:
        raise ValueError(f"the {name} micro-kernel is above the {MAX_CPU_ISA_ENV}={cap} cap of this process")
    if _library().packed_linear_set_isa(0 if name is None else ISAS[name]) < 0:
        raise ValueError(f"this CPU cannot run the {name} micro-kernel (best available: {_best_isa()})")
    return isa()


def isas_present() -> list[str]:
    """The micro-kernel's instruction sets this CPU runs under the ``ENCDEC_MAX_CPU_ISA`` cap, in ``ISAS`` order
    (``[]`` when the kernel is not available); the one in use stays in use."""
    if not is_available():
        return []
    lib = _library()
    current = lib.packed_linear_isa()
    present = [name for name, code in ISAS.items() if lib.packed_linear_set_isa(code) >= 0]
    lib.packed_linear_set_isa(current)
    return present


def _best_isa() -> str:
    current = _library().packed_linear_isa()
    _library().packed_linear_set_isa(0)
    best = isa()
    _library().packed_linear_set_isa(current)
    return best


def packed_size(out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> int:
    """Elements of ``dtype`` in the packed layout of an ``[out_features, in_features]`` weight (``PackedWeight``)."""
    k = in_features + in_features % 2 if dtype == torch.bfloat16 else in_features
    return -(-out_features // 16) * 16 * k


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` weight packed for ``packed_linear``.

    ``dtype`` float32: ``data`` holds ``ceil(out_features / 16) * 16 * in_features`` floats (16-feature panels,
    k-major), a second copy of the weight (e.g. +80 MB for Whisper tiny's projection). ``dtype`` bfloat16:
    ``ceil(out_features / 16) * 16 * in_features'`` bfloat16 values, ``in_features'`` = ``in_features`` rounded up
    to even (the panels hold k in pairs; see the module docstring), half the bytes.
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        """Raises ValueError unless ``dtype`` is in ``DTYPES`` and ``data`` is a contiguous CPU tensor of that dtype
        and the packed size (the kernel trusts it)."""
        if self.dtype not in DTYPES:
            raise ValueError(f"PackedWeight dtype must be torch.float32 or torch.bfloat16, got {self.dtype}")
        size = packed_size(self.out_features, self.in_features, self.dtype)
        if (
            self.out_features < 0
            or self.in_features < 0
            or self.data.dtype != self.dtype
            or self.data.device.type != "cpu"
            or not self.data.is_contiguous()
            or self.data.numel() != size
        ):
            raise ValueError(
                f"PackedWeight data must be {size} contiguous {self.dtype} CPU values for a [{self.out_features}, "
                f"{self.in_features}] weight; build it with PackedWeight.pack"
            )

    @classmethod
    def pack(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> PackedWeight:
        """Packs a contiguous-or-not ``[N, K]`` float32 or bfloat16 CPU weight into the layout of ``dtype``.

        ``dtype`` bfloat16 rounds a float32 weight to nearest even (as ``weight.to(torch.bfloat16)``; NaN stays NaN)
        and copies a bfloat16 one; float32 from bfloat16 is exact.

        Raises:
            RuntimeError: the kernel is not available (see ``is_available``), or ``dtype`` is bfloat16 and this CPU
                lacks AVX-512 BF16 (the ``avx512_bf16`` flag; see ``bf16_available``).
            ValueError: ``weight`` is not a 2-D float32 or bfloat16 CPU tensor, or ``dtype`` is not in ``DTYPES``.
        """
        lib = _library()
        if lib is None:
            raise RuntimeError(_UNAVAILABLE)
        if dtype not in DTYPES:
            raise ValueError(f"PackedWeight.pack packs torch.float32 or torch.bfloat16 weights, got dtype={dtype}")
        if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
            raise ValueError(
                f"PackedWeight.pack takes a 2-D float32 CPU weight or a bfloat16 one, got {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}"
            )
        n, k = weight.shape
        w = weight.detach().contiguous()
        if dtype == torch.float32:
            w = w.float()
            data = torch.empty(lib.packed_linear_packed_size(n, k), dtype=torch.float32)
            lib.packed_linear_pack(w.data_ptr(), data.data_ptr(), n, k)
            return cls(data, n, k)
        if not lib.packed_linear_bf16_supported():
            raise RuntimeError(_NO_BF16)
        data = torch.empty(lib.packed_linear_bf16_packed_size(n, k), dtype=torch.bfloat16)
        pack = lib.packed_linear_bf16_pack if w.dtype == torch.float32 else lib.packed_linear_bf16_pack_bf16
        pack(w.data_ptr(), data.data_ptr(), n, k)
        return cls(data, n, k, torch.bfloat16)


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
        weight: the packed ``[out_features, in_features]`` weight: float32, or bfloat16 (``x`` is then rounded to
            bfloat16 in the kernel and the products summed in float32; see the module docstring).
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
        RuntimeError: the kernel is not available (see ``is_available``), or ``weight`` is bfloat16 and this CPU
            lacks AVX-512 BF16 (``avx512_bf16``).
        MemoryError: no memory for the bfloat16 copy of a chunk of ``x`` (bfloat16 weights).
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
    bf16 = weight.dtype == torch.bfloat16
    if bf16 and not lib.packed_linear_bf16_supported():
        raise RuntimeError(_NO_BF16)
    kernel = lib.packed_linear_bf16 if bf16 else lib.packed_linear
    for r0 in range(0, rows, MAX_ROWS):  # float32 offsets into the contiguous [rows, k] / [rows, n] operands
        m = min(MAX_ROWS, rows - r0)
        rc = kernel(
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
        if rc == -4:  # nothing computed; -1 (a worker thread did not start) still computed everything
            raise MemoryError(f"packed_linear: no memory for the bfloat16 copy of {m} rows of x")
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


def reference_linear_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """The torch reference of ``packed_linear`` with a bfloat16 ``PackedWeight``: ``F.linear`` in float32 on ``x``
    and ``weight`` (float32 or bfloat16 ``[out, in]``) rounded to bfloat16, float32 ``bias``, then the activation."""
    return activate(F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias), activation)
