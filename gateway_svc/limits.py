"""The gateway's limits on calls in flight (issue 34 item 6): per client (``--max-requests-per-client``) and in all
(``--max-concurrent-requests``).

A client is the API key its call presents when the gateway has one (``--api-key``) and the key is right, else the
client's address (``scope["client"]``: the peer, or the address in ``X-Forwarded-For`` when the peer is a proxy
named by ``--forwarded-allow-ips``, none by default). One key shared by several users is one client.
A call past its client's limit is a 429 (``rate_limit_error``) naming the flag; a call past the gateway's limit a
503. Either is answered before the body is read. A call holds its slots from its start to its response's last byte
(a stream until it ends or the client goes away), however it ends. ``/health`` and ``/metrics`` are neither counted
nor limited: probes and scrapes get through a gateway at its limit. A WebSocket (``/v1/realtime``) is a call too,
from its handshake to its close: one client cannot hold every realtime stream the decoders take
(``--max-realtime-streams``); a refused handshake gets the same 429 / 503 as a denial response (a close with
code 1013, "try again later", where the server cannot send one).

uvicorn's own ``limit_concurrency`` is not used: it counts open connections (idle keep-alive ones too, and the
probes') and answers a plain-text 503.
"""

from __future__ import annotations

import hmac

from gateway_svc.errors import GatewayError
from shared.public_auth import bearer_token_of

UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})


def client_of(scope, api_key: str) -> tuple[str, str]:
    """The client a call counts against: ``("key", key)`` for the gateway's API key, else ``("ip", address)``."""
    if api_key:
        given = bearer_token_of((name.decode("latin-1"), value) for name, value in scope["headers"])
        if given is not None and hmac.compare_digest(given.encode("latin-1"), api_key.encode()):
            return ("key", api_key)
    client = scope.get("client")
    return ("ip", client[0] if client else "unknown")


class CallLimitMiddleware:
    """ASGI middleware refusing a call while its client has ``per_client`` calls in flight (429), or the gateway
    ``in_all`` (503); see the module docstring.

    Used on the server's event loop only: the counts need no lock.

    Args:
        per_client: most calls in flight per client (API key or address); 0 = no limit.
        in_all: most calls in flight in the gateway, every client together; 0 = no limit.
        api_key: the gateway's API key (``GatewayConfig.api_key``); empty: clients are addresses.
    """

    def __init__(self, app, per_client: int, in_all: int, api_key: str = "") -> None:
        self.app = app
        self.per_client = per_client
        self.in_all = in_all
        self.api_key = api_key
        self.in_flight: dict[tuple[str, str], int] = {}  # client -> calls running
        self.total = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        client = client_of(scope, self.api_key)
        running = self.in_flight.get(client, 0)
        refusal = None
        if self.per_client and running >= self.per_client:
            who = "with this API key" if client[0] == "key" else f"from {client[1]}"
            per = "API key" if client[0] == "key" else "client address"
            refusal = GatewayError(
                429,
                f"{running} calls {who} are in flight; this gateway runs at most {self.per_client} at once per {per} "
                "(--max-requests-per-client): wait for one to end, or retry later",
                code="rate_limit_exceeded",
            )
        elif self.in_all and self.total >= self.in_all:
            refusal = GatewayError(
                503,
                f"this gateway is at its limit of {self.in_all} calls in flight (--max-concurrent-requests); "
                "retry later",
                code="server_overloaded",
            )
        if refusal is not None:
            if scope["type"] == "websocket":
                await _deny_websocket(scope, receive, send, refusal)
            else:
                await refusal.response()(scope, receive, send)
            return
        self.in_flight[client] = running + 1
        self.total += 1
        try:
            await self.app(scope, receive, send)  # a streamed response returns at its end or the client's leaving
        finally:
            self.total -= 1
            left = self.in_flight[client] - 1
            if left:
                self.in_flight[client] = left
            else:
                del self.in_flight[client]


async def _deny_websocket(scope, receive, send, refusal: GatewayError) -> None:
    """Refuses a WebSocket handshake with ``refusal``'s HTTP answer (ASGI's denial response), or closes it with
    code 1013 (try again later) where the server has no denial response."""
    from starlette.websockets import WebSocket

    websocket = WebSocket(scope, receive, send)
    try:
        await websocket.send_denial_response(refusal.response())
    except RuntimeError:
        await websocket.close(1013, refusal.message[:120])
