"""``GET /health`` (no API key), ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /metrics``."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from gateway_svc.backends import Backend, Backends
from gateway_svc.errors import GatewayError
from gateway_svc.route_support import backends

public = APIRouter()
router = APIRouter()


@public.api_route("/health", methods=["GET", "HEAD"])
async def health(b: Backends = Depends(backends)) -> JSONResponse:
    """200 when every configured backend answers its gRPC health check SERVING, else 503.

    The body is ``{"status": "ok" | "unavailable", "backends": {"serving": n, "total": m}}``: counts only, since
    the route is open to every caller (issue 34 item 8); the gateway's log names the failing backends and why.
    """
    answers = await b.health()
    serving = sum(why is None for why in answers.values())
    body = {
        "status": "ok" if serving == len(answers) else "unavailable",
        "backends": {"serving": serving, "total": len(answers)},
    }
    return JSONResponse(body, status_code=200 if serving == len(answers) else 503)


def _model_card(backend: Backend) -> dict:
    return {"id": backend.model, "object": "model", "created": backend.created, "owned_by": "encdec-serve"}


@router.get("/v1/models")
async def list_models(b: Backends = Depends(backends)) -> dict:
    """OpenAI's model list: every model a configured backend serves (asked again if none is known yet)."""
    if not b.models:
        await b.rediscover()
    cards = [_model_card(m) for m in sorted(b.models.values(), key=lambda m: m.model)]
    for alias in sorted(b.aliases):
        if (target := b.find(alias)) is not None:
            cards.append({**_model_card(target), "id": alias})
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, b: Backends = Depends(backends)) -> dict:
    found = b.find(model)
    if found is None and await b.rediscover():
        found = b.find(model)
    if found is None:
        shown = model if len(model) <= 256 else model[:256] + "..."
        raise GatewayError(404, f"model {shown!r} is not served here", "model", "model_not_found")
    return {**_model_card(found), "id": model}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)
