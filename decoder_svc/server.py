"""The decoder service process: public ``DecoderService`` over the engine thread.

Per Generate request: validate and decode the audio (or tokenize the source
text; ``decoder_svc.inputs``), record QUEUED in Redis,
add to the engine (which reserves cross blocks), call the encoder's Encode
into those blocks (ENCODING), mark the request runnable (DECODING), stream
text deltas, record FINISHED / ABORTED / FAILED. Redis sees a handful of
writes per request, never one per token.

Long audio (over Whisper's 30 s window, up to ``max_audio_s``): the request
runs its windows (``RequestInput.windows``) one after another, each added to
the engine as a fresh sequence under the request's id with the same prompt
and suppressions, so scheduling, batching, preemption and the encoder cache
treat it like any 30 s request; it queues behind requests already waiting, so
a long transcript does not hold back short ones. A window ends on its end
token (or the model max length) and the next one is added only then: its
cross blocks are reserved after the previous window's self and cross blocks
were freed (never one ahead, so a long request holds at most one window's KV;
the price is that window i+1's Encode does not overlap window i's decode).
One Redis record, one stream: each window's tokens end with its end token
(so ``token_ids`` split per window), its text continues the previous window's
(a space inserted only when neither side has one), ``usage`` sums prompt,
completion and encoder tokens over the windows. ``max_tokens`` / ``min_tokens``
count over the whole request (a window gets what is left; ``max_tokens`` used
up with windows left ends the request with "length"); a stop string or stop
token id ends the request (stop strings are matched within a window); a seed
restarts each window's generator. Abort / disconnect mid-window frees that
window's blocks and records ABORTED with the tokens streamed so far.

Several outputs per request (``SamplingParams.n`` > 1, ``num_beams`` > 1;
``decoder_svc.engine``): every message carries its ``index``; n samples stream
interleaved as their tokens come, each index ends with its own finish_reason /
stop_reason, and the request's last message also carries ``usage`` (prompt
tokens once, completion tokens summed over the samples); Redis records the
finish reason of the index that finished last. Beam search streams nothing
while the beams run, then one message per returned beam (index 0 = best) with
all its tokens, text, finish_reason and ``score``. Abort frees every sequence
of the request. Audio over 30 s (windows) takes n = 1 and num_beams = 1 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from decoder_svc.engine import CapacityError, DecoderEngine, RequestOutput
from decoder_svc.encoder_cache import encoder_cache_key
from decoder_svc.engine_loop import EngineLoop
from decoder_svc.inputs import RequestInput, parse_input
from decoder_svc.kv_budget import max_concurrent_requests
from shared.config import DecoderServiceConfig
from shared.errors import AlreadyExistsError, InvalidRequestError, NotFoundError, ResourceExhaustedError, UnavailableError
from shared.grpc_server import GRPC_OPTIONS, abort_with
from shared.metrics import DecoderMetrics
from shared.models.registry import model_names
from shared.proto import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from decoder_svc.request_state import RequestExistsError, RequestState, RequestStateStore
from decoder_svc.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_SCALAR_SAMPLING_FIELDS = frozenset({
    "temperature", "top_k", "top_p", "seed", "max_tokens", "min_tokens", "ignore_eos", "min_p",
    "repetition_penalty", "no_repeat_ngram_size", "include_stop_str_in_output", "logprobs", "top_logprobs",
    "n", "num_beams", "length_penalty", "early_stopping",
})
_REPEATED_SAMPLING_FIELDS = frozenset({"stop", "stop_token_ids"})

FINISH_REASONS = {
    "stop": decoder_pb2.FINISH_REASON_STOP,
    "length": decoder_pb2.FINISH_REASON_LENGTH,
    "abort": decoder_pb2.FINISH_REASON_ABORT,
}


MAX_REQUEST_ID_LEN = 256


@dataclass
class _Active:
    """A request this replica is serving.

    Long audio: ``input`` is the window being decoded (``_encode`` and the
    encoder-cache key read it), ``window`` its index, ``base_*`` the tokens of
    the windows before it; ``prompt_tokens`` / ``completion_tokens`` /
    ``encoder_tokens`` are the request's totals.
    """

    input: RequestInput
    stream: asyncio.Queue = field(default_factory=asyncio.Queue)
    encoding: asyncio.Task | None = None
    abort_requested: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)  # Generate call received (TTFT's start)
    last_token_at: float | None = None
    window: int = 0
    base_prompt_tokens: int = 0
    base_completion_tokens: int = 0
    encoder_tokens: int = 0
    text_tail: str = ""  # last streamed character
    window_text_started: bool = False
    sample_completion: dict[int, int] = field(default_factory=dict)  # n > 1 / beams: completion tokens per index
    decoding_recorded: bool = False  # Redis record moved to DECODING (by _encode, or on an encoder-cache hit's first output)

    def usage(self) -> dict[str, int]:
        """Token counts as of the last output (recorded on abort and failure too)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}

    def count(self, item: RequestOutput) -> None:
        """Request totals from a window's output (the Abort RPC's output already carries the totals)."""
        if item.finish_reason != "abort":
            self.sample_completion[item.index] = item.completion_tokens  # n > 1: summed over the samples
            self.prompt_tokens = self.base_prompt_tokens + item.prompt_tokens
            self.completion_tokens = self.base_completion_tokens + sum(self.sample_completion.values())

    def stream_text(self, text: str) -> str:
        """``text`` as streamed: a later window's first text gets a leading space when
        neither it nor the text before it has one, so words of two windows never run together."""
        if text:
            if self.window and not self.window_text_started and self.text_tail and not self.text_tail.isspace() and not text[0].isspace():
                text = " " + text
            self.window_text_started = True
            self.text_tail = text[-1]
        return text


