"""Row-wise argmax on CPU (``kernels/csrc/argmax.c``): greedy decoding's token pick.

torch 2.13's CPU ``argmax`` does not vectorize (its ``amax`` does), which is a
visible cost of a greedy decode step. ``argmax_rows`` gives ``torch.argmax(x, dim=-1)``'s answer (first index
of the maximum; of the first NaN if a row has one) in a fraction of its time
(measured: docs/benchmarks.md, Measurements formerly in docstrings). Its torch
reference is ``torch.argmax``; tests/kernels/test_cpu_argmax.py compares the two.
Where the C library is not built, ``argmax_rows`` calls the reference.
"""

from __future__ import annotations

import ctypes

import torch

from kernels._clib import CKernel

__all__ = ["argmax_rows", "is_available"]


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.argmax_rows.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.argmax_rows.restype = ctypes.c_int


_KERNEL = CKernel("argmax", _declare)
_library = _KERNEL.library
is_available = _KERNEL.is_available


def argmax_rows(x: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for ``[N, V]`` logits: ``[N]`` int64.

    The C kernel serves float32 CPU inputs whose last dim is contiguous and
    ``V >= 1`` (``num_threads``: over rows, default ``torch.get_num_threads()``);
    anything else goes to ``torch.argmax``, which raises what it raises
    (e.g. on an empty ``V``).
    """
    lib = _library()
    if (
        lib is None
        or x.dim() != 2
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.shape[1] == 0
        or (x.shape[1] > 1 and x.stride(1) != 1)
    ):
        return torch.argmax(x, dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        lib.argmax_rows(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), num_threads or torch.get_num_threads()
        )
    return out
