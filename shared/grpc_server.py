"""Serving plumbing both services share: health, errors to status codes, shutdown, and a public port's
security (bearer token, TLS, per-client limit: ``shared.public_port``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from shared.client_limits import HealthWatchLimitInterceptor
from shared.config.base import ServiceConfig
from shared.errors import BindError, InvalidRequestError, status_for
from shared.public_port import port_credentials, public_port_security, security_summary

log = logging.getLogger(__name__)

# A readiness probe: None when the service can serve, else why not (logged, health NOT_SERVING).
Readiness = Callable[[], Awaitable[str | None]]

# Cross-attention KV never travels in gRPC, but audio does: allow a few minutes of float32 PCM.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would then bind
    # too and the kernel would split connections between the two (a decoder's clients
    # reaching an encoder get UNIMPLEMENTED). Without it a taken port fails the start.
    ("grpc.so_reuseport", 0),
]


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Ends the call with the status ``status_for(exc)`` gives (never returns)."""
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
    await context.abort(code, message)


def _passes_through(exc: BaseException) -> bool:
    """True for what must leave a handler as it is: ``context.abort``'s own exception and cancellation."""
    return isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)) or not isinstance(exc, Exception)


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """The one place a servicer's exception becomes a gRPC status, for every RPC of a server.

    A handler raises (``shared.errors.ServiceError`` subclasses, ``ValueError``,
    anything else); the call then ends with the code and message
    ``shared.errors.status_for`` gives, an INTERNAL one logged with its
    traceback. A status the handler set itself (``context.abort``) and a
    cancellation pass through unchanged. A request body that is not a valid
    protobuf gets INVALID_ARGUMENT naming the message. Unary-unary, unary-stream and stream-stream handlers
    (async generators; a bidirectional call's every request message checked as it is read) are wrapped; of others, such as health's ``Watch``
    (``context.write``), only the request body is checked.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        deserializer = _lenient(handler.request_deserializer, handler_call_details.method)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    if isinstance(request, BadRequestBody):
                        raise InvalidRequestError(request.message)
                    return await inner(request, context)
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await abort_with(context, exc)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    if isinstance(request, BadRequestBody):
                        raise InvalidRequestError(request.message)
                    async for message in inner_stream(request, context):
                        yield message
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await abort_with(context, exc)

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, handler.response_serializer)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            inner_bidi = handler.stream_stream

            async def checked(requests):
                async for request in requests:
                    if isinstance(request, BadRequestBody):
                        raise InvalidRequestError(request.message)
                    yield request

            async def stream_stream(requests, context):
                try:
                    async for message in inner_bidi(checked(requests), context):
                        yield message
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await abort_with(context, exc)

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, handler.response_serializer)
        if handler.unary_stream is not None:  # writes with context.write (health's Watch): only the body is checked
            inner_writer = handler.unary_stream

            async def unary_stream_writer(request, context):
                if isinstance(request, BadRequestBody):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner_writer(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, deserializer, handler.response_serializer)
        return handler


class BadRequestBody:
    """What ``_lenient``'s deserializer returns for bytes that do not parse; the wrapped handler refuses it."""

    def __init__(self, message: str) -> None:
        self.message = message


@functools.lru_cache(maxsize=256)
def _request_message_name(method: str) -> str:
    """``/pkg.Service/Method`` -> the full name of the message it takes (``"request"`` if the method is unknown)."""
    service, _, name = method.strip("/").rpartition("/")
    try:
        return descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name).input_type.full_name
    except (KeyError, AttributeError):
        return "request"


def _lenient(deserializer, method: str):
    """``deserializer`` returning a ``BadRequestBody`` instead of raising: a body that is not a valid protobuf then
    ends with INVALID_ARGUMENT (grpc's own handling of a raising deserializer answers UNKNOWN, "Unexpected
    DecodeError")."""
    if deserializer is None:
        return None
    message_name = _request_message_name(method)

    def deserialize(body: bytes):
        try:
            return deserializer(body)
        except DecodeError as exc:
            return BadRequestBody(
                f"the request is not a valid {message_name} protobuf ({exc}); send {method}'s message"
            )

    return deserialize


