"""``GET /v1/realtime`` (WebSocket): OpenAI's Realtime API for transcription sessions (and vLLM's dialect of it),
served by ``gateway_svc.realtime_connection``.

The handshake carries the API key (``Authorization: Bearer <key>``, or a browser's subprotocol
``openai-insecure-api-key.<key>``; ``realtime`` is answered when offered): without a valid one the answer is an
HTTP 401 in OpenAI's error shape, and no socket. Query: ``model`` (when the session names no transcription model),
``intent=transcription`` (with ``OpenAI-Beta: realtime=v1`` the first event is ``transcription_session.created``),
``partials=true`` (our extension: ``realtime_events.PARTIAL`` events).
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from gateway_svc.config import GatewayConfig
from gateway_svc.errors import GatewayError
from gateway_svc.realtime_connection import ENDPOINT, RealtimeConnection
from gateway_svc.route_support import api_key_refusal

router = APIRouter()

KEY_SUBPROTOCOL = "openai-insecure-api-key."  # OpenAI's browser form of the API key


def handshake_refusal(websocket: WebSocket, expected: str) -> GatewayError | None:
    """The 401 of a handshake without ``expected`` (the gateway's API key) as a bearer token or in a subprotocol
    ``openai-insecure-api-key.<key>``; None when it has it, or when the gateway has no key."""
    protocols = websocket.scope.get("subprotocols", ())
    keys = [p.removeprefix(KEY_SUBPROTOCOL) for p in protocols if p.startswith(KEY_SUBPROTOCOL)]
    return api_key_refusal(websocket.headers.items(), expected, keys, f"or the subprotocol {KEY_SUBPROTOCOL}<key>")


@router.websocket(ENDPOINT)
async def realtime(websocket: WebSocket) -> None:
    """Checks the key, accepts the socket and serves it until either side closes it."""
    cfg: GatewayConfig = websocket.app.state.config
    refusal = handshake_refusal(websocket, cfg.api_key)
    if refusal is not None:
        try:
            await websocket.send_denial_response(refusal.response())
        except RuntimeError:  # a server without ASGI's denial response: its 403
            await websocket.close(1008, refusal.message)
        return
    offered = websocket.scope.get("subprotocols", ())
    await websocket.accept(subprotocol="realtime" if "realtime" in offered else None)
    await RealtimeConnection(websocket, websocket.app.state.backends, cfg).run()
