"""One Generate request's life on this replica: samples, usage, Redis states, the coalesced stream.

``RequestSession.run`` drives a request after the servicer parsed it and
created its Redis record (QUEUED): it adds the request to the engine (through
``decoder_svc.core.engine_loop.EngineLoop``; the engine reserves its cross blocks),
has ``decoder_svc.session.encode_client`` fill those blocks when the engine asks
(ENCODING), marks it runnable (DECODING), turns the engine's outputs into
stream messages (``decoder_svc.session.convert``) merged per ``--stream-interval``,
and records FINISHED / ABORTED / FAILED with the blocks freed.
``decoder_svc.session.sessions.Sessions`` holds the running sessions by request id
(the engine loop's deliveries go through it to the session) and writes their
records. Redis sees a handful of writes per request, never one per token.

Whisper requests with one sample and one beam (language detection, timestamps,
long-form audio over 30 s) run as ``decoder_svc.session.whisper_session.WhisperSession``,
a subclass whose ``run`` drives several sequences per request; everything else
here is one sequence group per request.

Several outputs per request (``SamplingParams.n`` > 1, ``num_beams`` > 1;
``decoder_svc.core.engine``): every message carries its ``index``; n samples stream
interleaved as their tokens come, each index ends with its own finish_reason /
stop_reason, and the request's last message also carries ``usage`` (prompt
tokens once, completion tokens summed over the samples); Redis records the
finish reason of the index that finished last. Beam search streams nothing
while the beams run, then one message per returned beam (index 0 = best) with
all its tokens, text, finish_reason and ``score``. Abort frees every sequence
of the request.

The bookkeeping without I/O (token counts, message merging) is
``decoder_svc.session.request_progress``.

Ownership (``decoder_svc.replicas.lost_replicas``): records are created with this replica's id as their owner. Should
this replica's lease expire (it stalled, or lost Redis for longer than the lease), another replica fails its
requests in Redis; a state write of such a request is then refused (``InvalidTransitionError`` from a terminal
state) and the request ends here with UNAVAILABLE saying so (``RecordEndedElsewhereError``), its blocks freed.
A final state Redis lost the record of (restarted without persistence) is written whole
(``RequestStateStore.set_state``'s ``created``), now or once Redis is back.

Why over ~300 lines: a third is this docstring (the request rules); ``run`` and its error paths are one state
machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from decoder_svc.core.encoder_cache import encoder_cache_key
from decoder_svc.core.engine import CapacityError, RequestOutput
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.replicas.request_state import (
    InvalidTransitionError,
    RedisUnavailableError,
    RequestState,
    UnknownRequestError,
)
from decoder_svc.session import convert
from decoder_svc.session.admission import Ticket
from decoder_svc.session.inputs import RequestInput
from decoder_svc.session.request_progress import RequestProgress, StreamCoalescer
from shared.errors import ResourceExhaustedError, UnavailableError

log = logging.getLogger(__name__)


class RecordEndedElsewhereError(UnavailableError):
    """Another replica ended the request's record (failed it after this decoder's lease expired): UNAVAILABLE."""


def ended_elsewhere(exc: BaseException) -> bool:
    """True for a state write refused because the record is already terminal: another replica ended it."""
    return isinstance(exc, InvalidTransitionError) and exc.current is not None and exc.current.is_terminal


class RequestSession:
    """One request this replica is serving, from its engine admission to its recorded end.

    Attributes:
        progress: token counts (``RequestProgress``; a Whisper session's windows too).
        stream: what ``run`` consumes: ``RequestOutput``s, or an exception that ends the request.
        encoding: the (current window's) Encode task, once the engine asked for it.
        abort_requested: Abort RPC or end of the call: no Encode is started (no next window added).
        decoding_recorded: the Redis record moved to DECODING (after the Encode, or on an
            encoder-cache hit's first output).
    """

    def __init__(
        self,
        sessions,  # the replica's decoder_svc.session.sessions.Sessions
        request_id: str,
        inp: RequestInput,
        params: SamplingParams,
        priority: int,
        arrival: float,
    ) -> None:
        self._sessions = sessions
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.applied = inp.applied
        self.progress = RequestProgress(inp)
        self.stream: asyncio.Queue = asyncio.Queue()
        self.encoding: asyncio.Task | None = None
        self.abort_requested = False
        self.decoding_recorded = False
        self.progress_unrecorded = False  # a progress write missed Redis (record_progress)
        self.arrival = arrival  # Generate call received (time to first token's start)
        self.arrival_s = time.time()  # the same, as the encoder orders its queue (comparable across hosts)
        self.deadline: float | None = None  # monotonic time the call's gRPC deadline passes
        self.ticket: Ticket | None = None  # its place in the admission queue (decoder_svc.session.admission)
        self.last_token_at: float | None = None

    async def record_progress(self, state: RequestState, **fields) -> None:
        """Records a running request's progress (ENCODING, DECODING, token counts). Redis unreachable: the request
        goes on (logged once); a missed DECODING is written before its final state, which waits for Redis.

        Raises:
            RequestStateError: the record is gone or another replica ended it (the request must end).
        """
        try:
            created = self._sessions.created.get(self.request_id)  # Redis lost the record: written anew from it
            await asyncio.to_thread(self._sessions.store.set_state, self.request_id, state, created, **fields)
        except RedisUnavailableError as exc:
            if state is RequestState.DECODING:
                self._sessions.decoding_unrecorded.add(self.request_id)
            if not self.progress_unrecorded:
                log.warning(
                    "request %s goes on without recording %s (its final state is written once Redis answers): %s",
                    self.request_id,
                    state.name,
                    exc,
                )
            self.progress_unrecorded = True

    def abort(self) -> None:
        """The Abort RPC: the request ends with "abort" and the tokens so far (each running sample its own)."""
        self.abort_requested = True
        self.stream.put_nowait(RequestOutput(self.request_id, [], "", True, "abort", **self.progress.usage()))

    def start_encode(self, block_ids: list[int]) -> None:
        """The engine reserved the request's (current window's) cross blocks: have the encoder fill them."""
        # An aborting request's engine.abort is queued behind the step that reserved these blocks: no Encode into them.
        if not self.abort_requested:
            # Displaced by a higher-priority request, or its deadline passes before it could start: not encoded.
            if self.ticket is not None and (refusal := self.ticket.check_encode()) is not None:
                self.stream.put_nowait(refusal)
                return
            self.encoding = asyncio.create_task(self._encode(block_ids))

    async def run(self):
        """Runs the request to its end; yields its ``GenerateResponse`` messages (``_messages``).

        Whatever ends it, its blocks are freed and its end recorded (``_release``) before the client sees the
        last message or the status: ``self.end`` as ``_messages`` set it, ABORTED when the client went away,
        FAILED with the error otherwise.

        Raises:
            ResourceExhaustedError: the request can never fit this decoder's KV pools.
            UnavailableError: the encoder failed or stayed unreachable, Redis was unreachable for one of the
                request's state writes (``RedisUnavailableError``), the decoder shut down first, or another replica
                failed the record after this decoder's lease expired (``RecordEndedElsewhereError``).
            Exception: whatever failed the request's engine step (recorded FAILED, blocks freed, before it is raised).
        """
        sessions = self._sessions
        # Set by _messages before its last message; None: another replica ended the record (nothing to record).
        self.end: tuple[RequestState, dict] | None = (RequestState.FAILED, {})
        redis_down = False  # a state write found Redis unreachable: the end is recorded once it answers
        try:
            if sessions.cutting:  # its input was parsed after the grace ran out
                raise sessions.shutdown_error(self)
            async for message in self._messages():
                yield message
        except (
            asyncio.CancelledError,
            GeneratorExit,
        ):  # client went away (GeneratorExit: cancelled while paused at a yield)
            self.end = (RequestState.ABORTED, {"finish_reason": "abort", **self._progress_fields()})
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, then mapped to a status code by the server's interceptor
            self.end = (RequestState.FAILED, {"error": str(exc), **self._progress_fields()})
            redis_down = isinstance(exc, RedisUnavailableError)
            if ended_elsewhere(exc):  # its record is FAILED already: nothing more to record
                log.warning(
                    "request %s was ended by another replica while this decoder's lease had expired: %s",
                    self.request_id,
                    exc,
                )
                self.end = None
                raise RecordEndedElsewhereError(
                    f"request {self.request_id!r} was failed by another replica after this decoder's lease "
                    f"expired ({exc}); send it again"
                ) from exc
            if isinstance(exc, UnknownRequestError):  # its final FAILED is written whole (Sessions.created)
                raise UnavailableError(
                    f"the record of request {self.request_id!r} vanished from Redis (restarted without "
                    "persistence?); send it again"
                ) from exc
            raise
        finally:  # an error is recorded (FAILED) and the blocks freed before the client sees its status
            if self.end is None:
                release = self._release(RequestState.FAILED, {}, record=False)
            else:
                release = self._release(*self.end, redis_down)
            # Shielded: a call cancelled again while it cleans up (a deadline, then the stream closing) still
            # frees its blocks, leaves the engine and the session table, and records its end; unshielded, a second
            # cancel between engine.abort and the table left a sequence that never ran (issue 34 break test).
            await asyncio.shield(asyncio.ensure_future(release))

    async def _messages(self):
        """One sequence group: its stream messages, merged per ``--stream-interval``; sets ``self.end``."""
        sessions, params, progress = self._sessions, self.params, self.progress
        await self._start(self.progress.input)
        finished_indices: set[int] = set()  # n > 1 / beams: the request ends with its last index (or an abort)
        coalesce = StreamCoalescer(sessions.config.stream_interval if params.num_beams == 1 else 1)
        while True:
            got = await self.stream.get()
            if isinstance(got, BaseException):
                raise got
            if got.error is not None:  # it alone failed inside a step (decoder_svc.core.step_failures)
                raise got.error
            for item in _each_unfinished_sample(got, params.n, finished_indices):
                if not self.decoding_recorded and self.encoding is None and item.finish_reason != "abort":
                    # An encoder-cache hit decodes over another request's cross KV without an Encode of its own.
                    self.decoding_recorded = True
                    await self.record_progress(RequestState.DECODING)
                progress.count(item)
                self._observe_tokens(len(item.new_token_ids))
                text = item.text
                reason = item.finish_reason if item.finished else None
                final = item.finished  # this index's last message
                if final:
                    finished_indices.add(item.index)
                request_done = final and len(finished_indices) >= params.n
                message = convert.generate_response(
                    self.request_id, item, text, reason if final else None, sessions.token_texts
                )
                if request_done:
                    convert.add_usage(message, progress.usage(), progress.encoder_tokens, self.applied)
                    self.end = (
                        RequestState.ABORTED if reason == "abort" else RequestState.FINISHED,
                        {"finish_reason": reason, **progress.usage()},
                    )
                # Every sample's final message flushes what the coalescer held for it (an abort ends each one).
                if text or item.new_token_ids or final:
                    if (out := coalesce.add(message, len(item.new_token_ids), final)) is not None:
                        yield out
                if request_done:
                    return

    async def _start(self, inp: RequestInput) -> None:
        """Adds the request to the engine (its cross blocks are reserved at a later step).

        Raises:
            ResourceExhaustedError: it can never fit this decoder's KV pools.
        """
        self.progress.encoder_tokens += inp.encoder_len
        await self._add_sequence(inp.encoder_len, self.params, inp.prompt_token_ids, inp)

    async def _add_sequence(
        self, encoder_len: int, params: SamplingParams, prompt: list[int] | None, encoded: RequestInput | None, **add
    ) -> None:
        """One ``engine.add_request`` for this request; ``encoded``: the input Encode will get (its content keys
        the encoder cache when ``--encoder-cache`` is on), None when the sequence reads kept cross KV; ``add``:
        ``keep_cross`` / ``reuse_cross``.

        Raises:
            ResourceExhaustedError: the sequence can never fit this decoder's KV pools.
        """
        sessions = self._sessions
        cache_key = None
        if encoded is not None and sessions.config.encoder_cache:  # the content key of what Encode would get
            cache_key = await asyncio.to_thread(
                lambda: encoder_cache_key(sessions.config.model, **encoded.encoder_source())
            )
        try:
            await sessions.loop.call(
                sessions.engine.add_request,
                self.request_id,
                encoder_len,
                params,
                prompt,
                self.priority,
                cache_key,
                **add,
            )
        except CapacityError as exc:
            raise ResourceExhaustedError(str(exc)) from exc

    async def _encode(self, block_ids: list[int]) -> None:
        """Has the encoder fill ``block_ids``; marks the request runnable, or fails its stream.

        Every step has its error path: a failed state write (Redis unreachable), Encode or engine call ends the
        request with that error on its stream (``run`` then frees its blocks and records FAILED).
        """
        sessions = self._sessions
        try:
            if not self.progress.window:  # a later window is encoded while the record stays DECODING
                await self.record_progress(RequestState.ENCODING)
            await sessions.encoder.encode(
                self.request_id,
                self.progress.input,
                block_ids,
                deadline=self.deadline,
                priority=self.priority,
                arrival_s=self.arrival_s,
            )
            if self.abort_requested:
                return
            await self.record_progress(
                RequestState.DECODING, **(self._progress_fields() if self.progress.window else {})
            )
            self.decoding_recorded = True
            await sessions.loop.call(sessions.engine.mark_encoded, self.request_id)
        except Exception as exc:  # noqa: BLE001 - reported on the request's stream
            self.stream.put_nowait(exc)

    def _progress_fields(self) -> dict:
        """The record's fields a later window's DECODING write updates (its usage so far)."""
        return self.progress.usage()

    def _observe_tokens(self, num_tokens: int) -> None:
        """Time to first token on a request's first tokens, then one time-per-output-token sample per token."""
        if not num_tokens:
            return
        metrics, now = self._sessions.metrics, time.monotonic()
        if self.last_token_at is None:
            metrics.ttft.observe(now - self.arrival)
            self._sessions.admission.started(self.ticket)  # it leaves the admission queue
        else:
            for _ in range(num_tokens):
                metrics.tpot.observe((now - self.last_token_at) / num_tokens)
        self.last_token_at = now

    async def _release(self, state: RequestState, fields: dict, redis_down: bool = False, record: bool = True) -> None:
        """Frees the request's blocks (after any in-flight Encode wrote them) and records its end; ``redis_down``:
        Redis just failed this request, so its end waits for Redis's return (``Sessions.flush_unrecorded``)
        instead of costing the client another timeout now; ``record`` False: another replica ended the record."""
        sessions = self._sessions
        sessions.admission.leave(self.ticket, finished=state == RequestState.FINISHED)  # frees its seat
        sessions.metrics.requests.labels(state=state.name.lower(), finish_reason=fields.get("finish_reason", "")).inc()
        self.abort_requested = True
        if self.encoding is not None and not self.encoding.done() and not sessions.cutting:
            # The encoder may still write into the reserved cross blocks: keep them until it answers. (Shutting
            # down, no request can get them again: every running one is being ended and new ones are refused.)
            # The running requests no longer wait for this one (decode hold).
            await sessions.loop.call(sessions.loop.release_hold, self.request_id)
            await asyncio.wait([self.encoding])
        await sessions.loop.call(sessions.engine.abort, self.request_id)
        sessions.active.pop(self.request_id, None)
        if not record:
            sessions.created.pop(self.request_id, None)
        elif redis_down:
            sessions.record_later(self.request_id, state, fields)
        else:
            await sessions.write_end(self.request_id, state, fields)
        sessions.open_records.discard(self.request_id)


def _each_unfinished_sample(item: RequestOutput, n: int, finished: set[int]) -> list[RequestOutput]:
    """``[item]``; the Abort RPC's one output (index 0) becomes one per sample still running, so each of
    ``n > 1`` samples ends with its own ABORT and a sample that already finished gets no second final message."""
    if item.finish_reason != "abort" or n <= 1:
        return [item]
    return [dataclasses.replace(item, index=i) for i in range(n) if i not in finished] or [item]
