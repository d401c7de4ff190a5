"""One ``GET /v1/realtime`` WebSocket after its handshake (``gateway_svc.routes.realtime``): client events in,
one decoder ``TranscribeStream`` call per stream of audio, server events out.

A stream opens at the first ``input_audio_buffer.append``, with the session as it is then (``realtime_session``);
``input_audio_buffer.commit`` / ``.clear`` become its COMMIT / CLEAR controls, and a final commit
(``{"final": true}``, vLLM's end of input) half-closes it: its tail is flushed, ``transcription.done`` ends it, and
the next append opens another. A bad client event is an ``error`` event and the session goes on; a gRPC status from
the decoder is an ``error`` event, then the close (``realtime_events.close_code``). The socket closing cancels the
call, so the decoder frees the stream at once.

Server events wait in a bounded queue (``OUT_QUEUE_EVENTS``): a client that does not read stops the gateway reading
the decoder's stream (gRPC flow control then holds the decoder back), and audio the decoder does not take yet
stops the gateway reading the socket; the gateway's memory per session stays bounded either way. A session has
no deadline (``request_timeout_s`` is for one request); it lasts until either side closes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import orjson
from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from gateway_svc.backends import Backend, Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import (
    INTERNAL_MESSAGE,
    GatewayError,
    building_request,
    from_rpc_error,
    request_id,
)
from gateway_svc.realtime_events import (
    EventError,
    Translator,
    close_code,
    decode_audio,
    done_event,
    error_event,
    event,
    new_id,
    parse_client_event,
)
from gateway_svc.realtime_session import SessionConfig, apply_update, changed_fields, realtime_config, session_object
from shared.models.whisper_specials import language_code
from shared.proto import decoder_pb2

log = logging.getLogger(__name__)

ENDPOINT = "/v1/realtime"
OUT_QUEUE_EVENTS = 64  # server events waiting for a slow client; beyond it the decoder's stream waits
CLOSE_TIMEOUT_S = 5.0  # to hand a failed session's error event and close frame to a client that reads slowly
Request = decoder_pb2.TranscribeStreamRequest


@dataclass(frozen=True)
class _Close:
    code: int
    reason: str


@dataclass
class _Stream:
    """One ``TranscribeStream`` call and the task reading it."""

    call: grpc.aio.StreamStreamCall
    translator: Translator
    pump: asyncio.Task | None = None
    half_closed: bool = False  # the client's final commit: no more writes
    # Set once the decoder answered the config (its started event) or the call ended: audio is written only then,
    # so a refusal at open (bad config, a full decoder) reaches the client as sent. grpcio's asyncio client
    # replaces the server's status with INTERNAL "Internal error from Core" when a write fails because the call
    # already ended (grpc/grpc#36066).
    opened: asyncio.Event = field(default_factory=asyncio.Event)


class RealtimeConnection:
    """One accepted WebSocket: a reader of client events, a writer of server events and, while audio streams, a
    pump of the decoder's events into the writer's queue."""

    def __init__(self, websocket: WebSocket, backends: Backends, cfg: GatewayConfig) -> None:
        query = websocket.query_params
        self.ws, self.backends, self.cfg = websocket, backends, cfg
        self.query_model = (query.get("model") or "").strip()
        self.partials = (query.get("partials") or "").lower() in ("1", "true")
        beta = "realtime=v1" in websocket.headers.get("openai-beta", "")
        transcription = beta and query.get("intent") == "transcription"
        self.created = "transcription_session.created" if transcription else "session.created"
        self.session_id = new_id("sess")
        self.config = SessionConfig()
        self.style = "openai"  # "vllm" from the first session.update of vLLM's shape on
        self.out: asyncio.Queue = asyncio.Queue(OUT_QUEUE_EVENTS)
        self.stream: _Stream | None = None
        self.last_item_id: str | None = None  # the last item of the previous streams
        self.closing = False  # a fatal error: its event and the close are queued
        self._odd = b""  # a PCM16 sample's first byte that ended an append
        self._opened = 0  # streams opened: the n-th is request "<session id>-<n>" on the decoder

    async def run(self) -> None:
        """Serves the socket until the client closes it or the session fails; the decoder's call is cancelled."""
        session = session_object(self.config, self.session_id)
        await self.out.put(event(self.created, session=session, id=self.session_id, created=int(time.time())))
        reader = asyncio.create_task(self._read())
        writer = asyncio.create_task(self._write())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if self.closing and not writer.done():
                await asyncio.wait({writer}, timeout=CLOSE_TIMEOUT_S)
        finally:
            tasks = [reader, writer]
            if self.stream is not None:
                self.stream.call.cancel()
                tasks.append(self.stream.pump)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self) -> None:
        while not self.closing:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            client_event_id = None
            try:
                text = message.get("text")
                if text is None:
                    raise EventError(
                        "binary frames are not events: send JSON text events (audio as base64 in "
                        "input_audio_buffer.append)",
                        code="invalid_event",
                    )
                if len(text) > self.cfg.max_request_bytes:
                    raise EventError(
                        f"the event is over this server's limit of {self.cfg.max_request_bytes / 1e6:g} MB "
                        "(--max-request-mb); send the audio in smaller appends",
                        code="event_too_large",
                    )
                client_event = parse_client_event(text)
                if isinstance(client_event.get("event_id"), str):
                    client_event_id = client_event["event_id"]
                await self._handle(client_event)
            except GatewayError as exc:  # the client's event is refused; the session goes on
                await self.out.put(error_event(exc, client_event_id))
            except Exception:
                await self._fail(self._internal_error())

    async def _handle(self, client_event: dict) -> None:
        kind = client_event["type"]
        if kind in ("session.update", "transcription_session.update"):
            await self._update(kind, client_event)
        elif kind == "input_audio_buffer.append":
            await self._append(decode_audio(client_event))
        elif kind == "input_audio_buffer.commit":
            final = client_event.get("final", False)
            if not isinstance(final, bool):
                raise EventError(f"final must be true or false, got {final!r}", "final")
            await self._commit(final)
        elif kind == "input_audio_buffer.clear":
            await self._clear()
        else:
            raise EventError(
                f"unknown event type {kind!r}: a transcription session takes session.update, "
                "transcription_session.update and input_audio_buffer.append / .commit / .clear",
                "type",
                "unknown_event",
            )

    async def _update(self, kind: str, update: dict) -> None:
        new, shape = apply_update(self.config, update)
        if self.stream is not None and (changed := changed_fields(self.config, new)):
            raise EventError(
                f"{', '.join(changed)} cannot change while audio streams: the stream took the session as it was "
                "at its first append; update before the audio, or after a final commit's transcription.done",
                f"session.{changed[0]}",
                "session_locked",
            )
        if new.model and new.model != self.config.model:  # an unknown model is refused now, not at the first append
            backend = await self.backends.lookup(new.model, ("audio",), ENDPOINT)
            if self.backends.find(new.model) is None:  # the only speech backend, which does not serve the name
                raise GatewayError(
                    404,
                    f"model {new.model!r} is not served here; the speech model is {backend.model!r}",
                    "model",
                    "model_not_found",
                )
        if shape == "vllm":
            self.style = "vllm"
        self.config = new
        if self.style == "openai":  # vLLM answers no update
            session = session_object(self.config, self.session_id)
            await self.out.put(event(kind.replace(".update", ".updated"), session=session))

    async def _append(self, audio: bytes) -> None:
        data = self._odd + audio
        whole = len(data) - len(data) % 2
        data, self._odd = data[:whole], data[whole:]
        if not data:
            return
        if self.stream is not None and self.stream.half_closed:  # the last stream's tail and done come first
            await asyncio.wait({self.stream.pump})
        if self.closing:
            return
        if self.stream is None:
            self.stream = await self._open()
        if self.stream is not None:
            await self._write_call(self.stream, Request(audio=data))

    async def _commit(self, final: bool) -> None:
        stream = self.stream
        if final:  # vLLM's end of input: half-close; a stream already closing has its done coming
            self._odd = b""
            if stream is None:
                await self.out.put(done_event(""))
            elif not stream.half_closed:
                stream.half_closed = True
                try:
                    await stream.call.done_writing()
                except (grpc.RpcError, asyncio.InvalidStateError):
                    await asyncio.wait({stream.pump})  # the call ended: the pump reports how
        elif stream is not None and not stream.half_closed:
            await self._write_call(stream, Request(control=decoder_pb2.REALTIME_CONTROL_COMMIT))
        elif self.style == "openai":  # vLLM's first commit (before any audio) only says "start"
            raise EventError(
                "the input audio buffer is empty: append audio before committing",
                code="input_audio_buffer_commit_empty",
            )

    async def _clear(self) -> None:
        self._odd = b""
        if self.stream is not None and not self.stream.half_closed:
            await self._write_call(self.stream, Request(control=decoder_pb2.REALTIME_CONTROL_CLEAR))
        if self.style == "openai":
            await self.out.put(event("input_audio_buffer.cleared"))

    async def _open(self) -> _Stream | None:
        """A new call with the session as it is now; None (the session failing) if there is no backend for it."""
        try:
            backend, model = await self._backend()
            language = await asyncio.to_thread(language_code, self.config.language) if self.config.language else ""
            with building_request("session.input_audio_transcription.prompt"):
                request_id = f"{self.session_id}-{self._opened}"
                first = realtime_config(
                    self.config, model=model, language=language, partials=self.partials, request_id=request_id
                )
        except GatewayError as exc:
            await self._fail(exc)
            return None
        self._opened += 1
        stream = _Stream(backend.decoder.TranscribeStream(), Translator(self.style, self.partials, self.last_item_id))
        stream.pump = asyncio.create_task(self._pump(stream))
        self.stream = stream  # before the first await: a session ending now cancels this call too
        await self._write_call(stream, Request(config=first))
        return stream

    async def _backend(self) -> tuple[Backend, str]:
        """The backend of the session's model and the name it knows it by ("" = its served model).

        Raises:
            GatewayError: as ``Backends.lookup``; 503 no speech model answers; 400 several and none named.
        """
        name = self.config.model or self.query_model
        if name:
            return await self.backends.lookup(name, ("audio",), ENDPOINT), self.backends.wire_name(name)
        speech = [b for b in self.backends.models.values() if b.kind == "audio"]
        if not speech and await self.backends.rediscover():
            speech = [b for b in self.backends.models.values() if b.kind == "audio"]
        if len(speech) == 1:
            return speech[0], ""
        if not speech:
            raise GatewayError(503, "no speech model answers here (no Whisper decoder); retry later")
        names = ", ".join(sorted(b.model for b in speech))
        raise GatewayError(
            400,
            f"several speech models are served ({names}): name one in the session's transcription model or ?model=",
            "model",
        )

    async def _write_call(self, stream: _Stream, request: decoder_pb2.TranscribeStreamRequest) -> None:
        """``request`` onto the call (waits while gRPC's flow control says the decoder is behind; anything after
        the config waits for the decoder's answer to it, ``_Stream.opened``)."""
        try:
            if not request.HasField("config"):
                await stream.opened.wait()
            await stream.call.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError):
            await asyncio.wait({stream.pump})  # the call ended: the pump reports how

    async def _pump(self, stream: _Stream) -> None:
        """The decoder's events as server events, until the call ends; a status ends the session."""
        try:
            await self._pump_events(stream)
        finally:
            stream.opened.set()  # a call that ended: writes fail at once, and the pump has said how

    async def _pump_events(self, stream: _Stream) -> None:
        try:
            while (response := await stream.call.read()) is not grpc.aio.EOF:
                stream.opened.set()
                for server_event in stream.translator.events(response):
                    await self.out.put(server_event)  # waits while the client reads slowly
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            err.code = err.code or (exc.code().name.lower() if hasattr(exc, "code") else None)
            await self._fail(err)
            return
        except Exception:
            await self._fail(self._internal_error())
            return
        self.last_item_id = stream.translator.last_item_id
        if self.stream is stream:
            self.stream = None
        if not stream.half_closed:
            await self._fail(
                GatewayError(502, "the decoder ended the realtime stream before the client's final commit")
            )

    def _internal_error(self) -> GatewayError:
        """The 500 of an unexpected exception (called in its ``except``): logged with the traceback and the request
        id; the client gets the stable message and the id (issue 34 item 8)."""
        rid = request_id()
        log.exception("realtime session %s (request id %s)", self.session_id, rid)
        return GatewayError(500, f"{INTERNAL_MESSAGE} (request id {rid})")

    async def _fail(self, err: GatewayError) -> None:
        """Ends the session: ``err`` as an ``error`` event, then the close."""
        if self.closing:
            return
        self.closing = True
        log.info("realtime session %s ends: %s %s", self.session_id, err.status, err.message)
        reason = err.message.encode()[:120].decode(errors="ignore")  # a close reason is at most 123 bytes
        await self.out.put(error_event(err))
        await self.out.put(_Close(close_code(err.status), reason))

    async def _write(self) -> None:
        try:
            while True:
                item = await self.out.get()
                if isinstance(item, _Close):
                    await self.ws.close(item.code, item.reason)
                    return
                await self.ws.send_text(orjson.dumps(item).decode())
        except (WebSocketDisconnect, RuntimeError, OSError):  # the client went away
            return
