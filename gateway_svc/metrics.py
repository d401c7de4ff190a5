"""The gateway's Prometheus metrics (``GET /metrics``) and the ASGI middleware that records them.

``encdec_http_requests_total{route, method, status}`` and ``encdec_http_request_duration_seconds{route}`` (from
the request to the last byte of the response, streams included). ``route`` is the route's path template
(``/v1/models/{model}``), ``unmatched`` for paths no route serves, so a scan of random paths cannot grow the label set.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from shared.metrics import new_registry

# Seconds: from a cached embedding (milliseconds) to a long transcription (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    """The gateway's registry and its two metrics."""

    def __init__(self) -> None:
        self.registry = new_registry()
        self.requests = Counter(
            "encdec_http_requests",
            "HTTP requests by route, method and response status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "encdec_http_request_duration_seconds",
            "HTTP request duration, to the last byte of the response (seconds)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """ASGI middleware: one count and one latency observation per HTTP request."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]  # an exception escaping the app is answered 500 by the server

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(label, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - start)