class _Coalescer:
    """``--stream-interval``: one request's GenerateResponse messages merged until ``interval`` new tokens are held.

    A sample's first message and its final one go out at once (time to first token and the finish are never
    delayed); in between, messages are merged (text concatenated, token ids and logprobs appended, the rest
    from the newest) per sample index. ``interval`` 1 sends every message as it comes.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.held: dict[int, decoder_pb2.GenerateResponse] = {}
        self.held_tokens: dict[int, int] = {}
        self.started: set[int] = set()

    def add(self, message, new_tokens: int, final: bool):
        """The message to send now (``message`` merged into what was held for its index), or None (held)."""
        index = message.index
        held = self.held.pop(index, None)
        if held is not None:
            text = held.text + message.text
            held.MergeFrom(message)  # appends repeated fields; the newest set scalars win
            held.text, message = text, held
        tokens = self.held_tokens.pop(index, 0) + new_tokens
        if self.interval <= 1 or final or index not in self.started or tokens >= self.interval:
            self.started.add(index)
            return message
        self.held[index], self.held_tokens[index] = message, tokens
        return None


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    """Thin servicer: convert, call the engine loop, convert back."""

    def __init__(self, config: DecoderServiceConfig, model, engine: DecoderEngine, pool, store: RequestStateStore,
                 num_threads: int | None = None) -> None:
        self.config = config
        self.num_threads = num_threads  # the engine thread's torch threads (shared.compute_thread)
        self.model = model
        self.engine = engine
        self.pool = pool
        self.store = store
        self.served_names = model_names(config.model)
        self.active: dict[str, _Active] = {}
        self.draining = False  # SIGTERM: new Generate calls are refused, running ones get shutdown_grace_s
        self.cutting = False  # the grace ran out: every running request ends with UNAVAILABLE
        self.shutdown_grace_s = 0.0
        self.parsing = 0  # Generate calls past the draining check, not yet in `active` (parsing their input)
        self.open_records: set[str] = set()  # Redis records this replica created and has not yet ended
        self.loop: EngineLoop | None = None
        self.transfer_ids = itertools.count(1)  # names each request's cross-KV transfer (torch_dist)
        self.channel = grpc.aio.insecure_channel(config.encoder_address, options=GRPC_OPTIONS)
        self.encoder = encoder_pb2_grpc.EncoderServiceStub(self.channel)
        self.metrics = DecoderMetrics()
        self.metrics.watch_engine(engine.stats, engine.scheduler)
        bm = engine.block_manager
        self.max_concurrent_requests = max_concurrent_requests(  # as decoder_svc.kv_budget sized the pools
            bm.num_self_blocks, bm.num_cross_blocks, bm.num_blocks_for(max(engine.max_total_len - 1, 1)),
            bm.num_blocks_for(model.config.max_source_positions))

    def start(self) -> None:
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop(), self._on_encode, self._on_output, self._on_step_error,
                               self.num_threads, self.config.max_decode_hold_ms / 1000.0, self.config.decode_hold_gap_steps)

    async def close(self) -> None:
        self.loop.stop()
        await self.channel.close()
        if self.open_records:  # handlers the server's stop cancelled before they recorded an end
            await asyncio.to_thread(self._record_shutdown, sorted(self.open_records))

    def _record_shutdown(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.store.set_state(request_id, RequestState.FAILED, error="the decoder shut down before the request finished")
            except Exception:  # noqa: BLE001 - ended meanwhile (terminal), or Redis gone: nothing more to do
                log.warning("could not record the shutdown of %s", request_id, exc_info=True)
        self.open_records.difference_update(request_ids)

    def _shutdown_error(self, request_id: str, active: _Active) -> UnavailableError:
        return UnavailableError(f"the decoder shut down before request {request_id!r} finished ({active.completion_tokens} "
                                f"tokens generated, shutdown_grace_s={self.shutdown_grace_s:g}); send it again")

    async def drain(self, grace_s: float, poll_s: float = 0.05) -> None:
        """Shutdown: refuses new Generate calls (UNAVAILABLE), lets running ones (those still parsing their input
        too) finish for up to ``grace_s`` seconds, then ends the rest with UNAVAILABLE (recorded FAILED, their
        blocks freed without waiting for their Encode) and waits up to 2 s for their handlers to send those statuses.
        What the server's stop then cancels is recorded FAILED by ``close``."""
        self.draining, self.shutdown_grace_s = True, grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while (self.active or self.parsing) and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        self.cutting = True
        if self.active or self.parsing:
            log.warning("shutting down: ending %d running requests after %.1f s", len(self.active) + self.parsing, grace_s)
        for request_id, active in list(self.active.items()):
            active.stream.put_nowait(self._shutdown_error(request_id, active))
        deadline = loop.time() + 2.0
        while (self.active or self.parsing) and loop.time() < deadline:
            await asyncio.sleep(poll_s)

    # -- validation -------------------------------------------------------
    def _check_model(self, name: str) -> None:
        if name and name not in self.served_names:
            raise NotFoundError(f"model {name!r} is not served here; this decoder serves {self.config.model!r}")

    def _sampling(self, pb: decoder_pb2.SamplingParams) -> SamplingParams:
        """Proto -> ``SamplingParams``; unset fields keep their defaults.

        Every field of the proto message must be listed here: an unknown one
        (added to the proto but not implemented) is refused, never ignored.

        Raises:
            InvalidRequestError: a field out of range (the message names it) or not implemented.
        """
        unknown = sorted({f.name for f, _ in pb.ListFields()} - _SCALAR_SAMPLING_FIELDS - _REPEATED_SAMPLING_FIELDS)
        if unknown:
            raise InvalidRequestError(f"sampling.{unknown[0]} is not supported by this server; leave it unset")
        kwargs = {f: getattr(pb, f) for f in _SCALAR_SAMPLING_FIELDS if pb.HasField(f)}
        kwargs.update({f: tuple(getattr(pb, f)) for f in _REPEATED_SAMPLING_FIELDS})
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            raise InvalidRequestError(f"sampling: {exc}") from exc
        vocab = self.model.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"sampling.stop_token_ids {bad} are outside the vocabulary [0, {vocab})")
        return params

    # -- engine callbacks (event loop) --------------------------------------
    def _on_encode(self, request_id: str, block_ids: list[int]) -> None:
        active = self.active.get(request_id)
        # An aborting request's engine.abort is queued behind the step that reserved these blocks: no Encode into them.
        if active is not None and not active.abort_requested:
            active.encoding = asyncio.create_task(self._encode(request_id, active, block_ids))

    def _on_output(self, output) -> None:
        active = self.active.get(output.request_id)
        if active is not None:
            active.stream.put_nowait(output)

    def _on_step_error(self, exc: BaseException) -> None:
        for active in self.active.values():
            active.stream.put_nowait(exc)

    async def _encode(self, request_id: str, active: _Active, block_ids: list[int]) -> None:
        """Has the encoder fill ``block_ids``; marks the request runnable, or fails its stream.

        With a transport that delivers on its own connection (torch_dist) the
        transfer is announced first and awaited after Encode answers; either
        way, once this returns no write for the request can still land in the
        pool, so ``_release`` may free the blocks. After a timeout that rests on
        the encoder: it starts no in-place (shm / cuda_ipc) write later than
        ``encoder_svc.batcher.WRITE_MARGIN_S`` before the call's deadline.
        """
        spec = self.pool.spec
        target = encoder_pb2.KVTarget(transport=spec.transport, segment=spec.segment, shape=spec.shape, dtype=spec.dtype, instance_id=spec.instance_id)
        transfer_id = next(self.transfer_ids)
        arrival = self.pool.expect(transfer_id, block_ids)
        try:
            if not active.window:  # a later window is encoded while the record stays DECODING
                await asyncio.to_thread(self.store.set_state, request_id, RequestState.ENCODING)
            inp = active.input
            source = {"input_ids": inp.input_ids} if inp.input_ids is not None else {"pcm": inp.pcm.astype("<f4").tobytes()}
            encode_start = time.monotonic()
            response = await self.encoder.Encode(
                encoder_pb2.EncodeRequest(request_id=request_id, model=self.config.model, block_ids=block_ids, target=target,
                                          transfer_id=transfer_id, **source),
                timeout=self.config.encode_timeout_s,
            )
            nbytes, ms = response.transfer_bytes, response.transfer_ms
            if arrival is not None:
                try:
                    stats = await asyncio.wait_for(asyncio.wrap_future(arrival), self.config.kv_transfer_timeout_s)
                except TimeoutError as exc:
                    raise UnavailableError(f"cross KV did not arrive within kv_transfer_timeout_s={self.config.kv_transfer_timeout_s:g} s") from exc
                nbytes, ms = stats.nbytes, stats.ms
            log.info("cross KV for %s: %d bytes in %.2f ms (%s, encoder batch %d)", request_id, nbytes, ms, spec.transport, response.batch_size)
            self.metrics.encode.observe(time.monotonic() - encode_start)
            self.metrics.observe_transfer(nbytes, ms)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # name the setting, not gRPC's "Stream removed"
                error = UnavailableError(f"encoder failed: no answer within encode_timeout_s={self.config.encode_timeout_s:g} s "
                                         "(encoder overloaded or hung)")
            else:
                error = UnavailableError(f"encoder failed: {exc.code().name}: {exc.details()}")
            active.stream.put_nowait(error)
            return
        except Exception as exc:  # noqa: BLE001 - reported on the request's stream
            active.stream.put_nowait(exc)
            return
        finally:
            if arrival is not None:  # blocks until no scatter for this transfer is in flight
                await asyncio.to_thread(self.pool.cancel, transfer_id)
        if active.abort_requested:
            return
        await asyncio.to_thread(self.store.set_state, request_id, RequestState.DECODING, **(active.usage() if active.window else {}))
        active.decoding_recorded = True
        await self.loop.call(self.engine.mark_encoded, request_id)

    # -- RPCs ---------------------------------------------------------------
    async def Generate(self, request, context):
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        self.parsing += 1  # the drain waits for it as for a running request
        try:
            if self.draining:
                raise UnavailableError("this decoder is shutting down; send the request to another replica")
            self._check_model(request.model)
            params = self._sampling(request.sampling)
            if len(request_id) > MAX_REQUEST_ID_LEN:
                raise InvalidRequestError(f"request_id is {len(request_id)} characters; the limit is {MAX_REQUEST_ID_LEN}")
            # Decoding and resampling audio takes a while: keep it off the event loop that serves every stream.
            inp = await asyncio.to_thread(parse_input, request, self.model, self.engine.tokenizer, self.config.max_audio_s)
            if max(params.n, params.num_beams) > 1 and len(inp.windows()) > 1:
                raise InvalidRequestError("sampling.n > 1 / num_beams > 1 are not supported for audio over 30 s "
                                          "(decoded window by window); send n=1 and num_beams=1, or a shorter clip")
            if request_id in self.active:
                raise AlreadyExistsError(f"request id {request_id!r} is already running")
            ours = request_id not in self.open_records  # else a call with this id is still parsing here
            self.open_records.add(request_id)  # before the await: a cancel during it still leaves it to close()
            try:
                await asyncio.to_thread(self.store.create, request_id, self.config.model)
            except RequestExistsError as exc:
                if ours:
                    self.open_records.discard(request_id)  # another replica's (or an earlier) record
                raise AlreadyExistsError(f"request id {request_id!r} was already used; pick a new one") from exc
        except Exception as exc:  # noqa: BLE001 - nothing reserved yet
            await abort_with(context, exc)
        finally:
            self.parsing -= 1
        active = self.active[request_id] = _Active(inp, arrival=arrival)
        state, fields = RequestState.FAILED, {}
        released = False  # an error is recorded (FAILED) and its blocks freed before the client sees its status
        try:
            if self.cutting:  # its input was parsed after the grace ran out
                raise self._shutdown_error(request_id, active)
            windows = inp.windows()
            await self._start_window(request_id, active, windows[0], params, request.priority)
            finished_indices: set[int] = set()  # n > 1 / beams: the request ends with its last index (or an abort)
            coalesce = _Coalescer(self.config.stream_interval if params.num_beams == 1 else 1)
            while True:
                got = await active.stream.get()
                if isinstance(got, BaseException):
                    raise got
                for item in _each_unfinished_sample(got, params.n, finished_indices):
                    if not active.decoding_recorded and active.encoding is None and item.finish_reason != "abort":
                        # An encoder-cache hit decodes over another request's cross KV without an Encode of its own.
                        active.decoding_recorded = True
                        await asyncio.to_thread(self.store.set_state, request_id, RequestState.DECODING)
                    active.count(item)
                    self._observe_tokens(active, len(item.new_token_ids))
                    text = active.stream_text(item.text)
                    reason = self._request_finish_reason(active, item, params, len(windows)) if item.finished else None
                    final = item.finished and reason is not None  # this index's last message
                    if final:
                        finished_indices.add(item.index)
                    request_done = final and len(finished_indices) >= params.n
                    message = decoder_pb2.GenerateResponse(request_id=request_id, text=text, token_ids=item.new_token_ids,
                                                           index=item.index, score=item.score)
                    if item.logprobs:
                        message.logprobs.extend(_logprobs_pb(lp) for lp in item.logprobs)
                    if final:
                        message.finish_reason = FINISH_REASONS[reason]
                        if isinstance(item.stop_reason, str):
                            message.stop_str = item.stop_reason
                        elif item.stop_reason is not None:
                            message.stop_token_id = item.stop_reason
                    if request_done:
                        message.usage.CopyFrom(decoder_pb2.Usage(encoder_tokens=active.encoder_tokens, **active.usage()))
                        message.applied_generation_defaults.extend(inp.applied)
                        state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
                        fields = {"finish_reason": reason, **active.usage()}
                    # Every sample's final message flushes what the coalescer held for it (an abort ends each one).
                    if text or item.new_token_ids or final:
                        if (out := coalesce.add(message, len(item.new_token_ids), final)) is not None:
                            yield out
                    if request_done:
                        return
                    if item.finished and reason is None and not active.abort_requested:  # the next window follows (unless the Abort RPC's output is queued next)
                        await self._start_window(request_id, active, windows[active.window + 1], params, request.priority)
        except (asyncio.CancelledError, GeneratorExit):  # client went away (GeneratorExit: cancelled while paused at a yield)
            state, fields = RequestState.ABORTED, {"finish_reason": "abort", **active.usage()}
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            fields = {"error": str(exc), **active.usage()}
            released = True
            await self._release(request_id, active, state, fields)
            await abort_with(context, exc)
        finally:
            if not released:
                await self._release(request_id, active, state, fields)

    async def _start_window(self, request_id: str, active: _Active, window: RequestInput, params: SamplingParams, priority: int) -> None:
        """Adds the request's first or next window to the engine as a new sequence (its cross blocks are
        reserved at a later step; the previous window's sequence has finished and freed its blocks).

        A later window gets what is left of ``max_tokens`` / ``min_tokens``.

        Raises:
            ResourceExhaustedError: the window can never fit this decoder's KV pools.
        """
        if active.encoder_tokens:  # not the first window
            active.window += 1
            active.base_prompt_tokens, active.base_completion_tokens = active.prompt_tokens, active.completion_tokens
            active.window_text_started = False
            done = active.completion_tokens
            params = dataclasses.replace(params, max_tokens=None if params.max_tokens is None else params.max_tokens - done,
                                         min_tokens=max(params.min_tokens - done, 0))
        active.input = window
        active.encoder_tokens += window.encoder_len
        cache_key = await asyncio.to_thread(self._encoder_cache_key, window) if self.config.encoder_cache else None
        try:
            await self.loop.call(self.engine.add_request, request_id, window.encoder_len, params, window.prompt_token_ids,
                                 priority, cache_key)
        except CapacityError as exc:
            raise ResourceExhaustedError(str(exc)) from exc

    def _request_finish_reason(self, active: _Active, item: RequestOutput, params: SamplingParams, num_windows: int) -> str | None:
        """The request's finish reason once a window's sequence finished, or None when the next window follows.

        The next window follows a window that ended on the end token (or the
        model max length) while windows and ``max_tokens`` are left; a stop
        string / stop token id / abort ends the request, and so does
        ``max_tokens`` used up ("length").
        """
        reason = item.finish_reason
        window_end = reason == "length" or (item.stop_reason == self.engine.eos_token_id and not params.ignore_eos)
        if reason == "abort" or not window_end or active.window + 1 >= num_windows:
            return reason
        if params.max_tokens is not None and active.completion_tokens >= params.max_tokens:
            return "length"
        return None

    def _encoder_cache_key(self, inp: RequestInput) -> str:
        """Content key of the request's encoder input: the PCM bytes Encode would get, or the source ids."""
        if inp.input_ids is not None:
            return encoder_cache_key(self.config.model, input_ids=list(inp.input_ids))
        return encoder_cache_key(self.config.model, pcm=inp.pcm.astype("<f4").tobytes())

    def _observe_tokens(self, active: _Active, num_tokens: int) -> None:
        """Time to first token on a request's first tokens, then one time-per-output-token sample per token."""
        if not num_tokens:
            return
        now = time.monotonic()
        if active.last_token_at is None:
            self.metrics.ttft.observe(now - active.arrival)
        else:
            for _ in range(num_tokens):
                self.metrics.tpot.observe((now - active.last_token_at) / num_tokens)
        active.last_token_at = now

    async def _release(self, request_id: str, active: _Active, state: RequestState, fields: dict) -> None:
        """Frees the request's blocks (after any in-flight Encode wrote them) and records its end."""
        self.metrics.requests.labels(state=state.name.lower(), finish_reason=fields.get("finish_reason", "")).inc()
        active.abort_requested = True
        if active.encoding is not None and not active.encoding.done() and not self.cutting:
            # The encoder may still write into the reserved cross blocks: keep them until it answers. (Shutting
            # down, no request can get them again: every running one is being ended and new ones are refused.)
            # The running requests no longer wait for this one (decode hold).
            await self.loop.call(self.loop.release_hold, request_id)
            await asyncio.wait([active.encoding])
        await self.loop.call(self.engine.abort, request_id)
        self.active.pop(request_id, None)
        try:
            await asyncio.to_thread(self.store.set_state, request_id, state, **fields)
        except Exception:  # noqa: BLE001 - the stream's outcome stands; log the lost record
            log.exception("could not record %s for %s", state.name, request_id)
        self.open_records.discard(request_id)

    async def GetRequest(self, request, context):
        record = await asyncio.to_thread(self.store.get, request.request_id)
        if record is None:
            shown = request.request_id if len(request.request_id) <= MAX_REQUEST_ID_LEN else request.request_id[:MAX_REQUEST_ID_LEN] + "..."
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {shown!r} (unknown or expired)")
        return decoder_pb2.RequestRecord(
            request_id=record.request_id,
            state=getattr(decoder_pb2, f"REQUEST_STATE_{record.state.name}"),
            model=record.model,
            created_at=record.created_at,
            updated_at=record.updated_at,
            prompt_tokens=record.prompt_tokens or 0,
            completion_tokens=record.completion_tokens or 0,
            finish_reason=record.finish_reason or "",
            error=record.error or "",
        )

    async def Abort(self, request, context):
        active = self.active.get(request.request_id)
        if active is None:
            return decoder_pb2.AbortResponse(aborted=False)
        active.abort_requested = True
        active.stream.put_nowait(RequestOutput(request.request_id, [], "", True, "abort", **active.usage()))
        return decoder_pb2.AbortResponse(aborted=True)

    async def GetStats(self, request, context):
        stats = await self.loop.call(self.engine.stats)
        stats["max_concurrent_requests"] = self.max_concurrent_requests
        return decoder_pb2.DecoderStats(**{k: int(v) for k, v in stats.items() if k in decoder_pb2.DecoderStats.DESCRIPTOR.fields_by_name})


def _each_unfinished_sample(item, n: int, finished: set[int]) -> list:
    """``[item]``; the Abort RPC's one output (index 0) becomes one per sample still running, so each of
    ``n > 1`` samples ends with its own ABORT and a sample that already finished gets no second final message."""
    if item.finish_reason != "abort" or n <= 1:
        return [item]
    return [dataclasses.replace(item, index=i) for i in range(n) if i not in finished] or [item]


def _logprobs_pb(lp) -> decoder_pb2.Logprobs:
    """``decoder_svc.sampler.TokenLogprobs`` -> its proto message."""
    return decoder_pb2.Logprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                top=[decoder_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top])
