"""Which of the packed kernel's instruction sets runs fastest on this CPU, measured once at load.

``kernels.packed_linear`` has an AVX2/FMA and an AVX-512F float32 micro-kernel that give bit-identical results
(the tests compare them), so choosing between them never changes a token: only speed. The best instruction set
present is not always the fastest one (CPUs that lower their clock under 512-bit work, or that split 512-bit
instructions in two halves), so nothing is decided by CPU name: ``calibrate_packed_isa`` times each variant this
CPU has on one of the model's own packed weights at a decode step's row count, keeps the fastest for the process
(``packed_linear.use_isa``) and logs the times. Library kernels (MKL / oneDNN through torch) are not candidates for
decode steps: their sums depend on the row count, and a decode step's rows must get the numbers they get alone
(batch invariance); the encoder's many-row products are chosen between MKL and oneDNN by measuring
(``kernels.onednn_linear.prefer_onednn``). Under ``ENCDEC_MAX_CPU_ISA`` (``kernels._clib``) only the instruction sets
at or below the cap are candidates (``packed_linear.isas_present``): with ``avx2``, none is timed.
"""

from __future__ import annotations

import logging
import time

import torch

from kernels import packed_linear
from kernels.packed_linear import PackedWeight

__all__ = ["CALIBRATION_ROWS", "calibrate_packed_isa"]

log = logging.getLogger(__name__)

CALIBRATION_ROWS = 16  # a decode step of 16 running sequences
MARGIN = 0.97  # another instruction set replaces the best one present only when it takes under 97% of its time


def calibrate_packed_isa(
    weights: list[PackedWeight], num_threads: int, rows: int = CALIBRATION_ROWS, repeats: int = 5
) -> dict[str, float]:
    """Times ``packed_linear`` on ``weights`` (float32 ``PackedWeight``s: one of each shape a decode step multiplies)
    on ``num_threads`` threads (the decode steps' own) with each instruction set this CPU has, each weight's best of
    ``repeats`` calls of ``rows`` random rows, summed, and keeps the fastest for this process.

    Returns:
        ``{isa: seconds per pass over the weights}`` per instruction set measured; ``{}`` (nothing changed) when the
        kernel is not available, no weight is float32, or the CPU has one variant only.
    """
    weights = [w for w in weights if w.dtype == torch.float32]
    if not packed_linear.is_available() or not weights:
        return {}
    candidates = packed_linear.isas_present()
    if len(candidates) < 2:
        return {}
    best_present = packed_linear.use_isa(None)
    inputs = [torch.randn(rows, w.in_features) for w in weights]
    times = {}
    for name in candidates:
        packed_linear.use_isa(name)
        times[name] = sum(_best(x, w, num_threads, repeats) for x, w in zip(inputs, weights))
    fastest = min(times, key=times.get)
    chosen = fastest if times[fastest] < MARGIN * times[best_present] else best_present
    packed_linear.use_isa(chosen)
    shapes = ", ".join(f"[{w.out_features}, {w.in_features}]" for w in weights)
    log.info(
        "packed_linear instruction set, %d rows on %s: %s -> %s",
        rows, shapes, ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items()), chosen,
    )  # fmt: skip
    return times


def _best(x: torch.Tensor, weight: PackedWeight, num_threads: int, repeats: int) -> float:
    packed_linear.packed_linear(x, weight, num_threads=num_threads)  # warm-up: the weight's first touch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        packed_linear.packed_linear(x, weight, num_threads=num_threads)
        best = min(best, time.perf_counter() - start)
    return best
