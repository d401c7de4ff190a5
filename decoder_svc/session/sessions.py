"""The requests this decoder replica is serving, and their Redis records.

``Sessions`` holds the running ``decoder_svc.session.request_session.RequestSession`` s by request id: the engine
loop's deliveries (an encode to start, an output, a failed step) go to it and on to the session. It creates
each request's record (QUEUED, owned by this replica) and writes its end; while Redis is unreachable the final
states wait (bounded by ``MAX_UNRECORDED``) and are written once it answers (``flush_unrecorded``, called by the
readiness probe), a missed DECODING first (a FINISHED record comes from DECODING); a record Redis lost
(restarted without persistence) is written whole from the record as created.
"""

from __future__ import annotations

import asyncio
import logging

from decoder_svc.core.engine import DecoderEngine, RequestOutput
from decoder_svc.core.engine_loop import EngineLoop
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.replicas.request_state import (
    InvalidTransitionError,
    RedisUnavailableError,
    RequestExistsError,
    RequestRecord,
    RequestState,
    RequestStateError,
    RequestStateStore,
    UnknownRequestError,
)
from decoder_svc.session import convert
from decoder_svc.session.admission import AdmissionQueue
from decoder_svc.session.encode_client import EncodeClient
from decoder_svc.session.inputs import RequestInput
from decoder_svc.session.request_session import RequestSession
from shared.config import DecoderServiceConfig
from shared.errors import AlreadyExistsError, UnavailableError
from shared.metrics import DecoderMetrics

log = logging.getLogger(__name__)

MAX_UNRECORDED = 10_000  # final states kept for Redis while it is down (the oldest dropped beyond)


