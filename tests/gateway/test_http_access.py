"""The gateway's API key, ``/health`` and ``/metrics`` over raw HTTP (httpx, real servers): a gateway started with
``ENCDEC_API_KEY``, one with dead extra targets, one in front of a backend that fails on demand
(``helpers.plumbing_server``: what backend failures tell a client), and the main one's request counts.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import pytest
from helpers.gateway_process import gateway_process
from helpers.plumbing_server import plumbing_server
from prometheus_client.parser import text_string_to_metric_families

from decoder_svc.session.admission import AdmissionQueue
from encdec.launcher import http_gateway
from encdec.redis_server import free_ports
from shared.errors import ResourceExhaustedError

EMBED = "all-MiniLM-L6-v2"
API_KEY = "sk-test-gateway-3c1f0e"


@pytest.fixture(scope="module")
def keyed_gateway(stack):
    env = {**os.environ, "ENCDEC_API_KEY": API_KEY}
    with http_gateway(stack.decoder_addresses, stack.embed_addresses, env=env) as url:
        yield url


@contextlib.contextmanager
def unhealthy_gateway(
    decoder_addresses: list[str], embed_addresses: list[str], timeout_s: float = 60.0, log: Path | None = None
):
    """A gateway (``encdec serve-http``) whose ``/health`` is expected to fail: ready once it answers at all.
    ``log``: a file for its output (default: ours)."""
    with gateway_process(decoder_addresses, embed_addresses, log=log, timeout_s=timeout_s) as (url, _):
        yield url


def test_no_api_key_is_401_with_www_authenticate(keyed_gateway):
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/embeddings", {"model": EMBED, "input": "x"})):
        response = httpx.request(method, keyed_gateway + path, json=body, timeout=30)
        assert response.status_code == 401, (path, response.text)
        assert response.headers.get("www-authenticate") == "Bearer", response.headers
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error


def test_a_call_without_the_key_is_401_before_its_body_is_read(keyed_gateway):
    """A break test (issue 34): a route's JSON body was read and parsed before the key was checked, so a caller
    without the key got a 400 for a broken body and could make the gateway read --max-request-mb per call. The 401
    now comes before the body: here it answers a call whose promised 8 MB body is never sent."""
    import socket
    from urllib.parse import urlsplit

    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        response = httpx.post(
            keyed_gateway + "/v1/completions", content=b"{", headers={"content-type": "application/json", **headers}
        )
        assert response.status_code == 401, response.text  # before: 400 "the request body is not valid JSON"
    where = urlsplit(keyed_gateway)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 8000000\r\n\r\n{"
        )
        head = sock.recv(4096)  # the body never comes: an answer that waited for it would time out here
    assert head.startswith(b"HTTP/1.1 401"), head[:200]


@pytest.mark.parametrize("header", [f"Bearer {API_KEY}x", "Bearer sk-wrong", f"Basic {API_KEY}", "Bearer", API_KEY])
def test_a_wrong_api_key_is_401(keyed_gateway, header):
    response = httpx.get(keyed_gateway + "/v1/models", headers={"Authorization": header}, timeout=30)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_right_api_key_is_served(keyed_gateway):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=keyed_gateway, headers=auth, timeout=60) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        assert EMBED in {m["id"] for m in models.json()["data"]}
        embedded = client.post("/v1/embeddings", json={"model": EMBED, "input": ["a key", "was sent"]})
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"]) == 2
        assert client.get("/metrics").status_code == 200


def test_docs_and_openapi_schema_are_off_with_a_key(keyed_gateway, stack):
    for path in ("/docs", "/redoc", "/openapi.json"):
        response = httpx.get(keyed_gateway + path, timeout=30)
        assert response.status_code in (401, 404), (path, response.status_code)
        assert "openapi" not in response.text.lower() and "swagger" not in response.text.lower(), path
    assert httpx.get(stack.url + "/openapi.json", timeout=30).status_code == 200  # no key: the docs stay on


def test_health_needs_no_key_but_metrics_does(keyed_gateway):
    assert httpx.get(keyed_gateway + "/health", timeout=30).status_code == 200
    response = httpx.get(keyed_gateway + "/metrics", timeout=30)
    assert response.status_code == 401, response.text
    assert "encdec_http_requests" not in response.text


def test_health_is_200_with_every_backend_serving(stack):
    response = httpx.get(stack.url + "/health", timeout=30)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok", "backends": {"serving": 4, "total": 4}}
    assert not any(t in response.text for t in stack.decoder_addresses + stack.embed_addresses), response.text
    assert response.headers["x-request-id"].startswith("req_"), response.headers


def test_dead_targets_are_counted_and_logged_never_named_to_clients(stack, tmp_path):
    """Issue 34 item 8: /health (open to all) once answered every backend's address and raw gRPC error; a request
    for a model behind a dead target named it. Now they say counts and a stable message; the log has the rest."""
    dead, dead_embed = (f"127.0.0.1:{port}" for port in free_ports(2))  # nobody listens there
    log = tmp_path / "gateway.log"
    with unhealthy_gateway([*stack.decoder_addresses, dead], [dead_embed], log=log) as url:
        response = httpx.get(url + "/health", timeout=30)
        models = httpx.get(url + "/v1/models", timeout=30)
        embed = httpx.post(url + "/v1/embeddings", json={"model": EMBED, "input": "x"}, timeout=30)
    assert response.status_code == 503, response.text
    assert response.json() == {"status": "unavailable", "backends": {"serving": 2, "total": 4}}, response.text
    assert models.status_code == 200 and len(models.json()["data"]) == 2, models.text  # the others still serve
    assert embed.status_code == 503, embed.text
    rid = embed.headers["x-request-id"]
    message = embed.json()["error"]["message"]
    assert message == f"model '{EMBED}' is not known: a backend that may serve it does not answer; retry later " + (
        f"(request id {rid})"
    )
    for answer in (response, embed):
        assert dead not in answer.text and dead_embed not in answer.text and "UNAVAILABLE" not in answer.text
    logged = log.read_text()
    assert dead in logged and dead_embed in logged and rid in logged, logged


@pytest.fixture(scope="module")
def failing_backend(tmp_path_factory):
    """A DecoderService that fails on demand (``fail:<CODE>:<details>`` prompts) and a gateway before it."""
    root = tmp_path_factory.mktemp("failing-backend")
    with plumbing_server({}, root / "server.log") as (address, _):
        with unhealthy_gateway([address], [], log=root / "gateway.log") as url:
            yield url, root / "gateway.log"


LEAKY = "redis://10.9.8.7:6379 refused; encoder 10.1.1.1:50061: Traceback ConnectionError"


@pytest.mark.parametrize(
    ("code", "status", "message"),
    [
        ("INTERNAL", 500, "the server failed while processing the request; retry later"),
        ("UNKNOWN", 500, "the server failed while processing the request; retry later"),
        ("DATA_LOSS", 500, "the server failed while processing the request; retry later"),
        ("UNAVAILABLE", 503, "the service is temporarily unavailable; retry later"),
    ],
)
def test_backend_failures_reach_clients_as_a_stable_message_and_request_id(failing_backend, code, status, message):
    url, log = failing_backend
    body = {"model": "plumbing", "prompt": f"fail:{code}:{LEAKY}", "max_tokens": 1}
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    rid = response.headers["x-request-id"]
    assert response.json()["error"]["message"] == f"{message} (request id {rid})", response.text
    assert "10.9.8.7" not in response.text and "Traceback" not in response.text, response.text
    logged = [line for line in log.read_text().splitlines() if rid in line]
    assert logged and LEAKY in logged[0] and code in logged[0], logged


@pytest.mark.parametrize(
    ("code", "status"), [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429), ("FAILED_PRECONDITION", 400)]
)
def test_backend_messages_meant_for_the_user_pass_unchanged(failing_backend, code, status):
    url, _ = failing_backend
    details = "max_tokens must be at most 40 (--max-new-tokens), got 41"
    body = {"model": "plumbing", "prompt": f"fail:{code}:{details}", "max_tokens": 1}
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status and response.json()["error"]["message"] == details, response.text


def queue_time_refusal(wait_s: float) -> str:
    """The message of a real ``AdmissionQueue``'s refusal whose estimated wait is ``wait_s`` (max_queue_time_s=30)."""
    now = [0.0]
    queue = AdmissionQueue(100, 30.0, clock=lambda: now[0])
    queue.admit(0, None)  # the queue starts a busy period at 0 s
    now[0] = wait_s  # nothing left it since: the open gap is the estimated wait
    with pytest.raises(ResourceExhaustedError) as refused:
        queue.admit(0, None)
    return str(refused.value)


