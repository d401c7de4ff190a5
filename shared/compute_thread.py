"""One thread per service process runs torch's multi-threaded CPU ops.

Each service does its model work on one dedicated thread (the decoder's
engine loop, the encoder's encode / embed batcher) while the main thread runs
the gRPC event loop. torch's CPU wheels parallelise ops with GNU OpenMP
(libgomp), which counts every thread that ever started a parallel region
together with its worker threads. Once that count exceeds the CPUs the process
may use, libgomp throttles: every worker spins only ~100 times (instead of
~300,000) before sleeping on a futex, so each of the hundreds of parallel ops
of a decode step pays a wake-up. Loading the model on the main thread with 2
threads was enough to trigger it on our 2-core machines: a t5-small batch-32
decode step took ~100 ms instead of ~80 ms (52,640 voluntary context switches
in 130 steps instead of 18).

So the main thread loads and prepares with one thread (``single_threaded_main``)
and the compute thread takes the configured count when it starts
(``use_threads``); libgomp then manages one team only. The per-thread setting is
OpenMP's own (``omp_set_num_threads`` is per calling thread), which
``torch.set_num_threads`` calls.

Spinning is what the decoder's steady stream of small ops wants. The encoder
service works in bursts on the same cores: its workers spinning after each
burst took CPU from the decoder (t5-small bench, 32 requests: 13-14 s of wall
instead of 7.4-7.8 s, the encoder burning 7 s of CPU instead of 1 s). So the
encoder process defaults to ``OMP_WAIT_POLICY=PASSIVE`` (``passive_omp_wait``),
unless the environment already says otherwise.
"""

from __future__ import annotations

import os
import sys

__all__ = ["passive_omp_wait", "single_threaded_main", "use_threads"]


def passive_omp_wait() -> None:
    """Defaults ``OMP_WAIT_POLICY`` to ``PASSIVE`` for this process (OpenMP workers sleep when idle).

    Raises:
        RuntimeError: torch is already imported (libgomp reads the variable when it loads).
    """
    if "torch" in sys.modules:
        raise RuntimeError("passive_omp_wait() must run before torch is imported")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
