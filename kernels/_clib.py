"""Loads the optional C kernels of ``kernels/csrc`` (built by setup.py as ``kernels/_cpu_kernels*.so``).

One plain C library (no Python API) opened with ctypes: ``packed_linear``,
``paged_decode_attention``, ``argmax``, ``row_norm`` and the worker pool they
share (``parallel.h``).
Each kernel exports a ``<kernel>_supported()`` that says whether this CPU runs
its code (AVX2/FMA).

``ENCDEC_MAX_CPU_ISA`` (``avx2`` or ``avx512``; unset: none) caps every kernel of the library, process-wide, read
once when it loads (``encdec_max_isa`` in ``kernels/csrc/parallel.h``): under ``avx2`` packed_linear's micro-kernel
is the AVX2/FMA one (``packed_linear.use_isa("avx512")`` is refused, ``calibration.calibrate_packed_isa`` has one
candidate) and bfloat16 weights (AVX-512 BF16) are off, as are the services' ``--dtype bfloat16`` on the CPU
(``shared.device.cpu_bf16_flags``); under ``avx512`` only bfloat16 weights are off. The other kernels (paged decode
attention, argmax, row norm) are AVX2/FMA only. It caps our kernels alone: torch's ATen, MKL, oneDNN and
CTranslate2 take ``ATEN_CPU_CAPABILITY`` / ``MKL_ENABLE_INSTRUCTIONS`` / ``ONEDNN_MAX_CPU_ISA`` /
``CT2_FORCE_CPU_ISA``, which must be set before the process starts (``isa_cap_environment`` gives all five;
``encdec bench --cpu-isa`` sets them).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from collections.abc import Callable
from functools import lru_cache

ABI_VERSION = 6  # ENCDEC_KERNELS_ABI of kernels/csrc/parallel.h: the C signatures the wrappers declare

log = logging.getLogger(__name__)

MAX_CPU_ISA_ENV = "ENCDEC_MAX_CPU_ISA"
MAX_CPU_ISAS = ("avx2", "avx512")  # its values, lowest first (ENCDEC_ISA_* of kernels/csrc/parallel.h: 1, 2)
# Each cap's variables for the other libraries: torch's ATen dispatch, MKL, oneDNN (torch's), CTranslate2.
_LIBRARY_CAPS = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "CT2_FORCE_CPU_ISA": "AVX512",
    },
}


def max_cpu_isa(environ: dict[str, str] | None = None) -> str | None:
    """The cap ``ENCDEC_MAX_CPU_ISA`` sets (``avx2``, ``avx512``; lower-cased), None when unset or empty.

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: another value (the C kernels would treat it as ``avx2``).
    """
    value = (os.environ if environ is None else environ).get(MAX_CPU_ISA_ENV, "").lower()
    if value and value not in MAX_CPU_ISAS:
        raise ValueError(f"{MAX_CPU_ISA_ENV} must be one of {', '.join(MAX_CPU_ISAS)} (or unset), got {value!r}")
    return value or None


def isa_cap_environment(isa: str) -> dict[str, str]:
    """The variables that cap our kernels (``ENCDEC_MAX_CPU_ISA``), torch's ATen dispatch, MKL, oneDNN and
    CTranslate2 to ``isa`` (``avx2`` or ``avx512``: AVX-512 without VNNI / BF16 / AMX), to set before a process
    starts (each library reads its variable once, at its first use).

    Raises:
        ValueError: ``isa`` is not in ``MAX_CPU_ISAS``.
    """
    if isa not in MAX_CPU_ISAS:
        raise ValueError(f"CPU instruction-set cap must be one of {', '.join(MAX_CPU_ISAS)}, got {isa!r}")
    return {MAX_CPU_ISA_ENV: isa, **_LIBRARY_CAPS[isa]}


@lru_cache(maxsize=1)
def _open() -> ctypes.CDLL | None:
    return open_first(sorted(glob.glob(os.path.join(os.path.dirname(__file__), "_cpu_kernels*.so"))))


def open_first(paths: list[str]) -> ctypes.CDLL | None:
    """The first of ``paths`` that opens and reports ``ABI_VERSION`` (``encdec_kernels_abi()``), or None."""
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        abi = getattr(lib, "encdec_kernels_abi", None)
        found = abi() if abi is not None else 1
        if found == ABI_VERSION:
            return lib
        log.warning(
            "%s was built from other kernel sources (C signatures version %d, these wrappers need %d): "
            "torch runs instead; rebuild it with `pip install -e .` or `python setup.py build_ext --inplace`",
            path,
            found,
            ABI_VERSION,
        )
    return None


def load_library(kernel: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The library with ``kernel``'s functions declared (``declare``), or None.

    None when it was not built (no C compiler at install time, or not x86-64
    Linux), cannot be opened, or ``<kernel>_supported()`` returns 0.

    Raises:
        ValueError: ``ENCDEC_MAX_CPU_ISA`` has a value other than ``avx2`` / ``avx512`` (``max_cpu_isa``).
    """
    max_cpu_isa()  # a misspelt cap fails here, where the kernels load, not silently as avx2
    lib = _open()
    if lib is None:
        return None
    supported = getattr(lib, f"{kernel}_supported")
    supported.restype = ctypes.c_int
    declare(lib)
    return lib if supported() else None


class CKernel:
    """One kernel's handle on the library: ``library()`` with its functions declared, and ``is_available()``.

    Each ``kernels/cpu_*.py`` wrapper makes one at import (nothing is opened until the
    first call) instead of its own cached loader.

    Args:
        kernel: the name before ``_supported`` in the library (``argmax``, ``row_norm``...).
        declare: sets ``argtypes`` / ``restype`` of the kernel's functions on the library.
    """

    def __init__(self, kernel: str, declare: Callable[[ctypes.CDLL], None]) -> None:
        self._kernel = kernel
        self._declare = declare
        self._loaded = False
        self._lib: ctypes.CDLL | None = None

    def library(self) -> ctypes.CDLL | None:
        """The library (loaded once; see ``load_library``), or None where it cannot run here."""
        if not self._loaded:
            self._lib = load_library(self._kernel, self._declare)
            self._loaded = True
        return self._lib

    def is_available(self) -> bool:
        """True if the compiled kernel is installed and this CPU has AVX2 and FMA."""
        return self.library() is not None
