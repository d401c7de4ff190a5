"""The bearer token of the public gRPC ports: loading it, checking it on every call, sending it from clients.

A service started with ``--auth-token-file PATH`` (or ``ENCDEC_AUTH_TOKEN``) refuses every public RPC (Generate,
GetRequest, Abort, GetStats, Embed, Rerank, Classify, Tokenize) that does not carry the metadata
``authorization: Bearer <token>``: UNAUTHENTICATED, the token compared in constant time (``hmac.compare_digest``).
The health service (and reflection, if a server adds it) stays open, so load balancers and Kubernetes probes
need no secret. The token is never logged. The Encode port has its own token (``shared.internal_auth``).

Clients (``encdec transcribe --token``, the HTTP gateway's backend channels) add the metadata with
``bearer_token_interceptors``; they work on plaintext and TLS channels alike.
"""

from __future__ import annotations

import hmac

import grpc

METADATA_KEY = "authorization"
SCHEME = "bearer"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096  # well inside gRPC's 8-16 KiB request metadata limit
TOKEN_FILE_MAX_BYTES = 64 * 1024  # read of a token file: past MAX_TOKEN_CHARS, so an overlong token is refused
# Calls any client may make without the token: probes and tooling.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
MISSING_TOKEN = "missing bearer token: send metadata 'authorization: Bearer <token>' (encdec --token, ENCDEC_TOKEN)"
INVALID_TOKEN = "invalid bearer token"
_GENERATE_HINT = "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def read_token_file(path: str, setting: str) -> str:
    """The ASCII text of the token file ``path`` without its surrounding whitespace ("" for a blank file); at most
    ``TOKEN_FILE_MAX_BYTES`` are read, so a longer token shows its length to the checks after.

    Raises:
        ValueError: the file cannot be read or is not ASCII (the message names ``setting`` and the path, never the
            content).
    """
    source = f"{setting} {path!r}"
    try:
        with open(path, "rb") as f:
            raw = f.read(TOKEN_FILE_MAX_BYTES).strip()
    except OSError as exc:
        raise ValueError(f"{source} cannot be read: {exc.strerror or exc}") from exc
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{source} holds non-ASCII bytes; a bearer token is printable ASCII") from None


def load_bearer_token(auth_token_file: str = "", auth_token: str = "") -> str | None:
    """The public token from a ``ServiceConfig``'s ``auth_token_file`` or ``auth_token``; None when both are empty.

    The file's text has its surrounding whitespace stripped. A token is printable ASCII without spaces (it
    travels in gRPC metadata) and at least ``MIN_TOKEN_CHARS`` characters long.

    Raises:
        ValueError: both are set, the file cannot be read, or the token is too short or holds characters
            metadata cannot carry (the message names the setting, never the token).
    """
    if auth_token_file and auth_token:
        raise ValueError(
            "auth_token_file and auth_token are both set: keep one (--auth-token-file or ENCDEC_AUTH_TOKEN)"
        )
    if auth_token_file:
        source, token = f"auth_token_file {auth_token_file!r}", read_token_file(auth_token_file, "auth_token_file")
    elif auth_token:
        source, token = "auth_token (ENCDEC_AUTH_TOKEN)", auth_token.strip()
    else:
        return None
    if not token:
        raise ValueError(f"{source} is empty; {_GENERATE_HINT}")
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(
            f"{source} holds {len(token)} characters; a bearer token may have at most {MAX_TOKEN_CHARS} (gRPC "
            "refuses request metadata over 16 KiB, so no client could send it)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source} holds {len(token)} characters; a bearer token needs at least {MIN_TOKEN_CHARS}; {_GENERATE_HINT}"
        )
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{source}: a bearer token is printable ASCII without spaces (gRPC metadata carries it)")
    return token


def is_open_method(method: str) -> bool:
    """True for the RPCs any client may call without the token or a per-client slot (health, reflection)."""
    return method.startswith(OPEN_METHOD_PREFIXES)


def bearer_token_of(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry of call ``metadata`` (pairs); None if there is none."""
    for key, value in metadata or ():
        if key != METADATA_KEY:
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == SCHEME and token.strip():
            return token.strip()
    return None


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends every call of ``handler``'s method with ``code`` and ``message`` before reading the
    request: served as a stream-stream handler without a deserializer, whatever the method's kind, so gRPC hands
    the call over at its headers and never receives nor parses the body (an unauthenticated 64 MiB Generate costs
    the server nothing; a unary handler would read the whole message first). The client sees the status as from
    any handler of its method."""

    async def refuse(request_iterator, context):
        await context.abort(code, message)
        yield  # an async generator: grpc starts it without reading a message

    return grpc.stream_stream_rpc_method_handler(refuse, None, handler.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but ``is_open_method``'s without ``authorization: Bearer <token>`` (UNAUTHENTICATED).

    Args:
        token: the expected token (``load_bearer_token``).
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode("ascii")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open_method(handler_call_details.method):
            return handler
        given = bearer_token_of(handler_call_details.invocation_metadata)
        if given is None:
            return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, MISSING_TOKEN)
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self._token):
            return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, INVALID_TOKEN)
        return handler


class _TokenMetadata:
    """The ``authorization: Bearer <token>`` entry added to a call's metadata (any other ``authorization`` dropped).

    Raises:
        ValueError: the token is empty or holds characters metadata cannot carry.
    """

    def __init__(self, token: str) -> None:
        token = token.strip()
        if not token or not all(33 <= ord(c) <= 126 for c in token):
            raise ValueError("the bearer token must be non-empty printable ASCII without spaces")
        self._entry = (METADATA_KEY, f"Bearer {token}")

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY], self._entry)
        return details._replace(metadata=metadata)


class _UnaryUnary(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _UnaryStream(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _StreamUnary(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self.details(client_call_details), request_iterator)


class _StreamStream(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self.details(client_call_details), request_iterator)


def bearer_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """``grpc.aio`` channel interceptors adding ``authorization: Bearer <token>`` to every call, plaintext or TLS
    (one per call kind: a channel files each interceptor under one kind only).

    Raises:
        ValueError: the token is empty or holds characters metadata cannot carry.
    """
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
