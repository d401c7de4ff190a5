"""OpenAI-shaped errors: the body ``{"error": {"message", "type", "param", "code"}}`` and the one place a gRPC
status becomes an HTTP status.

The map follows the gRPC <-> HTTP table of Google's API design guide (``google.rpc.Code``), with OpenAI's error
``type`` names (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``, ``server_error``).

What a backend says about a failure of its own (INTERNAL, UNKNOWN, UNAVAILABLE, DATA_LOSS: Redis URLs, encoder
addresses, exception text) and the gateway's own unexpected exceptions stay in the gateway's log (issue 34 item 8):
the client gets a stable message with the request's id (``RequestIdMiddleware``: the ``X-Request-Id`` header), the
id the log line carries. What is meant for the user (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND...) passes as
the backend wrote it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import re
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

# gRPC status -> HTTP status (google.rpc.Code's documented HTTP mapping; CANCELLED as nginx's 499).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


# Backend statuses whose details describe the backend, not the request: logged, never sent to the client.
MASKED_CODES = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
)
UNAVAILABLE_MESSAGE = "the service is temporarily unavailable; retry later"
INTERNAL_MESSAGE = "the server failed while processing the request; retry later"

_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("encdec_request_id", default="")
REQUEST_ID_KEY = "encdec.request_id"  # the scope key of the id too: the 500 handler runs outside the middleware


def request_id() -> str:
    """The id of the HTTP request (or WebSocket) being served (``RequestIdMiddleware``); one made up outside one."""
    return _REQUEST_ID.get() or new_request_id()


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


class RequestIdMiddleware:
    """ASGI middleware: a fresh id for every HTTP request and WebSocket, in a context variable the error paths read
    (``request_id``) and, for HTTP, in the response's ``X-Request-Id`` header (OpenAI's name for it). A client's own
    ``X-Request-Id`` is not taken: the id must be the gateway's, unique in its log."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = scope[REQUEST_ID_KEY] = new_request_id()
        token = _REQUEST_ID.set(rid)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id if scope["type"] == "http" else send)
        finally:
            _REQUEST_ID.reset(token)


class GatewayError(Exception):
    """A request the gateway answers with an error itself (before or instead of a backend call).

    Args:
        status: HTTP status code.
        message: what was wrong and what to do, for the user.
        param: the request field at fault, if one is.
        code: OpenAI's machine-readable ``code`` (``model_not_found``, ``invalid_api_key``...), if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """OpenAI's error object (also the ``data`` of an error event in a stream)."""
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        """The HTTP answer (an ASGI app too: middlewares can answer with it)."""
        return error_response(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param)


@contextlib.contextmanager
def building_request(param: str | None = None):
    """Around the building of a gRPC request from checked fields: what protobuf still refuses is the caller's 400
    (naming ``param``, the field the strings or numbers come from, when one does).

    Raises:
        GatewayError: 400, a string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``: not UTF-8) or a number
            out of its proto field's range.
    """
    try:
        yield
    except UnicodeEncodeError:
        raise bad_request(
            "a string in the request is not valid Unicode (a lone surrogate escape such as \\ud800); send UTF-8 text",
            param,
        ) from None
    except ValueError as exc:  # protobuf: "Value out of range: ..."
        raise bad_request(f"a number in the request is out of range: {exc}", param) from None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object for an HTTP ``status``."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# The scope key under which gateway_svc.upload leaves the 413 of a body that went over its limit.
TOO_LARGE_KEY = "encdec.too_large"
# Retry-After of a 429 (a decoder's full queue, a client at its limit) or 503 (a backend down, the gateway full):
# seconds a client backs off before retrying; the wait a refusal states, within these bounds.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 120
# The wait a decoder's refusal states: "... an estimated 31.4 s (max_queue_time_s=30) ..."
# (decoder_svc.session.admission).
_ESTIMATED_WAIT = re.compile(r"\bestimated (?:wait of )?(\d+(?:\.\d+)?) s\b")


