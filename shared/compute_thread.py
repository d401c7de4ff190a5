"""One thread per service process runs torch's multi-threaded CPU ops.

Each service does its model work on one dedicated thread (the decoder's
engine loop, the encoder's encode / embed batcher) while the main thread runs
the gRPC event loop. torch's CPU wheels parallelise ops with GNU OpenMP
(libgomp), which counts every thread that ever started a parallel region
together with its worker threads. Once that count exceeds the CPUs the process
may use, libgomp throttles: every worker spins only ~100 times (instead of
~300,000) before sleeping on a futex, so each of the hundreds of parallel ops
of a decode step pays a wake-up. Loading the model on the main thread with 2
threads was enough to trigger it on 2 cores: a t5-small batch-32 decode step
got slower, with hundreds of times more voluntary context switches (measured:
docs/benchmarks.md, Measurements formerly in docstrings).

So the main thread loads and prepares with one thread (``single_threaded_main``)
and the compute thread takes the configured count when it starts
(``use_threads``); libgomp then manages one team only. The per-thread setting is
OpenMP's own (``omp_set_num_threads`` is per calling thread), which
``torch.set_num_threads`` calls.

How long an idle worker spins is a trade-off on 2 cores shared by two
services: the decoder's steady stream of small ops wants its workers awake
between ops, while spinning workers take the cores from the other service
(Whisper: the encoder's 30 s windows are half the work). The walls of the
t5-small seq2seq bench and the Whisper bench at concurrency 16 were compared
for libgomp's default spin, ``OMP_WAIT_POLICY=PASSIVE`` and a short spin of
3,000 in both services (``short_omp_spin``): the short spin was as fast as the
best of the others on each (measured: docs/benchmarks.md, Measurements
formerly in docstrings).

So both services default to ``GOMP_SPINCOUNT=3000`` (a short spin: enough to
bridge the gap between a step's consecutive ops, asleep on real idle)
unless the environment sets ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``.

The C kernels of decode steps (``kernels/csrc``) run on a pool of their own
(``parallel.h``), sized by the same per-thread count: its idle workers spin
only 50 us and yield the core while they do, and work is handed out in small
chunks, so neither pool waits on the other or on a descheduled worker.
"""

from __future__ import annotations

import os
import sys

__all__ = ["SPIN_COUNT", "short_omp_spin", "single_threaded_main", "use_threads"]

SPIN_COUNT = 3000


def short_omp_spin(spin_count: int = SPIN_COUNT) -> None:
    """Defaults libgomp's ``GOMP_SPINCOUNT`` to ``spin_count`` for this process (see the module docstring).

    Leaves the environment alone when it already sets ``GOMP_SPINCOUNT`` or
    ``OMP_WAIT_POLICY``.

    Raises:
        RuntimeError: torch is already imported (libgomp reads the variable when it loads).
    """
    if "torch" in sys.modules:
        raise RuntimeError("short_omp_spin() must run before torch is imported")
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(spin_count)


def single_threaded_main(num_threads: int = 0) -> int:
    """Makes the calling (main) thread run torch ops on one thread; returns the compute thread's count.

    Args:
        num_threads: the configured intra-op thread count; 0 = torch's default
            (one per CPU the process may use), read before it is changed.

    Returns:
        The count to pass to ``use_threads`` on the compute thread (>= 1).
    """
    import torch

    n = num_threads if num_threads > 0 else torch.get_num_threads()
    torch.set_num_threads(1)
    return max(n, 1)


def use_threads(num_threads: int | None) -> None:
    """Sets the calling thread's torch intra-op thread count; None leaves it as it is."""
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
