"""OpenAI-shaped errors: the body ``{"error": {"message", "type", "param", "code"}}`` and the one place a gRPC
status becomes an HTTP status.

The map follows the gRPC <-> HTTP table of Google's API design guide (``google.rpc.Code``), with OpenAI's error
``type`` names (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``, ``server_error``).
"""

from __future__ import annotations

import contextlib
import logging
import re

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
RETRY_AFTER_S = "1"  # 429 (a decoder's full queue) and 503 (a backend down): clients back off before retrying


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    elif status in (429, 503):
        headers = {"Retry-After": RETRY_AFTER_S}
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_rpc_error(exc: grpc.RpcError) -> GatewayError:
    """A backend's gRPC error as the HTTP error the client gets (its details are the message)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    status = HTTP_STATUS.get(code, 500)
    details = (exc.details() if hasattr(exc, "details") else None) or code.name
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        details = f"the backend service is unreachable ({details}); retry later"
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
        else:
            message = f"{field}: {first.get('msg')}"
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
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