async def serve(
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    address: str,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    readiness: Readiness | None = None,
    readiness_interval_s: float = 1.0,
    on_serving: Callable[[], Awaitable[None]] | None = None,
    *,
    config: ServiceConfig | None = None,
    public: bool = True,
    extra_interceptors: list[grpc.aio.ServerInterceptor] | None = None,
) -> None:
    """Runs a grpc.aio server with the standard health service until SIGINT/SIGTERM.

    Args:
        add_servicers: registers the service's servicers on the server.
        service_names: full names reported by health checks (plus "").
        address: ``host:port`` to bind.
        on_stop: awaited after the server stops accepting calls.
        drain: awaited on SIGTERM / SIGINT after health turns NOT_SERVING and
            before the server stops: it ends the calls still running, each
            with a status of its own (else the stop cancels them after 2 s).
        readiness: None: health says SERVING from the start. Else an async probe run
            once after the server started and then every ``readiness_interval_s``
            seconds: it returns None when the service can serve (health SERVING) or
            a reason it cannot (NOT_SERVING, the reason logged once per change); a
            probe that raises counts as not ready. Health is NOT_SERVING until the
            first probe answers, and for good once the shutdown begins.
        readiness_interval_s: seconds between two readiness probes.
        on_serving: awaited once the server takes calls (bound, started, signals handled): a replica registers
            in the registry then (``shared.registration``), so it is never listed before it can be called.
        config: the service's settings: ``max_message_bytes`` (largest message received or sent) and, on a
            ``public`` port, the bearer token (``auth_token_file`` / ``auth_token``, ``shared.public_auth``), TLS
            (``tls_cert``, ``tls_key``, ``tls_client_ca`` for mutual TLS: ``shared.tls``) and
            ``max_requests_per_client`` (``shared.client_limits``); on every port ``max_concurrent_rpcs``. None: ``GRPC_OPTIONS``, none of the rest.
        public: False for an internal port (the encoder's Encode, which has its own token,
            ``shared.internal_auth``): no bearer token, no per-client limit; TLS when ``config.tls_cert`` is set.
        extra_interceptors: run first on every call (the encoder's internal token check,
            ``shared.internal_auth.InternalTokenInterceptor``). Every port also limits health ``Watch`` streams per
            client (``shared.client_limits.HealthWatchLimitInterceptor``).
        ``config.health_port``, when set, serves the same health service alone on a plaintext port of ``address``'s
        host (probes that cannot speak TLS).

    Raises:
        BindError: the address cannot be bound.
        ValueError: the token file or a TLS file cannot be read or is not usable (the message names the setting).
    """
    interceptors, credentials = public_port_security(config) if public else ([], port_credentials(config))
    interceptors = [*(extra_interceptors or []), *interceptors, HealthWatchLimitInterceptor()]
    server = grpc.aio.server(
        options=server_options(config),
        interceptors=[*interceptors, ErrorStatusInterceptor()],
        maximum_concurrent_rpcs=(config.max_concurrent_rpcs or None) if config is not None else None,
    )
    add_servicers(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = ["", *service_names]
    if readiness is not None:  # not SERVING before the first probe says so
        await _set_health(health, names, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        bound = (
            server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
        )
    except RuntimeError:  # grpc raises on a failed bind; older versions return 0
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {address}: the port is taken by another process or the host is not local")
    await server.start()
    health_server = None
    if config is not None and config.health_port:
        try:
            health_server = await _serve_health(health, address, config.health_port)
        except BindError:
            await server.stop(grace=None)  # the main port is bound already: close it before the start fails
            raise
    watcher = None
    if readiness is None:
        await _set_health(health, names, health_pb2.HealthCheckResponse.SERVING)
    else:
        watcher = asyncio.create_task(_watch_readiness(health, names, readiness, readiness_interval_s))
    log.info(
        "serving %s on %s:%d%s",
        ", ".join(service_names),
        address.rpartition(":")[0],
        bound,  # port 0: the one picked
        security_summary(config, public, credentials is not None, interceptors),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_serving is not None:
        await on_serving()
    await stop.wait()
    log.info("shutting down")
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    await health.enter_graceful_shutdown()
    if drain is not None:
        await drain()
    await server.stop(grace=2.0)
    if health_server is not None:
        await health_server.stop(grace=None)
    if on_stop is not None:
        await on_stop()


async def _serve_health(health: HealthServicer, address: str, port: int) -> grpc.aio.Server:
    """Starts a plaintext server on ``address``'s host and ``port`` with ``health`` as its only service.

    Raises:
        BindError: the port cannot be bound.
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    target = f"{address.rpartition(':')[0]}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {target} (health_port): the port is taken by another process")
    await server.start()
    log.info("health only (plaintext) on %s", target)
    return server


def server_options(config: ServiceConfig | None) -> list[tuple]:
    """``GRPC_OPTIONS`` with ``config.max_message_bytes`` as the receive and send limits (None: as they are)."""
    if config is None:
        return list(GRPC_OPTIONS)
    limits = ("grpc.max_receive_message_length", "grpc.max_send_message_length")
    return [(k, config.max_message_bytes if k in limits else v) for k, v in GRPC_OPTIONS]


async def _set_health(health: HealthServicer, names: list[str], status) -> None:
    for name in names:
        await health.set(name, status)


async def _watch_readiness(
    health: HealthServicer, names: list[str], readiness: Readiness, interval_s: float, startup_grace_s: float = 30.0
) -> None:
    """Sets every name's health from ``readiness`` every ``interval_s`` seconds, logging each change.

    Not ready at start is the normal order of a start (a decoder up before its encoder): logged at INFO, and as a
    WARNING only if it lasts ``startup_grace_s`` seconds; losing readiness later is a WARNING at once."""
    serving: bool | None = None
    started, ever_ready, warned = time.monotonic(), False, False
    while True:
        try:
            reason = await readiness()
        except Exception as exc:  # noqa: BLE001 - a broken probe is a reason not to serve, not a crash
            reason = f"readiness probe failed: {type(exc).__name__}: {exc}"
        ready = reason is None
        if ready != serving:
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            await _set_health(health, names, status)
            if ready:
                log.info("ready: health SERVING")
                warned = False
        if not ready and not warned:
            if ever_ready or time.monotonic() - started >= startup_grace_s:
                log.warning("not ready (health NOT_SERVING): %s", reason)
                warned = True
            elif serving is None:
                log.info("not ready yet (health NOT_SERVING): %s", reason)
        ever_ready = ever_ready or ready
        serving = ready
        await asyncio.sleep(interval_s)
