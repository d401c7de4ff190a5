"""Loads the optional C kernels of ``kernels/csrc`` (built by setup.py as ``kernels/_<name>*.so``).

Plain C libraries opened with ctypes (no Python API); each exports a
``<name>_supported()`` that says whether this CPU runs its code (AVX2/FMA).
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable


def load_library(name: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """``kernels/_<name>*.so`` with its functions declared, or None.

    None when no such file was built (no C compiler at install time, or not
    x86-64 Linux), it cannot be opened, or its ``<name>_supported()`` returns 0.
    """
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), f"_{name}*.so"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        supported = getattr(lib, f"{name}_supported")
        supported.restype = ctypes.c_int
        declare(lib)
        return lib if supported() else None
    return None
