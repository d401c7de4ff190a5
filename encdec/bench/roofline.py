"""Achieved GFLOP/s and % of the machine's peak beside every row of the seq2seq and whisper benches (issue 35).

A row's FLOPs are counted from the model's shapes (``encdec.bench.flops``) for the tokens it generated; its
GFLOP/s is FLOPs / wall seconds, its % of peak that over the peak of its dtype measured at the bench's thread
count (``encdec.bench.peak``: int8 rows against the int8 peak, bf16 rows against the bf16 one, others fp32),
measured at the bench's start and again at its end, each measure's best kept: a peak measured while another
process holds the cores is too low and would put rows above 100%.

Encoder and decoder apart, only where the system lets us see them: our encoder and decoder are separate processes,
so each side's busy time is taken as the process's CPU seconds over the timed run divided by the thread count the
peak is measured at (``/proc/PID/stat``). That counts a serial stretch (the Python step loop, gRPC) at 1/threads of
its wall time and a spinning idle worker in full, so it is an estimate of busy time, not a profile. HF and
CTranslate2 run both sides in one process with no timings of either: ``-``.
"""

from __future__ import annotations

import os
from pathlib import Path

from encdec.bench.table import format_number

COLUMNS = ["GFLOP/s (% peak)", "encoder (% peak)", "decoder (% peak)"]
"""The display columns ``add_achieved`` fills (strings: ``41.2 (19%)``, or ``-``)."""
NOTE = (
    "GFLOP/s: matrix-product FLOPs counted from the model's shapes over wall s; encoder / decoder: ours only, over "
    "each process's CPU s / threads (encdec.bench.roofline); % of the peak of the row's dtype at the same threads"
)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """``{name: process_cpu_s(pid)}``; subtract two readings for a run's CPU seconds."""
    return {name: process_cpu_s(pid) for name, pid in pids.items()}


def row_dtype(system: str) -> str:
    """``int8``, ``bf16`` or ``fp32``: the peak a row of ``system`` is set against."""
    low = system.lower()
    return "int8" if "int8" in low else "bf16" if "bf16" in low or "bfloat16" in low else "fp32"


def _cell(gflop: float | None, seconds: float | None, peak: float) -> tuple[float | None, float | None, str]:
    if not gflop or not seconds or seconds <= 0:
        return None, None, "-"
    rate = gflop / seconds
    return rate, 100 * rate / peak, f"{format_number(rate)} ({format_number(100 * rate / peak)}%)"


def add_achieved(rows: list[dict], peak, threads: int) -> None:
    """Fills each row's ``COLUMNS`` (display) and numbers (``GFLOP/s``, ``% peak``, ``encoder GFLOP/s``,
    ``encoder % peak``, ``decoder GFLOP/s``, ``decoder % peak``: None where unknown), in place.

    Args:
        rows: bench rows with ``system``, ``wall s``, ``GFLOP`` (the run's total), ``encoder GFLOP`` /
            ``decoder GFLOP``, and ``cpu s`` (``{"encoder": s, "decoder": s}`` or None: not seen).
        peak: ``encdec.bench.peak.Peak`` at ``threads``.
        threads: the thread count of each process (the busy-time divisor).
    """
    for r in rows:
        top = peak.for_dtype(row_dtype(r["system"]))
        r["GFLOP/s"], r["% peak"], r[COLUMNS[0]] = _cell(r.get("GFLOP"), r.get("wall s"), top)
        cpu = r.get("cpu s") or {}
        for side, column in (("encoder", COLUMNS[1]), ("decoder", COLUMNS[2])):
            busy = cpu[side] / threads if side in cpu else None
            r[f"{side} GFLOP/s"], r[f"{side} % peak"], r[column] = _cell(r.get(f"{side} GFLOP"), busy, top)


def totals(request_flops: list[tuple[int, int]]) -> dict:
    """``{"encoder GFLOP", "decoder GFLOP", "GFLOP"}`` of a run from each request's ``(encoder, decoder)`` FLOPs."""
    enc = sum(e for e, _ in request_flops) / 1e9
    dec = sum(d for _, d in request_flops) / 1e9
    return {"encoder GFLOP": enc, "decoder GFLOP": dec, "GFLOP": enc + dec}
