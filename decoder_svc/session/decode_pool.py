"""The decoder's audio-decoding pool: at most ``--audio-decode-workers`` files decode at once, the cheapest first.

Decoding runs on threads of its own (not the default executor that Redis writes, readiness and word timing
share), so a burst of large uploads queues here instead of multiplying memory. Waiting decodes start in order of
their cost, the input samples their headers declare (rate x channels x seconds: what decoding and resampling
take time in proportion to), shortest job first, so a 7 s clip never waits behind eight 10-minute 8-channel
uploads; equal costs start first come first served. A file whose header states no length costs as much as the
longest audio accepted. Raw PCM never comes here (it is converted on the caller's thread: no container to read).

Single event loop: ``run`` is a coroutine; the workers only run the decode functions.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class DecodePool:
    """At most ``workers`` decodes at once; the rest wait, cheapest first.

    Args:
        workers: decodes run at once (>= 1).
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="audio-decode")
        self._free = workers
        self._waiting: list[tuple[float, int, asyncio.Future]] = []  # heap: (cost, arrival, handed a slot)
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, f in self._waiting if not f.done())

    async def run(self, cost: float, fn: Callable[..., T], *args) -> T:
        """Runs ``fn(*args)`` on a worker once one is free and no cheaper decode waits; returns its result.

        Args:
            cost: the decode's expected work (input samples); lower starts first.

        Raises:
            whatever ``fn`` raises; ``asyncio.CancelledError`` when the caller is cancelled (a decode not yet
            started never starts).
        """
        if self._free > 0 and not self.num_waiting:
            self._free -= 1
        else:
            slot = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (cost, next(self._arrivals), slot))
            try:
                await slot
            except asyncio.CancelledError:
                if slot.done() and not slot.cancelled():  # handed a slot as it was cancelled: pass it on
                    self._release()
                raise
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, slot = heapq.heappop(self._waiting)
            if not slot.done():  # a waiter cancelled meanwhile is skipped
                slot.set_result(None)
                return
        self._free += 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