class Sessions:
    """The requests this replica is serving, by id, and what their sessions share.

    The engine loop's callbacks are ``on_encode``, ``on_output`` and
    ``on_step_error`` (run on the event loop); each goes to the session of its
    request, if it is still running.

    Args:
        config: ``model``, ``stream_interval``, ``encoder_cache``, the decode hold settings.
        engine: the engine (called only on the engine thread, through ``loop``).
        store: the Redis request-state store.
        encoder: the Encode client.
        metrics: requests, time to first token, time per output token.
    """

    def __init__(
        self,
        config: DecoderServiceConfig,
        engine: DecoderEngine,
        store: RequestStateStore,
        encoder: EncodeClient,
        metrics: DecoderMetrics,
    ) -> None:
        self.config = config
        self.engine = engine
        self.store = store
        self.encoder = encoder
        self.metrics = metrics
        self.token_texts = convert.TokenTexts(engine.tokenizer)  # logprobs' token texts, cached by id
        self.active: dict[str, RequestSession] = {}
        self.admission = AdmissionQueue(
            config.max_waiting_requests, config.max_queue_time_s, seats=config.max_num_seqs
        )  # seats: the batch a request waits to join (decoder_svc.session.admission)
        self.replica_id = ""  # this decoder's registry id: the owner of the records it creates (set by start-up)
        self.open_records: set[str] = set()  # Redis records this replica created and has not yet ended
        # The records as created, until their final state is written: a final write that finds the record gone
        # (Redis restarted without persistence) writes it whole from these.
        self.created: dict[str, RequestRecord] = {}
        # Final states Redis missed (it was unreachable): written when it answers again (flush_unrecorded).
        self.unrecorded: dict[str, tuple[RequestState, dict]] = {}
        # Running requests whose DECODING write Redis missed: written just before their final state.
        self.decoding_unrecorded: set[str] = set()
        self.cutting = False  # the shutdown grace ran out: every running request ends with UNAVAILABLE
        self.shutdown_grace_s = 0.0
        self.loop: EngineLoop | None = None

    def start(self, num_threads: int | None) -> None:
        """Starts the engine thread (``num_threads`` torch threads; None keeps the process setting)."""
        self.loop = EngineLoop(
            self.engine,
            asyncio.get_running_loop(),
            self.on_encode,
            self.on_output,
            self.on_step_error,
            num_threads,
            self.config.max_decode_hold_ms / 1000.0,
            self.config.decode_hold_gap_steps,
        )

    async def close(self) -> None:
        """Stops the engine thread and the Encode channel; records FAILED for the records still open."""
        self.loop.stop()
        await self.encoder.close()
        if self.open_records:  # handlers the server's stop cancelled before they recorded an end
            await asyncio.to_thread(self._record_shutdown, sorted(self.open_records))
        await self.flush_unrecorded()

    def record_later(self, request_id: str, state: RequestState, fields: dict) -> None:
        """Keeps a final state Redis could not take, for ``flush_unrecorded`` (at most ``MAX_UNRECORDED``)."""
        self.unrecorded[request_id] = (state, fields)
        while len(self.unrecorded) > MAX_UNRECORDED:
            dropped = next(iter(self.unrecorded))
            log.warning("dropping the unrecorded final state of %s (over %d kept)", dropped, MAX_UNRECORDED)
            del self.unrecorded[dropped]
            self.created.pop(dropped, None)

    def _catch_up(self, request_ids) -> None:
        """Writes DECODING for those of ``request_ids`` whose DECODING Redis missed (a FINISHED record must come
        from DECODING); a record Redis lost meanwhile is written whole (``created``).

        Raises:
            RedisUnavailableError: Redis is still unreachable (nothing lost: the ids stay for the next try).
        """
        for request_id in [r for r in request_ids if r in self.decoding_unrecorded]:
            try:
                self.store.set_state(request_id, RequestState.DECODING, self.created.get(request_id))
            except (UnknownRequestError, InvalidTransitionError):  # lost by Redis, or ended by another replica
                pass
            self.decoding_unrecorded.discard(request_id)

    def _write_many(self, updates: list, created: dict) -> None:
        self._catch_up([request_id for request_id, _, _ in updates])
        self.store.set_state_many(updates, created)

    def _write_one(self, request_id: str, state: RequestState, fields: dict) -> None:
        self._catch_up([request_id])
        self.store.set_state(request_id, state, self.created.get(request_id), **fields)

    async def flush_unrecorded(self) -> None:
        """Writes the final states Redis missed, in one round trip; kept for the next try if Redis still fails."""
        if not self.unrecorded:
            return
        pending = dict(self.unrecorded)
        updates = [(request_id, state, fields) for request_id, (state, fields) in pending.items()]
        try:
            await asyncio.to_thread(self._write_many, updates, dict(self.created))
        except RedisUnavailableError:
            return
        except RequestStateError as exc:  # e.g. failed by another replica meanwhile: the others were written
            log.warning("some late final states could not be recorded: %s", exc)
        for request_id in pending:
            if self.unrecorded.get(request_id) == pending[request_id]:
                del self.unrecorded[request_id]
                self.created.pop(request_id, None)
        log.info("recorded %d final states that Redis missed while it was unreachable", len(pending))

    def _record_shutdown(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.store.set_state(
                    request_id,
                    RequestState.FAILED,
                    self.created.pop(request_id, None),
                    error="the decoder shut down before the request finished",
                )
            except Exception:  # noqa: BLE001 - ended meanwhile (terminal), or Redis gone: nothing more to do
                log.warning("could not record the shutdown of %s", request_id, exc_info=True)
        self.open_records.difference_update(request_ids)

    async def create_record(self, request_id: str) -> None:
        """Records the request QUEUED in Redis; the record stays open until its session ends it.

        Raises:
            AlreadyExistsError: ``request_id`` is running here, or its record exists (this or another replica's).
        """
        if request_id in self.active:
            raise AlreadyExistsError(f"request id {request_id!r} is already running")
        ours = request_id not in self.open_records  # else a call with this id is still parsing here
        self.open_records.add(request_id)  # before the await: a cancel during it still leaves it to close()
        try:
            record = await asyncio.to_thread(self.store.create, request_id, self.config.model, self.replica_id)
        except RequestExistsError as exc:
            if ours:
                self.open_records.discard(request_id)  # another replica's (or an earlier) record
            raise AlreadyExistsError(f"request id {request_id!r} was already used; pick a new one") from exc
        except Exception:  # Redis unreachable (RedisUnavailableError): no record, nothing to end
            if ours:
                self.open_records.discard(request_id)
            raise
        self.created[request_id] = record

    async def end_record(self, request_id: str, state: RequestState, **fields) -> None:
        """Records the end of a request whose session never ran (or Redis missed it: written later)."""
        await self.write_end(request_id, state, fields)
        self.open_records.discard(request_id)

    async def write_end(self, request_id: str, state: RequestState, fields: dict) -> None:
        """Writes a request's final state (the whole record if Redis lost it); kept for ``flush_unrecorded`` while
        Redis is unreachable; a record another replica ended already is left as it is (logged)."""
        try:
            await asyncio.to_thread(self._write_one, request_id, state, fields)
        except RedisUnavailableError as exc:  # the stream's outcome stands; recorded once Redis answers again
            log.warning("could not record %s for %s yet: %s", state.name, request_id, exc)
            self.record_later(request_id, state, fields)
            return
        except InvalidTransitionError as exc:  # failed by another replica after this one's lease expired
            log.warning("request %s was not recorded %s: %s", request_id, state.name, exc)
        except Exception:  # noqa: BLE001 - the stream's outcome stands; log the lost record
            log.exception("could not record %s for %s", state.name, request_id)
        self.created.pop(request_id, None)
        self.decoding_unrecorded.discard(request_id)

    def abort(self, request_id: str) -> bool:
        """The Abort RPC for a request running here (called on the event loop, also for an Abort another replica
        forwarded: ``decoder_svc.replicas.replica_control``): True if it runs here and now ends with "abort"."""
        session = self.active.get(request_id)
        if session is None:
            return False
        session.abort()
        return True

    def open(
        self,
        request_id: str,
        inp: RequestInput,
        params: SamplingParams,
        priority: int,
        arrival: float,
        deadline: float | None = None,
        kind: type[RequestSession] | None = None,
    ) -> RequestSession:
        """The session of a request whose record ``create_record`` made; ``arrival``: monotonic time of its call;
        ``deadline``: monotonic time its gRPC deadline passes (None: none), which bounds its Encode calls;
        ``kind``: the session class (``decoder_svc.session.whisper_session.WhisperSession`` for Whisper jobs;
        default ``RequestSession``)."""
        kind = kind or RequestSession
        session = self.active[request_id] = kind(self, request_id, inp, params, priority, arrival)
        session.deadline = deadline
        return session

    def shutdown_error(self, session: RequestSession) -> UnavailableError:
        return UnavailableError(
            f"the decoder shut down before request {session.request_id!r} finished "
            f"({session.progress.completion_tokens} tokens generated, "
            f"shutdown_grace_s={self.shutdown_grace_s:g}); send it again"
        )

    def cut(self) -> None:
        """Shutdown grace over: every running request ends with UNAVAILABLE, its blocks freed without waiting for
        its Encode."""
        self.cutting = True
        for session in list(self.active.values()):
            session.stream.put_nowait(self.shutdown_error(session))

    # -- the engine loop's callbacks (event loop) ---------------------------
    def on_encode(self, request_id: str, block_ids: list[int]) -> None:
        session = self.active.get(request_id)
        if session is not None:
            session.start_encode(block_ids)

    def on_output(self, output: RequestOutput) -> None:
        session = self.active.get(output.request_id)
        if session is not None:
            session.stream.put_nowait(output)

    def on_step_error(self, exc: BaseException) -> None:
        for session in self.active.values():
            session.stream.put_nowait(exc)
