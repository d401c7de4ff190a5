"""Runs a ``DecoderEngine`` on its own thread and bridges it to asyncio.

The engine is single-threaded: every call into it happens on the engine
thread, queued here as a command. Between steps the thread drains commands
(add, mark encoded, abort), so requests join and leave the running batch
between decode steps. Step results go back to the event loop with one
``call_soon_threadsafe`` per step (one per output made the engine and
event-loop threads trade the GIL 32 times a step at batch 32).

**Decode hold.** While some request waits for its cross KV (handed to the
encoder, not yet marked encoded), the loop holds model steps for at most
``max_decode_hold_s`` (new requests still go to the encoder meanwhile). The
hold's clock starts when some sequence could step (a wait while every
request is still encoding pauses no one). A request's first step (its
prefill: its time to first token) is never held: it runs at once, with a
decode step of the running sequences, and the hold goes on after it (held
for the next one's encode, a request's TTFT roughly doubled in an online
run; measured: docs/benchmarks.md, Measurements formerly in docstrings). Like TGI's router, which pauses
running requests to prefill a queue of new ones (its ``waiting_served_ratio``
and ``max_waiting_tokens``), this trades a bounded pause of running
sequences for throughput: a burst of requests decodes in a few wide steps
instead of many narrow ones, and where the encoder shares the decoder's
cores (CPU, or one GPU) it gets them while it encodes.

When a hold runs out, what happens next depends on whether the encoder
delivered during it:

- **Some request arrived** (the encoder is working through a burst): the requests still encoding may hold again after
  ``hold_gap_steps`` model steps (TGI's ``max_waiting_tokens`` default, 20),
  so running sequences get at least that many tokens between pauses.
- **None arrived** (an Encode that hangs until ``encode_timeout_s``): those
  requests hold no more steps (they pause the others once, not every step),
  and no new hold starts within ``max_decode_hold_s`` of its end.

Without a hold, a burst of t5-small requests ran decode steps of a few
sequences racing the encoder, and the last requests finished well after the
first; 16 Whisper clips at once, encoded in 2-clip batches, ran many decode
steps of one or two sequences when only the first hold could wait (measured:
docs/benchmarks.md, Measurements formerly in docstrings, and the sessions'
sections for the numbers with re-holds). 0 turns holds off.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shared.compute_thread import use_threads

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
HOLD_GAP_STEPS = 20  # model steps between two holds of a burst: TGI's max_waiting_tokens default


class EngineLoop:
    """Owns the engine thread.

    Args:
        engine: a ``decoder_svc.core.engine.DecoderEngine``.
        loop: the event loop the callbacks run on.
        on_encode: ``(request_id, cross_block_ids)`` called on the loop when
            the engine reserved a request's cross blocks and wants them filled
            (the service's: ``decoder_svc.session.sessions.Sessions.on_encode``).
        on_output: ``(RequestOutput)`` called on the loop for each output
            (``Sessions.on_output``: on to the request's session).
        on_step_error: ``(exception)`` called on the loop when a step raised;
            the requests of that step are then failed by the caller
            (``Sessions.on_step_error``).
        num_threads: torch intra-op threads of the engine thread
            (``shared.compute_thread``); None keeps the process setting.
        max_decode_hold_s: longest hold of model steps while requests wait
            for their cross KV (seconds; see the module docstring); 0 = never hold.
        hold_gap_steps: model steps between a hold that ran out while the
            encoder delivered and the next hold (>= 0).
    """

    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        on_encode: Callable[[str, list[int]], None],
        on_output: Callable[[Any], None],
        on_step_error: Callable[[BaseException], None],
        num_threads: int | None = None,
        max_decode_hold_s: float = 0.0,
        hold_gap_steps: int = HOLD_GAP_STEPS,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_encode = on_encode
        self._on_output = on_output
        self._on_step_error = on_step_error
        self._num_threads = num_threads
        self.max_decode_hold_s = max_decode_hold_s
        self.hold_gap_steps = hold_gap_steps
        self._unheld: set[str] = set()  # handed to the encoder, not yet spent by a hold that ran out with no arrival
        self._encoded_at_hold = 0  # engine.num_encoded when the current hold's clock started
        self._no_hold_until = 0.0  # monotonic time before which no new hold starts (after one ran out with no arrival)
        self._gap_steps = 0  # model steps to run before the next hold (after one ran out while the encoder delivered)
        self._commands: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)`` on the engine thread between steps; returns its result or raises."""
        fut: Future = Future()
        self._commands.put((lambda: fn(*args, **kwargs), fut))
        return await asyncio.wrap_future(fut)

    def release_hold(self, request_id: str) -> None:
        """Engine thread: ``request_id`` (cancelled or aborted while its Encode is in flight) holds no model step
        any more; the server keeps its cross blocks until the encoder answers, but the others need not wait."""
        self._unheld.discard(request_id)

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _drain(self, timeout: float | None) -> bool:
        """Runs queued commands, first waiting up to ``timeout`` seconds for one (None: no wait);
        returns False when asked to stop."""
        try:
            item = self._commands.get(timeout=timeout) if timeout is not None else self._commands.get_nowait()
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

    def _deliver(self, to_encode: list[tuple[str, list[int]]], outputs: list) -> None:
        """On the event loop: a step's encode requests, then its outputs, in order."""
        for request_id, block_ids in to_encode:
            self._on_encode(request_id, list(block_ids))
        for output in outputs:
            self._on_output(output)

    def _hold_left(self, hold_until: float | None) -> tuple[float, float | None]:
        """(seconds to hold model steps now, the hold's end): 0 when the next step should run.

        The end is None while no hold runs, or while one waits with nothing
        ready to step (its clock has not started). A sequence waiting for its
        first step (a prefill) stops no hold but is not held either: the step
        runs now, and the hold's end stays. A hold that runs out with
        no arrival spends its requests; one that runs out after an arrival
        asks for ``hold_gap_steps`` model steps first (see the module docstring).
        """
        engine = self.engine
        if self.max_decode_hold_s <= 0 or engine.num_encoding == 0:
            self._unheld.clear()
            return 0.0, None
        now = time.monotonic()
        self._unheld = {rid for rid in self._unheld if engine.is_encoding(rid)}
        if not self._unheld:  # nothing to wait for (a running hold's requests were encoded or released)
            return 0.0, None
        if hold_until is None:
            if now < self._no_hold_until:
                return 0.0, None
            if engine.num_ready == 0:  # nothing could step anyway: this wait pauses no one
                self._gap_steps = 0  # (the gap is for running sequences: none is left)
                return IDLE_POLL_S, None
            if self._gap_steps > 0:
                return 0.0, None
            hold_until = now + self.max_decode_hold_s
            self._encoded_at_hold = engine.num_encoded
        if now >= hold_until:
            if engine.num_encoded > self._encoded_at_hold:
                self._gap_steps = self.hold_gap_steps  # the encoder delivers: the rest may hold again later
            else:  # none arrived (a hung Encode?): these requests hold no more steps
                self._unheld.clear()
                self._no_hold_until = now + self.max_decode_hold_s
            return 0.0, None
        if engine.num_to_prefill > 0:  # a first token is never held: this step runs, the hold goes on after it
            return 0.0, hold_until
        return hold_until - now, hold_until

    def _run(self) -> None:
        use_threads(self._num_threads)
        wait: float | None = IDLE_POLL_S
        hold_until: float | None = None  # end of the current decode hold
        while self._drain(wait):
            wait = None
            if not self.engine.has_unfinished_requests():
                wait, hold_until = IDLE_POLL_S, None
                continue
            try:
                left, hold_until = self._hold_left(hold_until)
                if left > 0:  # requests are encoding: send new ones to the encoder, run no model step
                    out = self.engine.dispatch_encodes()
                    wait = min(left, IDLE_POLL_S)
                else:
                    out = self.engine.step()
                    if out.outputs and self._gap_steps > 0:
                        self._gap_steps -= 1
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._on_step_error, exc)
                wait, hold_until = IDLE_POLL_S, None
                continue
            self._unheld.update(request_id for request_id, _ in out.to_encode)
            if out.to_encode or out.outputs:  # one wake-up of the loop per step, not one per request
                self._loop.call_soon_threadsafe(self._deliver, out.to_encode, out.outputs)
            if wait is None and not out.outputs and not out.to_encode:
                # Nothing ran: every request waits for its encoder; sleep until a command arrives.
                wait = IDLE_POLL_S