@pytest.mark.parametrize(("wait_s", "retry_after"), [(31.4, "32"), (36.0, "36"), (900.0, "120")])
def test_retry_after_is_the_decoders_estimated_wait(failing_backend, wait_s, retry_after):
    url, _ = failing_backend
    details = queue_time_refusal(wait_s)
    assert f"estimated {wait_s:.1f} s" in details, details
    body = {"model": "plumbing", "prompt": f"fail:RESOURCE_EXHAUSTED:{details}", "max_tokens": 1}
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 429 and response.json()["error"]["message"] == details, response.text
    assert response.headers["retry-after"] == retry_after, response.headers


def test_retry_after_is_1_without_an_estimated_wait(failing_backend):
    url, _ = failing_backend
    details = "this decoder is overloaded: 9 requests are waiting (max_waiting_requests=8); retry later"
    body = {"model": "plumbing", "prompt": f"fail:RESOURCE_EXHAUSTED:{details}", "max_tokens": 1}
    response = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 429 and response.headers["retry-after"] == "1", response.headers


def request_counts(url: str) -> dict[tuple[str, str, str], float]:
    """``{(route, method, status): count}`` of the gateway's ``encdec_http_requests_total``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        (s.labels["route"], s.labels["method"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "encdec_http_requests_total"
    }


def test_metrics_count_requests_by_route_method_and_status(stack):
    before = request_counts(stack.url)
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        for i in range(3):
            assert client.post("/v1/embeddings", json={"model": EMBED, "input": f"count me {i}"}).status_code == 200
        assert client.post("/v1/embeddings", json={"model": EMBED, "input": []}).status_code == 400
        assert client.get("/no/such/path/8f3a").status_code == 404
        assert client.get("/v1/models/no-such-model").status_code == 404
    after = request_counts(stack.url)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(("/v1/embeddings", "POST", "200")) == 3, after
    assert delta(("/v1/embeddings", "POST", "400")) == 1, after
    assert delta(("unmatched", "GET", "404")) == 1, after
    assert delta(("/v1/models/{model:path}", "GET", "404")) == 1, after
    assert not any("8f3a" in route or "no-such-model" in route for route, _, _ in after), "paths are not labels"
    text = httpx.get(stack.url + "/metrics", timeout=30).text
    assert 'encdec_http_request_duration_seconds_count{route="/v1/embeddings"}' in text
