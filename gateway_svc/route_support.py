"""What the gateway's routes share: their dependencies (the backends, the config, the API key check), the watch
for a client that went away, server-sent events, response ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc
import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from gateway_svc.backends import Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import GatewayError, from_rpc_error
from shared.public_auth import bearer_token_of

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


async def backends(request: Request) -> Backends:
    return request.app.state.backends  # async: FastAPI runs a plain def dependency in its thread pool


async def config(request: Request) -> GatewayConfig:
    return request.app.state.config


OPEN_PATHS = frozenset({"/health"})  # answered without the API key (the load balancer's probe)


def api_key_refusal(headers, expected: str, also=(), how: str = "") -> GatewayError | None:
    """The 401 of a call whose ``headers`` (name, value pairs) carry no ``Authorization: Bearer <expected>`` and
    none of whose keys ``also`` (a WebSocket's subprotocol keys) is ``expected``; None when one is, or when the
    gateway has no key (``expected`` empty). ``how``: the other way to send the key, named in the message."""
    if not expected:
        return None
    token = bearer_token_of(headers)
    given = [*([] if token is None else [token]), *also]
    if not given:
        return GatewayError(
            401,
            f"missing API key: send the header 'Authorization: Bearer <key>'{f' ({how})' if how else ''}",
            code="invalid_api_key",
        )
    if not any(hmac.compare_digest(key.encode(), expected.encode()) for key in given):
        return GatewayError(401, "invalid API key", code="invalid_api_key")
    return None


class ApiKeyMiddleware:
    """ASGI middleware answering an HTTP call without the API key with its 401 before the call's body is read: the
    one check of the key on HTTP routes (a route dependency ran after FastAPI had read and parsed the JSON body, so a
    caller without the key could make the gateway read and parse ``--max-request-mb`` per call). ``OPEN_PATHS``
    pass; a WebSocket checks the key at its handshake (``gateway_svc.routes.realtime``).

    Args:
        api_key: the gateway's API key; empty: every call passes.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if self.api_key and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = ((name.decode("latin-1"), value) for name, value in scope["headers"])  # bearer_token_of decodes
            refusal = api_key_refusal(headers, self.api_key)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def until_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the request's body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled (and its gRPC calls with it) if the client goes away first.

    Raises:
        GatewayError: 499, the client went away (nobody reads this answer; it ends the handler).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise GatewayError(499, "the client closed the connection")
    return task.result()


async def stream_messages(call, first):
    """``first`` (a message already read, or ``grpc.aio.EOF``), then the rest of ``call``'s stream; read with
    ``read()`` throughout: grpc.aio forbids mixing it with ``async for``.

    Raises:
        grpc.RpcError: the stream ended with an error status.
    """
    message = first
    while message is not grpc.aio.EOF:
        yield message
        message = await call.read()


def error_event(exc: grpc.RpcError) -> dict:
    """The ``data`` of the event that ends a stream whose backend call failed after the answer began."""
    return from_rpc_error(exc).body()


def sse(events: AsyncIterator[dict | str]) -> StreamingResponse:
    """Server-sent events: each dict as ``data: <json>``, a str as ``data: <str>`` (``[DONE]``).

    When the client goes away Starlette cancels the iteration; ``events`` closes its gRPC calls in its
    ``finally``.
    """

    async def framed():
        async for event in events:
            payload = event.encode() if isinstance(event, str) else orjson.dumps(event)
            yield b"data: " + payload + b"\n\n"

    return StreamingResponse(
        framed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def json_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, validated in pydantic's JSON mode straight from the bytes.

    For the hot routes: a third less gateway CPU per request than FastAPI's body parameter (which decodes the
    JSON to Python objects, then validates those, then solves the body as a dependency).

    Raises:
        GatewayError: 400, a content type that is not JSON (none is taken as JSON).
        RequestValidationError: the body is not JSON or does not fit ``model`` (the 400 naming the field).
    """
    content_type = request.headers.get("content-type", "")
    if content_type and not content_type.split(";")[0].strip().endswith(("/json", "+json")):
        raise GatewayError(400, f"send the body as JSON with 'Content-Type: application/json' (got {content_type!r})")
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def body_schema(model: type[BaseModel]) -> dict:
    """``openapi_extra`` of a route that reads its body with ``json_body``: ``/docs`` still shows the model."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def json_response(body: dict, status: int = 200) -> Response:
    """``body`` as compact JSON (orjson: numpy float32 arrays are written as float32 values, each the shortest
    decimal that reads back to the same float32)."""
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
