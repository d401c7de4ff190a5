"""Serving plumbing both services share: health, errors to status codes, shutdown."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from shared.errors import BindError, status_for

log = logging.getLogger(__name__)

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
    cancellation pass through unchanged. Unary-unary and unary-stream handlers
    (async generators) are wrapped; others, such as health's ``Watch``
    (``context.write``), are left as they are.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await abort_with(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for message in inner_stream(request, context):
                        yield message
                except BaseException as exc:
                    if _passes_through(exc):
                        raise
                    await abort_with(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


async def serve(
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    address: str,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Runs a grpc.aio server with the standard health service until SIGINT/SIGTERM.

    Args:
        add_servicers: registers the service's servicers on the server.
        service_names: full names reported SERVING by health checks (plus "").
        address: ``host:port`` to bind.
        on_stop: awaited after the server stops accepting calls.
        drain: awaited on SIGTERM / SIGINT after health turns NOT_SERVING and
            before the server stops: it ends the calls still running, each
            with a status of its own (else the stop cancels them after 2 s).

    Raises:
        BindError: the address cannot be bound.
    """
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[ErrorStatusInterceptor()])
    add_servicers(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc raises on a failed bind; older versions return 0
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {address}: the port is taken by another process or the host is not local")
    await server.start()
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "serving %s on %s:%d", ", ".join(service_names), address.rpartition(":")[0], bound
    )  # port 0: the one picked
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await health.enter_graceful_shutdown()
    if drain is not None:
        await drain()
    await server.stop(grace=2.0)
    if on_stop is not None:
        await on_stop()
