"""The machine's own limit at the bench's thread count: matrix-product peaks and memory bandwidth (issue 35).

Every bench row is set beside these (``encdec.bench.roofline``): a system's achieved GFLOP/s means little without
what the same cores reach on the easiest product there is. Measured in this process, so an ``encdec bench
--cpu-isa avx2`` run (re-executed with the cap's variables: ``encdec.bench.cpu_isa``) measures the capped peak:

- fp32: ``torch.mm`` of two square float32 matrices (MKL sgemm in torch's CPU wheel), 2 n^3 FLOPs, the best of
  two sizes (``default_sizes``);
- bf16: the same in bfloat16 (oneDNN: AVX-512 BF16 / AMX), only where the CPU has a bfloat16 instruction
  (``shared.device.cpu_bf16_flags``: none under a cap); without one torch converts in software, which is no peak;
- int8: ``torch._int_mm`` (int8 x int8 -> int32, oneDNN), 2 n^3 integer ops;
- memory: one copy of a ``MEMORY_BYTES`` float32 tensor (bytes read + bytes written per second) and one sum
  over it (bytes read per second), far beyond any last-level cache.

Each is the best of ``reps`` timed runs after one untimed run (the first touch of the pages, MKL's and oneDNN's
one-time setup); a shared machine's other work only lowers a run, so the best one is nearest the limit. The fp32
and memory runs are timed by this process's CPU seconds / threads where that is less than their wall time
(``busy_s``: the time a run waited for a core taken by another process is not the machine's limit); bf16 and
int8 by wall time (oneDNN may leave threads idle on a product, which ``busy_s`` would time too short), so under
load those two read low. ``best_of`` merges two measurements (the benches
measure at their start and their end).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

MEMORY_BYTES = 256 * 2**20  # 256 MiB: well past the L3 of any CPU this runs on (and faster than a larger one)


@dataclass(frozen=True)
class Peak:
    """What ``measure_peak`` found. GFLOP/s (int8: giga integer ops/s) and GB/s (1e9 bytes/s); None where
    ``skipped`` gives the reason."""

    threads: int
    size: int  # n of the n x n fp32 product that reached the peak
    sizes: tuple[int, ...]  # the n measured
    fp32_gflops: float
    bf16_gflops: float | None
    int8_gops: float | None
    copy_gbs: float
    read_gbs: float
    seconds: float  # how long the measurement took
    skipped: dict[str, str] = field(default_factory=dict)

    def for_dtype(self, dtype: str) -> float:
        """The peak a row of ``dtype`` (``fp32``, ``bf16``, ``int8``) is set against: its own where measured,
        else the fp32 one."""
        own = {"bf16": self.bf16_gflops, "int8": self.int8_gops}.get(dtype)
        return own if own else self.fp32_gflops

    def to_dict(self) -> dict:
        return asdict(self)


def busy_s(fn, *args, **kwargs) -> float:
    """Seconds of one call ``fn(*args, **kwargs)``: min(wall seconds, this process's CPU seconds / torch's thread
    count). While another process holds a core, a call's wall time includes the time it waited for it and its CPU
    time does not. Only for calls that keep every thread busy (a large sgemm, a large copy): one that leaves
    threads idle would be timed too short."""
    import torch

    start, cpu = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return min(wall, cpu / torch.get_num_threads()) if cpu > 0 else wall


def _wall_s(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _best_s(fn, reps: int, *args, busy: bool = True) -> float:
    """The best of ``reps`` calls after one untimed one, each timed by ``busy_s`` (else by its wall time)."""
    fn(*args)
    return min((busy_s if busy else _wall_s)(fn, *args) for _ in range(reps))


def _bf16_missing() -> str | None:
    """Why there is no bfloat16 peak here, or None."""
    import torch

    from kernels._clib import max_cpu_isa
    from shared.device import cpu_bf16_flags

    if max_cpu_isa() is not None:
        return f"capped to {max_cpu_isa()} (ENCDEC_MAX_CPU_ISA): no AVX-512 BF16 / AMX"
    if not cpu_bf16_flags():
        return "the CPU has no bfloat16 instructions (avx512_bf16 / amx_bf16)"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    return None


PEAK_SIZES_ENV = "ENCDEC_BENCH_PEAK_SIZES"


def default_sizes(threads: int) -> tuple[int, ...]:
    """n of the square products, the best of which is the peak: 1536 and 3072 (7 and 58 GFLOP per product), twice
    that past 8 threads so each thread still gets large blocks. Not powers of two: a 2048-float leading dimension
    maps a column's elements onto few cache sets, and MKL's sgemm then falls well short of its peak.

    ``ENCDEC_BENCH_PEAK_SIZES`` (comma-separated n) replaces them: the test suite's bench runs use small products
    (the measurement at a bench's start and end then takes milliseconds instead of seconds, and the peak it
    prints means nothing: products that fit in cache).

    Raises:
        ValueError: ``ENCDEC_BENCH_PEAK_SIZES`` is not a comma-separated list of positive integers.
    """
    if value := os.environ.get(PEAK_SIZES_ENV, "").strip():
        try:
            sizes = tuple(int(n) for n in value.split(","))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise ValueError(f"{PEAK_SIZES_ENV} must be comma-separated positive integers, got {value!r}")
        return sizes
    return (1536, 3072) if threads <= 8 else (3072, 6144)


def _best_rate(ops_of_n, make, run, sizes: tuple[int, ...], reps: int, busy: bool = True) -> tuple[float, int]:
    """The best ``ops_of_n(n) / seconds`` over ``sizes`` (operands ``make(n)``, one call ``run(*operands)``) and its n."""
    best, best_n = 0.0, sizes[0]
    for n in sizes:
        rate = ops_of_n(n) / _best_s(run, reps, *make(n), busy=busy) / 1e9
        best, best_n = max((best, best_n), (rate, n))
    return best, best_n


def measure_peak(threads: int, sizes: tuple[int, ...] | None = None, reps: int = 4) -> Peak:
    """Measures the peaks on ``threads`` torch threads (restored afterwards).

    Args:
        threads: the thread count of the bench's systems (``--threads``).
        sizes: n of the n x n products (default ``default_sizes(threads)``); each peak is the best over them.
        reps: timed runs of each product and memory pass; the best is kept.
    """
    import torch

    sizes = sizes or default_sizes(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    skipped: dict[str, str] = {}
    ops = lambda n: 2 * n**3  # noqa: E731
    try:
        fp32, size = _best_rate(ops, lambda n: (torch.randn(n, n), torch.randn(n, n)), torch.mm, sizes, reps)
        bf16 = None
        if (reason := _bf16_missing()) is None:
            bf16 = _best_rate(ops, lambda n: (torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()), torch.mm,
                              sizes, reps, busy=False)[0]  # fmt: skip
        else:
            skipped["bf16"] = reason
        int8 = None
        i8 = lambda n: torch.randint(-128, 128, (n, n), dtype=torch.int8)  # noqa: E731
        try:
            int8 = _best_rate(ops, lambda n: (i8(n), i8(n)), torch._int_mm, sizes, reps, busy=False)[0]
        except (AttributeError, RuntimeError) as exc:  # no _int_mm in this torch, or no CPU kernel for it
            skipped["int8"] = f"torch._int_mm: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        x = torch.ones(MEMORY_BYTES // 4)
        y = torch.empty_like(x)
        copy = 2 * MEMORY_BYTES / _best_s(y.copy_, reps, x) / 1e9
        read = MEMORY_BYTES / _best_s(x.sum, reps) / 1e9
    finally:
        torch.set_num_threads(before)
    return Peak(threads, size, tuple(sizes), fp32, bf16, int8, copy, read, time.perf_counter() - start, skipped)


def best_of(a: Peak, b: Peak) -> Peak:
    """Each measure's better value of two measurements at one thread count (a shared machine's other work only
    lowers a measurement)."""
    hi = lambda x, y: max(v for v in (x, y) if v is not None) if (x or y) else None  # noqa: E731
    fp32, size = max((a.fp32_gflops, a.size), (b.fp32_gflops, b.size))
    return Peak(a.threads, size, a.sizes, fp32, hi(a.bf16_gflops, b.bf16_gflops), hi(a.int8_gops, b.int8_gops),
                max(a.copy_gbs, b.copy_gbs), max(a.read_gbs, b.read_gbs), a.seconds + b.seconds, a.skipped)  # fmt: skip


_PEAKS: dict[int, Peak] = {}  # threads -> the best measured so far in this process


def machine_peak(threads: int, remeasure: bool = False) -> Peak:
    """The peak at ``threads`` threads, measured once per process (``encdec bench all`` runs every bench in one
    process); ``remeasure`` measures again and keeps each measure's best (``best_of``)."""
    if threads not in _PEAKS:
        _PEAKS[threads] = measure_peak(threads)
    elif remeasure:
        _PEAKS[threads] = best_of(_PEAKS[threads], measure_peak(threads))
    return _PEAKS[threads]


