"""oneDNN's packed fp32 linear (``torch.ops.mkldnn``) for many-row products, chosen per weight shape by measuring.

An encoder multiplies 1500 rows per Whisper window by every weight. On some CPUs torch's
``F.linear`` (MKL sgemm, the bias copied into the output first) reaches a fraction of what
oneDNN's inner-product primitive does on the same product with its weight reordered once
into oneDNN's blocked layout; on others MKL is as fast (measured per machine:
docs/benchmarks.md). So nothing is decided by CPU name: ``prefer_onednn`` times both on
the shape at hand once per process (cached by shape, logged) and the caller packs the
weight only where oneDNN wins. The torch reference is ``F.linear``
(``tests/kernels/test_onednn_linear.py`` compares the two on irregular shapes).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MARGIN = 0.9  # oneDNN is used only when it takes under 90% of F.linear's time
_DECISIONS: dict[tuple[int, int, int, int], bool] = {}


def available() -> bool:
    """Whether this torch build has oneDNN's linear ops on the CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``[out, in]`` float32 CPU weight -> oneDNN's reordered weight for products of about ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``F.linear`` over a ``pack``ed weight: ``[..., in]`` float32 CPU -> ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [rows, out]
    return y.view(*x.shape[:-1], out_features)


def prefer_onednn(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, repeats: int = 3) -> bool:
    """Whether oneDNN's packed product beats ``F.linear`` for ``[rows, in] x weight^T`` on this machine.

    Measured once per ``(out, in, rows, threads)`` in the process (best of ``repeats`` each, on random
    inputs), cached and logged. False off the CPU, for other dtypes, or without oneDNN.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not available():
        return False
    key = (weight.shape[0], weight.shape[1], rows, torch.get_num_threads())
    if key not in _DECISIONS:
        x = torch.randn(rows, weight.shape[1])
        packed = pack(weight, rows)
        with torch.inference_mode():
            mkl = _best(lambda: F.linear(x, weight, bias), repeats)
            dnn = _best(lambda: linear(x, packed, bias, weight.shape[0]), repeats)
        _DECISIONS[key] = dnn < MARGIN * mkl
        log.info(
            "linear [%d, %d] x [%d, %d]^T on %d threads: F.linear %.2f ms, oneDNN packed %.2f ms -> %s",
            rows, weight.shape[1], weight.shape[0], weight.shape[1], key[3], mkl * 1e3, dnn * 1e3,
            "oneDNN" if _DECISIONS[key] else "F.linear",
        )  # fmt: skip
    return _DECISIONS[key]


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (first call builds the primitive)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
