"""A decoder with ``--encoder-address registry`` picks encoders from the Redis registry (``decoder_svc.replicas.encoder_pool``).

Real processes on loopback: a decoder started before any encoder refuses Generate with UNAVAILABLE naming the
missing encoder; two encoders (``serve-encoder --redis-url``) register, both get Encodes; one killed with SIGKILL:
the requests after it all succeed on the other, even while the dead one's lease has not yet expired.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.metrics import scrape

from encdec import DATA_DIR
from encdec.launcher import stop_processes, wait_healthy
from encdec.redis_server import free_ports
from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.registry import ReplicaRegistry

LEASE_TTL_S = 3.0
REDIS_DB = 9  # a database of its own: no other test's replicas in the registry
CLIP = (DATA_DIR / "short.wav").read_bytes()


def _db_url(url: str, db: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


def _spawn(args: list[str], redis_url: str, log_path) -> subprocess.Popen:
    env = {**os.environ, "ENCDEC_REDIS_URL": redis_url, "ENCDEC_LEASE_TTL_S": str(LEASE_TTL_S)}
    cmd = [sys.executable, "-m", "encdec.cli", "--log-level", "INFO", *args]
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def _wait(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"{what} not within {timeout_s} s"
        time.sleep(0.2)


def _encodes(metrics_port: int) -> float:
    return scrape(metrics_port).get(("encdec_encoder_requests_total", (("outcome", "ok"),)), 0.0)


def _transcribe(stub, n: int) -> list[list[int]]:
    def one(_):
        request = decoder_pb2.GenerateRequest(audio=CLIP, sampling=decoder_pb2.SamplingParams(max_tokens=4))
        return [t for m in stub.Generate(request, timeout=60) for t in m.token_ids]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture
def cluster(redis_url, tmp_path):
    url = _db_url(redis_url, REDIS_DB)
    registry = ReplicaRegistry(url, ttl_s=LEASE_TTL_S)
    dec_port, *enc_ports, m1, m2 = free_ports(5)
    procs: dict[str, subprocess.Popen] = {}
    decoder_args = ["serve-decoder", "--port", str(dec_port), "--encoder-address", "registry", "--metrics-port", "0"]
    procs["decoder"] = _spawn(
        decoder_args + ["--max-num-seqs", "8", "--encoder-cache", "0"], url, tmp_path / "decoder.log"
    )
    try:
        yield registry, procs, f"127.0.0.1:{dec_port}", enc_ports, (m1, m2), url, tmp_path
    finally:
        stop_processes([p for p in procs.values() if p.poll() is None])
        registry.close()


def test_decoder_picks_registered_encoders_and_skips_a_killed_one(cluster, hf_whisper_tokens):
    registry, procs, decoder_address, enc_ports, metrics_ports, url, tmp_path = cluster
    _wait(lambda: _health(decoder_address) is not None, 90, "decoder gRPC up")
    assert _health(decoder_address) == health_pb2.HealthCheckResponse.NOT_SERVING  # no encoder registered
    with grpc.insecure_channel(decoder_address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            _transcribe(stub, 1)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "no live encoder replica serves whisper-tiny.en over shm" in err.value.details(), err.value.details()
        assert "start one or check --kv-transport" in err.value.details()
        assert urlsplit(url).password is None or urlsplit(url).password not in err.value.details()

        for name, port, metrics_port in zip(("enc-a", "enc-b"), enc_ports, metrics_ports, strict=True):
            args = ["serve-encoder", "--port", str(port), "--metrics-port", str(metrics_port)]
            procs[name] = _spawn(args, url, tmp_path / f"{name}.log")
        for name, port in zip(("enc-a", "enc-b"), enc_ports, strict=True):
            wait_healthy(f"127.0.0.1:{port}", 90, procs[name])
        live = registry.replicas("encoder")
        assert sorted(r.address for r in live) == sorted(f"127.0.0.1:{p}" for p in enc_ports)
        assert all(r.kv_transports == ("shm", "torch_dist") and r.shm_id for r in live)
        _wait(lambda: _health(decoder_address) == health_pb2.HealthCheckResponse.SERVING, 15, "decoder SERVING")

        expected = hf_whisper_tokens["short.wav"][:4]
        for _ in range(3):  # concurrent requests spread: this decoder's own in-flight Encodes count as load
            assert all(tokens == expected for tokens in _transcribe(stub, 4))
            if all(_encodes(m) > 0 for m in metrics_ports):
                break
        counts = [_encodes(m) for m in metrics_ports]
        assert all(c > 0 for c in counts), f"Encodes per encoder: {counts}"

        procs["enc-a"].send_signal(signal.SIGKILL)
        procs["enc-a"].wait(10)
        assert any(r.address == f"127.0.0.1:{enc_ports[0]}" for r in registry.replicas("encoder"))  # lease not out
        for _ in range(2):  # every request succeeds: a pick of the dead one goes on to the live one at once
            assert all(tokens == expected for tokens in _transcribe(stub, 4))
        assert _encodes(metrics_ports[1]) == counts[1] + 8
        _wait(lambda: len(registry.replicas("encoder")) == 1, LEASE_TTL_S + 2, "dead encoder's lease expired")
        assert _health(decoder_address) == health_pb2.HealthCheckResponse.SERVING

        # A registered "encoder" that is some other service (here: the decoder's own port, advertising the least
        # load there can be): its UNIMPLEMENTED answer skips it for good and the request goes on to the real one.
        forger = ReplicaRegistry(url, ttl_s=60)
        forged = dataclasses.replace(live[1], replica_id="encoder-forged", address=decoder_address, load=-5)
        forger.register(forged)
        time.sleep(1.5)  # the decoder's registry refresh (every second) sees it
        for _ in range(2):
            assert all(tokens == expected for tokens in _transcribe(stub, 4))
        assert _encodes(metrics_ports[1]) == counts[1] + 16
        forger.deregister("encoder-forged", "encoder")
        forger.close()

        procs["enc-b"].send_signal(signal.SIGTERM)  # a clean stop deregisters at once
        procs["enc-b"].wait(20)
        assert registry.replicas("encoder") == []
        _wait(lambda: _health(decoder_address) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "NOT_SERVING")
