"""Runs a ``DecoderEngine`` on its own thread and bridges it to asyncio.

The engine is single-threaded: every call into it happens on the engine
thread, queued here as a command. Between steps the thread drains commands
(add, mark encoded, abort), so requests join and leave the running batch
between decode steps. Step results go back to the event loop with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shared.compute_thread import use_threads

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5


class EngineLoop:
    """Owns the engine thread.

    Args:
        engine: a ``decoder_svc.engine.DecoderEngine``.
        loop: the event loop the callbacks run on.
        on_encode: ``(request_id, cross_block_ids)`` called on the loop when
            the engine reserved a request's cross blocks and wants them filled.
        on_output: ``(RequestOutput)`` called on the loop for each output.
        on_step_error: ``(exception)`` called on the loop when a step raised;
            the requests of that step are then failed by the caller.
        num_threads: torch intra-op threads of the engine thread
            (``shared.compute_thread``); None keeps the process setting.
    """

    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        on_encode: Callable[[str, list[int]], None],
        on_output: Callable[[Any], None],
        on_step_error: Callable[[BaseException], None],
        num_threads: int | None = None,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_encode = on_encode
        self._on_output = on_output
        self._on_step_error = on_step_error
        self._num_threads = num_threads
        self._commands: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)`` on the engine thread between steps; returns its result or raises."""
        fut: Future = Future()
        self._commands.put((lambda: fn(*args, **kwargs), fut))
        return await asyncio.wrap_future(fut)

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _drain(self, block: bool) -> bool:
        """Runs queued commands; returns False when asked to stop."""
        try:
            item = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    fut.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _run(self) -> None:
        use_threads(self._num_threads)
        idle = True
        while self._drain(block=idle):
            if not self.engine.has_unfinished_requests():
                idle = True
                continue
            try:
                out = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._on_step_error, exc)
                idle = True
                continue
            for request_id, block_ids in out.to_encode:
                self._loop.call_soon_threadsafe(self._on_encode, request_id, list(block_ids))
            for output in out.outputs:
                self._loop.call_soon_threadsafe(self._on_output, output)
            # Nothing ran: every request waits for its encoder; sleep until a command arrives.
            idle = not out.outputs and not out.to_encode
