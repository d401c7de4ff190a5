"""The FastAPI application of ``encdec serve-http``: ``create_app(config)``; ``gateway_svc.startup.run`` serves it
on uvicorn.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from gateway_svc import errors
from gateway_svc.backends import Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.limits import CallLimitMiddleware
from gateway_svc.metrics import GatewayMetrics, MetricsMiddleware
from gateway_svc.route_support import ApiKeyMiddleware
from gateway_svc.routes import audio, completions, embeddings, meta, realtime
from gateway_svc.upload import UploadLimitMiddleware


def create_app(cfg: GatewayConfig) -> FastAPI:
    """The gateway application for ``cfg``; its backends are discovered when it starts (its lifespan).

    Raises:
        ValueError: ``cfg.api_key_file`` cannot be read or is empty.
    """
    cfg = cfg.with_api_key_read()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.backends = Backends(cfg)
        await app.state.backends.start()
        try:
            yield
        finally:
            await app.state.backends.close()

    # With an API key the interactive docs and the OpenAPI schema are off (issue 34 item 8): nothing but /health
    # answers a caller without the key.
    docs = {} if not cfg.api_key else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="encdec-serve", summary="OpenAI-compatible HTTP API of encdec-serve", lifespan=lifespan, **docs)
    app.state.config = cfg
    app.state.metrics = GatewayMetrics()
    errors.install(app)
    app.include_router(meta.public)  # OPEN_PATHS; every other HTTP route needs the key (ApiKeyMiddleware)
    app.include_router(meta.router)
    app.include_router(audio.router)
    app.include_router(completions.router)
    app.include_router(embeddings.router)
    app.include_router(realtime.router)  # a WebSocket: it checks the API key at its handshake itself
    app.add_middleware(
        UploadLimitMiddleware,
        upload_bytes=cfg.max_upload_bytes,
        request_bytes=cfg.max_request_bytes,
        uploads_in_flight_bytes=int(cfg.max_uploads_in_flight_mb * 1_000_000),
    )
    app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key)  # outside the body limit: no key, no body read
    app.add_middleware(  # outside the body limit: a refused call is answered before its body is read
        CallLimitMiddleware,
        per_client=cfg.max_requests_per_client,
        in_all=cfg.max_concurrent_requests,
        api_key=cfg.api_key,
    )
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(errors.RequestIdMiddleware)  # outermost: every answer carries X-Request-Id
    return app
