"""The per-client limit of a public gRPC port: at most N calls in flight from one client address.

``ClientLimitInterceptor`` counts the calls running per peer IP (``context.peer()``: ``ipv4:1.2.3.4:5678``,
``ipv6:[::1]:5678``); a call past ``max_requests_per_client`` ends at once with RESOURCE_EXHAUSTED naming the
limit and its flag. A call's slot is released when its handler ends however it ends (answered, failed, cancelled
by the client, a stream closed early). Health and reflection calls, and the control calls that do no work
(``CONTROL_METHODS``: GetRequest, Abort, GetStats, Tokenize), are neither counted nor limited: a client at its
limit can still abort, poll and be monitored. Behind a proxy or the HTTP gateway every call comes from the proxy's
address: size the limit for it (it bounds that proxy's calls in flight in all), or set 0 (off).
"""

from __future__ import annotations

import contextlib
import inspect

import grpc

from shared.public_auth import is_open_method

# Calls that do no model work: never counted (an Abort must get through to a client at its limit).
CONTROL_METHODS = frozenset(
    {
        "/encdec.v1.DecoderService/GetRequest",
        "/encdec.v1.DecoderService/Abort",
        "/encdec.v1.DecoderService/GetStats",
        "/encdec.v1.EmbedService/Tokenize",
    }
)


def peer_ip(peer: str) -> str:
    """The client address of a gRPC peer string: ``ipv4:1.2.3.4:5678`` -> ``1.2.3.4``, ``ipv6:[::1]:5678`` ->
    ``::1``; anything else (``unix:...``) as it is."""
    scheme, sep, rest = peer.partition(":")
    if not sep:
        return peer
    if scheme == "ipv6" and rest.startswith("["):
        return rest[1:].partition("]")[0]
    if scheme == "ipv4":
        return rest.rpartition(":")[0] or rest
    return peer


class ClientLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a client's call while ``max_in_flight`` of its calls run (RESOURCE_EXHAUSTED).

    Used on the server's event loop only (grpc.aio): the counts need no lock.

    Args:
        max_in_flight: most calls in flight per client IP (>= 1).
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.in_flight: dict[str, int] = {}  # client IP -> calls running

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open_method(method) or method in CONTROL_METHODS:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._counted(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            wrapped = self._counted_stream(inner) if inspect.isasyncgenfunction(inner) else self._counted(inner)
            return grpc.unary_stream_rpc_method_handler(
                wrapped, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._counted(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        inner = handler.stream_stream
        wrapped = self._counted_stream(inner) if inspect.isasyncgenfunction(inner) else self._counted(inner)
        return grpc.stream_stream_rpc_method_handler(wrapped, handler.request_deserializer, handler.response_serializer)

    async def _enter(self, context: grpc.aio.ServicerContext) -> str:
        """Takes a slot for the call's client, or ends the call with RESOURCE_EXHAUSTED (``context.abort``)."""
        ip = peer_ip(context.peer() or "")
        running = self.in_flight.get(ip, 0)
        if running >= self.max_in_flight:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{running} calls from {ip} are in flight; this server runs at most {self.max_in_flight} at once per "
                "client address (--max-requests-per-client): wait for one to end, or retry later",
            )
        self.in_flight[ip] = running + 1
        return ip

    def _leave(self, ip: str) -> None:
        left = self.in_flight.get(ip, 0) - 1
        if left > 0:
            self.in_flight[ip] = left
        else:
            self.in_flight.pop(ip, None)

    def _counted(self, inner):
        """``inner`` (a coroutine handler) holding a slot while it runs."""

        async def handler(request, context):
            ip = await self._enter(context)
            try:
                return await inner(request, context)
            finally:
                self._leave(ip)

        return handler

    def _counted_stream(self, inner):
        """``inner`` (an async-generator handler) holding a slot until its stream ends, is closed or cancelled."""

        async def handler(request, context):
            ip = await self._enter(context)
            try:
                async with contextlib.aclosing(inner(request, context)) as messages:
                    async for message in messages:
                        yield message
            finally:
                self._leave(ip)

        return handler
