"""The per-client limit of a public gRPC port: at most N calls in flight from one client address.

``ClientLimitInterceptor`` counts the calls running per peer IP (``context.peer()``: ``ipv4:1.2.3.4:5678``,
``ipv6:[::1]:5678``); a call past ``max_requests_per_client`` ends at once with RESOURCE_EXHAUSTED naming the
limit and its flag. A call's slot is released when its handler ends however it ends (answered, failed, cancelled
by the client, a stream closed early). Health and reflection calls are neither counted nor limited. The control
calls (``CONTROL_METHODS``: GetRequest, Abort, GetStats) are counted in a bucket of their own with the same limit:
a client at its limit of model calls can still abort, poll and be monitored, and a flood of polls (each one a
Redis read) is bounded too (issue 34 item 7). Tokenize tokenizes up to the embed limits' worth of text, so it
counts as a model call. Behind a proxy or the HTTP gateway every call comes from the proxy's address: size the
limit for it (it bounds that proxy's calls in flight in all), or set 0 (off).
"""

from __future__ import annotations

import contextlib
import inspect

import grpc

from shared.public_auth import is_open_method

# Calls that do no model work: counted apart (an Abort must get through to a client at its limit of model calls).
CONTROL_METHODS = frozenset(
    {
        "/encdec.v1.DecoderService/GetRequest",
        "/encdec.v1.DecoderService/Abort",
        "/encdec.v1.DecoderService/GetStats",
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
        self.in_flight: dict[tuple[str, str], int] = {}  # (client IP, "model" or "control") -> calls running

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open_method(method):
            return handler
        bucket = "control" if method in CONTROL_METHODS else "model"
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._counted(handler.unary_unary, bucket), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            wrapped = (
                self._counted_stream(inner, bucket)
                if inspect.isasyncgenfunction(inner)
                else self._counted(inner, bucket)
            )
            return grpc.unary_stream_rpc_method_handler(
                wrapped, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._counted(handler.stream_unary, bucket), handler.request_deserializer, handler.response_serializer
            )
        inner = handler.stream_stream
        wrapped = (
            self._counted_stream(inner, bucket) if inspect.isasyncgenfunction(inner) else self._counted(inner, bucket)
        )
        return grpc.stream_stream_rpc_method_handler(wrapped, handler.request_deserializer, handler.response_serializer)

    async def _enter(self, context: grpc.aio.ServicerContext, bucket: str) -> tuple[str, str]:
        """Takes a slot of ``bucket`` for the call's client, or ends the call with RESOURCE_EXHAUSTED
        (``context.abort``)."""
        key = (peer_ip(context.peer() or ""), bucket)
        kind = "control calls (GetRequest, Abort, GetStats)" if bucket == "control" else "calls"
        await _take_slot(
            self.in_flight,
            key,
            self.max_in_flight,
            context,
            lambda running: (
                f"{running} {kind} from {key[0]} are in flight; this server runs at most "
                f"{self.max_in_flight} at once per client address (--max-requests-per-client): wait for one to end, "
                "or retry later"
            ),
        )
        return key

    def _leave(self, key: tuple[str, str]) -> None:
        _give_back(self.in_flight, key)

    def _counted(self, inner, bucket: str):
        """``inner`` (a coroutine handler) holding a slot of ``bucket`` while it runs."""

        async def handler(request, context):
            key = await self._enter(context, bucket)
            try:
                return await inner(request, context)
            finally:
                self._leave(key)

        return handler

    def _counted_stream(self, inner, bucket: str):
        """``inner`` (an async-generator handler) holding a slot of ``bucket`` until its stream ends, is closed or
        cancelled."""

        async def handler(request, context):
            key = await self._enter(context, bucket)
            try:
                async with contextlib.aclosing(inner(request, context)) as messages:
                    async for message in messages:
                        yield message
            finally:
                self._leave(key)

        return handler


async def _take_slot(counts: dict, key, limit: int, context: grpc.aio.ServicerContext, refusal) -> None:
    """One more call of ``key`` in ``counts``, or the call ends with RESOURCE_EXHAUSTED ``refusal(running)``."""
    running = counts.get(key, 0)
    if running >= limit:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal(running))
    counts[key] = running + 1


def _give_back(counts: dict, key) -> None:
    """One call of ``key`` fewer in ``counts`` (the entry goes at 0)."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


WATCH_METHOD = "/grpc.health.v1.Health/Watch"
MAX_WATCHES_PER_CLIENT = 4  # a probe or load balancer watches once or twice; the rest is someone holding slots


class HealthWatchLimitInterceptor(grpc.aio.ServerInterceptor):
    """At most ``max_per_client`` health ``Watch`` streams per client address, on every port (RESOURCE_EXHAUSTED
    past it). Health needs no token and a Watch never ends, so without this one client could hold every slot of
    ``--max-concurrent-rpcs`` open for nothing (issue 34 break test: 20 Watch streams from one address froze a port
    whose limit was 20). ``Check`` is not limited: it ends at once.

    Args:
        max_per_client: most Watch streams in flight per client IP (>= 1).
    """

    def __init__(self, max_per_client: int = MAX_WATCHES_PER_CLIENT) -> None:
        self.max_per_client = max_per_client
        self.in_flight: dict[str, int] = {}  # client IP -> Watch streams open

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != WATCH_METHOD or handler.unary_stream is None:
            return handler
        inner = handler.unary_stream

        async def enter(context) -> str:
            ip = peer_ip(context.peer() or "")
            await _take_slot(
                self.in_flight,
                ip,
                self.max_per_client,
                context,
                lambda running: (
                    f"{running} health Watch streams from {ip} are open; at most {self.max_per_client} "
                    "per client address: use Check, or close a Watch"
                ),
            )
            return ip

        def leave(ip: str) -> None:
            _give_back(self.in_flight, ip)

        if inspect.isasyncgenfunction(inner):

            async def watch(request, context):
                ip = await enter(context)
                try:
                    async for message in inner(request, context):
                        yield message
                finally:
                    leave(ip)

        else:  # writes with context.write (grpc_health's aio Watch)

            async def watch(request, context):
                ip = await enter(context)
                try:
                    return await inner(request, context)
                finally:
                    leave(ip)

        return grpc.unary_stream_rpc_method_handler(watch, handler.request_deserializer, handler.response_serializer)