def peak_line(peak: Peak) -> str:
    """One line: ``Peak at T thread(s): fp32 sgemm F GFLOP/s, bf16 B, int8 I GOP/s; memory C GB/s
    copy, R GB/s read`` (``no bf16`` / ``no int8`` where skipped)."""
    from encdec.bench.table import format_number as f

    bf16 = f"bf16 {f(peak.bf16_gflops)}" if peak.bf16_gflops else "no bf16"
    int8 = f"int8 {f(peak.int8_gops)} GOP/s" if peak.int8_gops else "no int8"
    return (
        f"Peak at {peak.threads} thread(s): fp32 sgemm {f(peak.fp32_gflops)} GFLOP/s, "
        f"{bf16}, {int8}; memory {f(peak.copy_gbs)} GB/s copy, {f(peak.read_gbs)} GB/s read"
    )


PEAK_COLUMNS = ["measure", "value", "unit", "note"]


def peak_rows(peak: Peak) -> list[dict]:
    """The peak as table rows (``PEAK_COLUMNS``); a skipped measure gets ``-`` and its reason."""

    def row(name: str, value: float | None, unit: str, note: str = "") -> dict:
        return {"measure": name, "value": "-" if value is None else value, "unit": unit, "note": note}

    n = f"n x n x n, best of n = {', '.join(map(str, peak.sizes))}"
    return [
        row("fp32 sgemm (torch.mm)", peak.fp32_gflops, "GFLOP/s", f"{n} (at {peak.size})"),
        row("bf16 matmul (torch.mm)", peak.bf16_gflops, "GFLOP/s", peak.skipped.get("bf16", n)),
        row("int8 matmul (torch._int_mm)", peak.int8_gops, "GOP/s", peak.skipped.get("int8", n)),
        row("memory copy", peak.copy_gbs, "GB/s", f"{MEMORY_BYTES >> 20} MiB read + written"),
        row("memory read (sum)", peak.read_gbs, "GB/s", f"{MEMORY_BYTES >> 20} MiB read"),
    ]
