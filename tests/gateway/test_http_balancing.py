"""Two decoder replicas of one model behind the gateway (real processes): gRPC's round_robin spreads the
requests over both, and when one replica dies the other serves every request that follows.
"""

from __future__ import annotations

import time

import httpx
import pytest
from helpers.metrics import scrape

from encdec.launcher import Services, http_gateway
from encdec.redis_server import free_ports

PROMPT = "the quick brown fox jumps over the lazy dog"


def finished(metrics_port: int) -> float:
    """Requests the decoder finished (every final state), from its Prometheus ``/metrics``."""
    return sum(v for (name, _), v in scrape(metrics_port).items() if name == "encdec_decoder_requests_total")


@pytest.fixture(scope="module")
def replicas(redis_url, text_checkpoints, tmp_path_factory):
    path = str(text_checkpoints["t5"])
    logs = tmp_path_factory.mktemp("replica-logs")
    ports = free_ports(2)
    first, second = (
        Services(
            model=path,
            redis_url=redis_url,
            log_dir=str(logs / f"replica{i}"),
            log_level="WARNING",
            extra_decoder_args=["--metrics-port", str(port)],
        )
        for i, port in enumerate(ports)
    )
    with first, second, http_gateway([first.decoder_address, second.decoder_address]) as url:
        yield url, path, (first, second), ports


def complete(client: httpx.Client, path: str) -> dict:
    response = client.post(
        "/v1/completions", json={"model": path, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_round_robin_spreads_requests_and_survives_a_replica_loss(replicas):
    url, path, (first, second), ports = replicas
    with httpx.Client(base_url=url) as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [path]  # one model, two targets
        before = [finished(p) for p in ports]
        texts = {complete(client, path)["choices"][0]["text"] for _ in range(8)}
        assert len(texts) == 1  # greedy: every replica gives the same text
        served = [finished(p) - b for p, b in zip(ports, before)]
        assert sum(served) == 8 and min(served) >= 2, served  # both replicas took a share

        first.kill("decoder")
        time.sleep(1.0)  # the channel sees the connection close
        after = finished(ports[1])
        for _ in range(4):
            assert complete(client, path)["choices"][0]["text"] in texts
        assert finished(ports[1]) - after == 4  # all on the replica left
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["backends"] == {"serving": 1, "total": 2}, health.text