def retry_after_s(message: str) -> int:
    """Retry-After (seconds) of a refusal: the estimated wait ``message`` states, rounded up and bounded to
    [``RETRY_AFTER_MIN_S``, ``RETRY_AFTER_MAX_S``]; ``RETRY_AFTER_MIN_S`` when it states none."""
    found = _ESTIMATED_WAIT.search(message)
    if found is None:
        return RETRY_AFTER_MIN_S
    return min(max(math.ceil(float(found.group(1))), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status in (429, 503):
        headers = {"Retry-After": str(retry_after_s(message))}
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_rpc_error(exc: grpc.RpcError) -> GatewayError:
    """A backend's gRPC error as the HTTP error the client gets.

    The details are the message, except for ``MASKED_CODES``: those are logged (WARNING, with the request id) and
    the client gets ``UNAVAILABLE_MESSAGE`` (503) or ``INTERNAL_MESSAGE`` (500) with the request id.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    status = HTTP_STATUS.get(code, 500)
    details = (exc.details() if hasattr(exc, "details") else None) or code.name
    if code in MASKED_CODES:
        rid = request_id()
        log.warning("request %s: backend answered %s: %s", rid, code.name, details)
        stable = UNAVAILABLE_MESSAGE if code == grpc.StatusCode.UNAVAILABLE else INTERNAL_MESSAGE
        return GatewayError(status, f"{stable} (request id {rid})")
    if status == 404 and "model" in details:
        return GatewayError(status, details, "model", "model_not_found")
    return GatewayError(status, details)


def invalid_json_message(reason: str) -> str:
    """The 400 message of a body the JSON parser refused, from the parser's ``reason`` ("... at line L column C").

    pydantic's parser (jiter) words a lone UTF-16 surrogate escape (``"\\ud800"`` without its pair, not Unicode) as
    "unexpected end of hex escape" or "lone leading surrogate in hex escape", and bytes that are not UTF-8 as
    "invalid unicode code point": those get a message saying what to send.
    """
    reason = reason.removeprefix("Invalid JSON: ")
    where = reason[reason.find(" at line ") :] if " at line " in reason else ""
    if "hex escape" in reason or "surrogate" in reason:
        return (
            f"the request body is not valid JSON: a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
            f"without its pair){where}; strings must be valid Unicode: send UTF-8 text"
        )
    if "invalid unicode code point" in reason:
        return f"the request body is not valid JSON: it is not UTF-8{where}; send the JSON encoded as UTF-8"
    return f"the request body is not valid JSON: {reason}; send a JSON object"


# pydantic names a union's member in an error's loc (("body", "input", "list[str]", 1)): not a request field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def _field(loc: tuple) -> str:
    """``("body", "input", 3)`` -> ``input[3]``: the field a validation error names."""
    parts = [
        str(p) for p in loc if p not in ("body", "query", "form") and not (isinstance(p, str) and _UNION_TAG.match(p))
    ]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def _most_specific(errors: list[dict]) -> dict:
    """The error to report of a body that failed validation: of the first failing field's errors (a union field
    such as ``input``, ``str | list[str] | list[int] | list[list[int]]``, has one per member), the one that got
    furthest: a wrong value (``input[0][0]`` over 2**31 - 1) over a member whose type did not fit ("should be a
    valid string"), then the deepest; the first of equals."""

    def top(error: dict) -> str:  # "input" of input[0][0]
        return re.split(r"[.\[]", _field(tuple(error.get("loc", ()))), maxsplit=1)[0]

    same = [e for e in errors if top(e) == top(errors[0])]
    return max(same, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(_field(tuple(e.get("loc", ()))))))


def install(app: FastAPI) -> None:
    """Every error the app can raise answers in OpenAI's shape; none becomes an HTML page or a bare 500."""

    @app.exception_handler(GatewayError)
    async def _gateway(_: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(grpc.RpcError)
    async def _rpc(_: Request, exc: grpc.RpcError) -> JSONResponse:
        return from_rpc_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request body"}
        field = _field(tuple(first.get("loc", ())))
        specific = _most_specific(exc.errors()) if exc.errors() else first
        kind = first.get("type", "")
        content_type = request.headers.get("content-type", "")
        if field == "body" and not content_type.startswith("application/json"):
            message = f"send the body as JSON with 'Content-Type: application/json' (got {content_type or 'none'!r})"
            return error_response(400, message)
        if kind == "extra_forbidden":
            message = f"unknown field {field!r}: not a parameter of this endpoint"
        elif kind == "missing":
            message = f"missing required field {field!r}"
        elif kind == "json_invalid":
            message = invalid_json_message(str((first.get("ctx") or {}).get("error") or first.get("msg", "")))
            field = None  # its loc is the character position, not a field
        else:  # the member of a union that got furthest: "input[0][0]: ... less than or equal to 2147483647"
            message = f"{_field(tuple(specific.get('loc', ())))}: {specific.get('msg')}"
        return error_response(400, message, param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        too_large = request.scope.get(TOO_LARGE_KEY)
        if too_large is not None:  # FastAPI's 400 for a body whose read failed: it failed on the size limit
            return too_large.response()
        detail = str(exc.detail)
        if detail == "There was an error parsing the body":  # FastAPI's words for a body json.loads refused
            detail = "the body is not valid JSON (or not UTF-8); send a JSON object"
        response = error_response(exc.status_code, detail)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        return error_response(499, "the client closed the connection before its request was read")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        rid = request.scope.get(REQUEST_ID_KEY) or new_request_id()
        log.exception("request %s: unhandled error", rid)
        response = error_response(500, f"{INTERNAL_MESSAGE} (request id {rid})")
        response.headers["x-request-id"] = rid
        return response
