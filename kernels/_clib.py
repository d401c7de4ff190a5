"""Loads the optional C kernels of ``kernels/csrc`` (built by setup.py as ``kernels/_cpu_kernels*.so``).

One plain C library (no Python API) opened with ctypes: ``packed_linear``,
``paged_decode_attention``, ``argmax``, ``row_norm`` and the worker pool they
share (``parallel.h``).
Each kernel exports a ``<kernel>_supported()`` that says whether this CPU runs
its code (AVX2/FMA).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from collections.abc import Callable
from functools import lru_cache

ABI_VERSION = 5  # ENCDEC_KERNELS_ABI of kernels/csrc/parallel.h: the C signatures the wrappers declare

log = logging.getLogger(__name__)


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
    """
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
