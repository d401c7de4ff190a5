"""decoder_svc.session.decode_pool.DecodePool: a bound on decodes at once, cheapest first, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from decoder_svc.session.decode_pool import DecodePool


def test_at_most_workers_at_once_and_the_cheapest_waiting_starts_first():
    async def main():
        pool = DecodePool(2)
        gate = threading.Event()
        running, peak, order = 0, 0, []
        lock = threading.Lock()

        def decode(name):
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
            if name.startswith("big"):
                gate.wait(10)
            order.append(name)
            with lock:
                running -= 1
            return name

        tasks = [asyncio.create_task(pool.run(1e9, decode, f"big{i}")) for i in range(2)]  # hold both workers
        await asyncio.sleep(0.05)
        tasks += [asyncio.create_task(pool.run(1e9, decode, "big-late"))]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(pool.run(1e5, decode, "small"))]  # arrives last, costs least
        await asyncio.sleep(0.05)
        assert pool.num_waiting == 2
        gate.set()
        assert await asyncio.gather(*tasks) == ["big0", "big1", "big-late", "small"]
        assert peak <= 2
        assert order.index("small") < order.index("big-late")
        pool.shutdown()

    asyncio.run(main())


def test_a_cancelled_waiter_never_runs_and_frees_nothing_twice():
    async def main():
        pool = DecodePool(1)
        gate, ran = threading.Event(), []
        first = asyncio.create_task(pool.run(1, lambda: (gate.wait(10), ran.append("first"))))
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(pool.run(1, lambda: ran.append("cancelled")))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.set()
        await first
        started = time.monotonic()
        assert await pool.run(1, lambda: "next") == "next"  # the slot came back once
        assert time.monotonic() - started < 5 and ran == ["first"]
        assert pool._free == 1
        pool.shutdown()

    asyncio.run(main())


def test_workers_must_be_positive():
    with pytest.raises(ValueError):
        DecodePool(0)
