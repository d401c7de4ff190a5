"""The decoder service's RPCs (``DecoderService``): convert, call, convert back; and the shutdown drain.

One Generate: validate the call and parse its input (``decoder_svc.session.convert``,
``decoder_svc.session.inputs``), record QUEUED in Redis and open the request's
session (``decoder_svc.session.request_session``), which runs it through the engine
thread (``decoder_svc.core.engine_loop``) and the encoder
(``decoder_svc.session.encode_client``) and yields its stream messages. Errors leave
the handlers as exceptions; ``shared.grpc_server.ErrorStatusInterceptor``
turns them into status codes (``shared.errors.status_for``).

GetRequest and Abort work from any replica: the record in Redis names the
request's owner, and an Abort for a request running on another replica is
forwarded to it through Redis (``decoder_svc.replicas.replica_control``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.kv_budget import max_concurrent_requests
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.realtime.realtime_session import RealtimeSession
from decoder_svc.realtime.stream_admission import StreamAdmission
from decoder_svc.realtime.stream_config import parse_stream_config
from decoder_svc.realtime.stream_vad import VadBatcher
from decoder_svc.replicas.request_state import RedisUnavailableError, RequestState, RequestStateStore
from decoder_svc.session import convert
from decoder_svc.session.audio import AudioLimits, decode_cost
from decoder_svc.session.decode_pool import DecodePool
from decoder_svc.session.encode_client import EncodeClient
from decoder_svc.session.inputs import decode_request_audio, parse_input
from decoder_svc.session.limits import PriorityGate, apply_request_limits
from decoder_svc.session.request_session import RequestSession
from decoder_svc.session.sessions import Sessions
from decoder_svc.session.whisper_session import WhisperSession
from shared.config import DecoderServiceConfig
from shared.errors import InvalidRequestError, NotFoundError, UnavailableError
from shared.metrics import DecoderMetrics
from shared.models.registry import model_names
from shared.proto import decoder_pb2, decoder_pb2_grpc

log = logging.getLogger(__name__)


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    """Thin servicer: convert, call the request's session (or the engine loop), convert back.

    Args:
        config: the service's settings.
        model: the loaded decoder model (its config gives the vocabulary size and max source positions).
        engine: the engine over ``pool`` (``decoder_svc.startup.build_engine``).
        pool: the cross-KV pool the encoder writes into.
        store: the Redis request-state store.
        num_threads: the engine thread's torch threads (``shared.compute_thread``).
    """

    def __init__(
        self,
        config: DecoderServiceConfig,
        model,
        engine: DecoderEngine,
        pool,
        store: RequestStateStore,
        num_threads: int | None = None,
    ) -> None:
        self.config = config
        self.num_threads = num_threads
        self.model = model
        self.engine = engine
        self.served_names = model_names(config.model)
        self.draining = False  # SIGTERM: new Generate calls are refused, running ones get shutdown_grace_s
        # the health probe (decoder_svc.session.readiness), set by start-up: Redis known down fails at once
        self.readiness = None
        # decoder_svc.replicas.replica_control.ReplicaControl, set by start-up: Abort of others' requests
        self.control = None
        self.parsing = 0  # Generate calls past the draining check, not yet in `sessions.active` (parsing their input)
        # As parse_input tells the input's kind: text models (T5, BART family) declare input_modality, Whisper not.
        self.input_kind = getattr(model, "input_modality", "audio")
        # Audio files decode on a pool of their own, at most audio_decode_workers at once, cheapest first
        # (decoder_svc.session.decode_pool): a burst of large uploads queues there instead of multiplying memory,
        # never holds up Redis writes, and a short clip never waits behind it.
        self.priorities = PriorityGate(config)  # --min-client-priority, --priority-token-file
        self.audio_limits = AudioLimits(config.max_audio_s, config.max_audio_sample_rate, config.max_audio_channels)
        self.audio_pool = DecodePool(config.audio_decode_workers)
        self.metrics = DecoderMetrics()
        self.metrics.watch_engine(engine.stats, engine.scheduler)
        self.sessions = Sessions(config, engine, store, EncodeClient(config, pool, self.metrics), self.metrics)
        self.metrics.watch_admission(self.sessions.admission)
        # Realtime streams (TranscribeStream): their VAD batched together, refused at open when the machine is full.
        self.realtime_step_s = config.realtime_step_ms / 1000.0
        self.streams = StreamAdmission(config.max_realtime_streams, self.realtime_step_s, config.realtime_capacity)
        self.vad_batcher = VadBatcher()
        bm = engine.block_manager
        self.max_concurrent_requests = max_concurrent_requests(  # as decoder_svc.core.kv_budget sized the pools
            bm.num_self_blocks,
            bm.num_cross_blocks,
            bm.num_blocks_for(max(engine.max_total_len - 1, 1)),
            bm.num_blocks_for(model.config.max_source_positions),
        )

    def start(self) -> None:
        """Starts the engine thread; call on the event loop that serves the RPCs."""
        self.sessions.start(self.num_threads)

    async def close(self) -> None:
        await self.sessions.close()
        self.audio_pool.shutdown()

    async def drain(self, grace_s: float, poll_s: float = 0.05) -> None:
        """Shutdown: refuses new Generate calls (UNAVAILABLE), lets running ones (those still parsing their input
        too) finish for up to ``grace_s`` seconds, then ends the rest with UNAVAILABLE (recorded FAILED, their
        blocks freed without waiting for their Encode) and waits up to 2 s for their handlers to send those statuses.
        What the server's stop then cancels is recorded FAILED by ``close``."""
        sessions = self.sessions
        self.draining, sessions.shutdown_grace_s = True, grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while (sessions.active or self.parsing) and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        if sessions.active or self.parsing:
            log.warning(
                "shutting down: ending %d running requests after %.1f s", len(sessions.active) + self.parsing, grace_s
            )
        sessions.cut()
        deadline = loop.time() + 2.0
        while (sessions.active or self.parsing) and loop.time() < deadline:
            await asyncio.sleep(poll_s)

    def _check_model(self, name: str) -> None:
        if name and name not in self.served_names:
            shown = name if len(name) <= 256 else name[:256] + "..."  # a status message travels in 16 KiB metadata
            raise NotFoundError(f"model {shown!r} is not served here; this decoder serves {self.config.model!r}")

    # -- RPCs ---------------------------------------------------------------
    async def Generate(self, request, context):
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        ticket = None  # its place in the admission queue (decoder_svc.session.admission)
        self.parsing += 1  # the drain waits for it as for a running request
        try:
            if self.draining:
                raise UnavailableError("this decoder is shutting down; send the request to another replica")
            if self.readiness is not None and self.readiness.redis_reason is not None:  # fail now, not at a timeout
                raise RedisUnavailableError(
                    f"{self.readiness.redis_reason}: the request state cannot be recorded; retry the request once "
                    "Redis is back, or send it to another replica"
                )
            self._check_model(request.model)
            params = convert.sampling_params_from_pb(request.sampling, self.model.config.vocab_size)
            convert.check_request_id(request_id)
            self.priorities.check(request.priority, context.invocation_metadata())
            # At once, before any parsing: RESOURCE_EXHAUSTED (queue full) or DEADLINE_EXCEEDED (it cannot start in time).
            ticket = self.sessions.admission.admit(request.priority, context.time_remaining())
            # Decoding and resampling audio takes a while: keep it off the event loop that serves every stream.
            pcm, source = None, request.WhichOneof("input")
            if source == "pcm" and self.input_kind == "audio":  # raw samples: no container to decode, never queued
                pcm = await asyncio.to_thread(decode_request_audio, request, self.audio_limits)
            elif (
                source == "audio" and self.input_kind == "audio"
            ):  # refused from the header at once, else queued by cost
                cost = await asyncio.to_thread(decode_cost, request.audio, self.audio_limits)
                pcm = await self.audio_pool.run(cost, decode_request_audio, request, self.audio_limits)
            inp = await asyncio.to_thread(
                parse_input,
                request,
                self.model,
                self.engine.tokenizer,
                self.config.max_audio_s,
                self.config.decoding_rules,
                pcm,
            )
            params = apply_request_limits(params, inp, self.config)  # --max-new-tokens, --max-n, ... (limits.py)
            await self.sessions.create_record(request_id)  # Redis: QUEUED
        except BaseException:
            self.sessions.admission.leave(ticket)
            raise
        finally:
            self.parsing -= 1
        remaining_s = context.time_remaining()  # None without a client deadline
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        kind = WhisperSession if inp.whisper is not None else RequestSession  # language, task, long-form
        try:
            session = self.sessions.open(request_id, inp, params, request.priority, arrival, deadline, kind)
        except Exception as exc:  # its record exists: end it (FAILED) before the status goes out
            self.sessions.admission.leave(ticket)
            self.sessions.active.pop(request_id, None)
            await self.sessions.end_record(request_id, RequestState.FAILED, error=str(exc))
            raise
        session.ticket = ticket
        ticket.bind(session.stream.put_nowait)  # displaced by a higher-priority request: it ends with that error
        # aclosing: a call closed while paused at our yield ends the session (its record, its blocks) at once.
        async with contextlib.aclosing(session.run()) as messages:
            async for message in messages:
                yield message

    async def TranscribeStream(self, request_iterator, context):
        """A realtime stream (``decoder_svc.realtime``): its first message is its config, then audio / control."""
        arrival = time.monotonic()
        self.parsing += 1  # the drain waits for it as for a running request
        try:
            if self.draining:
                raise UnavailableError("this decoder is shutting down; open the stream on another replica")
            if self.readiness is not None and self.readiness.redis_reason is not None:
                raise RedisUnavailableError(
                    f"{self.readiness.redis_reason}: the stream's state cannot be recorded; retry once Redis is back"
                )
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("message") != "config":
                raise InvalidRequestError("a TranscribeStream call's first message must be its config")
            config = first.config
            self._check_model(config.model)
            request_id = config.request_id or uuid.uuid4().hex
            convert.check_request_id(request_id)
            self.priorities.check(config.priority, context.invocation_metadata(), "stream")
            inp, settings = await asyncio.to_thread(
                parse_stream_config, config, self.model, self.engine.tokenizer, self.realtime_step_s
            )
            self.streams.check(settings.step_s)  # RESOURCE_EXHAUSTED: too many streams, or no time for one more
            await self.sessions.create_record(request_id)  # Redis: QUEUED
        finally:
            self.parsing -= 1
        params = SamplingParams()
        try:
            session = self.sessions.open(request_id, inp, params, config.priority, arrival, None, RealtimeSession)
            session.bind(settings, request_iterator, self.vad_batcher, self.streams.observe)
        except Exception as exc:  # its record exists: end it (FAILED) before the status goes out
            self.sessions.active.pop(request_id, None)
            await self.sessions.end_record(request_id, RequestState.FAILED, error=str(exc))
            raise
        self.streams.open(session)
        try:
            async with contextlib.aclosing(session.run()) as messages:
                async for message in messages:
                    yield message
        finally:
            self.streams.close(session)

    async def GetRequest(self, request, context):
        convert.check_request_id(request.request_id)
        record = await asyncio.to_thread(self.sessions.store.get, request.request_id)
        if record is None:
            raise NotFoundError(f"no request {convert.shown_request_id(request.request_id)!r} (unknown or expired)")
        return convert.request_record_pb(record)

    async def Abort(self, request, context):
        convert.check_request_id(request.request_id)
        if self.sessions.abort(request.request_id):  # running here
            return decoder_pb2.AbortResponse(aborted=True)
        if self.control is None:
            return decoder_pb2.AbortResponse(aborted=False)
        return decoder_pb2.AbortResponse(aborted=await self.control.abort_elsewhere(request.request_id))

    async def GetStats(self, request, context):
        # Read here, not on the engine thread (issue 34 item 7: a poll waited for the running step): the counts are
        # plain ints and list lengths, as the metrics scrape reads them; a step may move them between two reads.
        stats = self.engine.stats()
        stats["max_concurrent_requests"] = self.max_concurrent_requests
        stats.update(self.sessions.admission.stats())
        stats["model"], stats["served_model_names"] = self.config.model, sorted(self.served_names)
        stats["input_kind"] = self.input_kind
        stats["replica_id"] = self.sessions.replica_id
        return convert.stats_pb(stats)
