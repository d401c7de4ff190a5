"""A service never shares its port: gRPC's default SO_REUSEPORT is off, and the launcher picks new ports when one is taken.

With SO_REUSEPORT (gRPC's default) a second server binds a taken port too and
the kernel splits connections between the two: a decoder's clients then reach
whatever else listens there (UNIMPLEMENTED "Method not found!", as a CI run
saw when its decoder shared a port with an encoder).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from encdec import DATA_DIR, launcher
from encdec.redis_server import free_ports
from shared.errors import BIND_ERROR_EXIT, BindError
from shared.grpc_server import serve
from shared.proto import decoder_pb2, decoder_pb2_grpc

DATA = DATA_DIR


@pytest.fixture
def squatter():
    """A gRPC server with gRPC's default options (SO_REUSEPORT on) that serves nothing; yields its port."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def test_free_ports_are_distinct():
    for _ in range(200):
        ports = free_ports(4)
        assert len(set(ports)) == 4


def test_serve_refuses_a_taken_port(squatter):
    with pytest.raises(BindError, match=f"127.0.0.1:{squatter}.*taken"):
        asyncio.run(serve(lambda server: None, [], f"127.0.0.1:{squatter}"))


def test_services_start_again_on_other_ports_when_one_is_taken(redis_url, squatter, tmp_path, monkeypatch):
    real, calls = launcher.free_ports, []

    def first_pick_taken(count: int) -> list[int]:
        calls.append(count)
        return [squatter] * count if len(calls) == 1 else real(count)

    monkeypatch.setattr(launcher, "free_ports", first_pick_taken)
    with launcher.Services(
        redis_url=redis_url,
        log_dir=str(tmp_path),
        log_level="WARNING",
        extra_encoder_args=["--metrics-port", "0"],
        extra_decoder_args=["--metrics-port", "0"],
    ) as svc:
        assert calls == [2, 2]
        assert squatter not in (svc.encoder_port, svc.decoder_port)
        with grpc.insecure_channel(svc.decoder_address) as channel:
            request = decoder_pb2.GenerateRequest(
                audio=(DATA / "short.wav").read_bytes(), sampling=decoder_pb2.SamplingParams(max_tokens=3)
            )
            messages = list(decoder_pb2_grpc.DecoderServiceStub(channel).Generate(request, timeout=120))
        assert sum(len(m.token_ids) for m in messages) == 3
    assert "taken" in (tmp_path / "encoder.log").read_text()  # the first encoder said why it stopped


def test_a_service_on_a_taken_port_exits_with_bind_error_exit(squatter):
    """What ``encdec serve-encoder --port P`` tells a user whose port P is in use (and what the launcher retries on)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "encdec.cli",
            "--log-level",
            "WARNING",
            "serve-encoder",
            "--port",
            str(squatter),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == BIND_ERROR_EXIT, result.stderr
    assert f"encdec: error: cannot listen on 127.0.0.1:{squatter}: the port is taken" in result.stderr


def test_a_fixed_port_in_use_fails_before_anything_starts(squatter, redis_url):
    """A second `encdec up` on the same ports: refused at once, not 'ready' through the first one's services."""
    with pytest.raises(launcher.ServicesError, match=f"127.0.0.1:{squatter} is already in use"):
        launcher.Services(redis_url=redis_url, encoder_port=squatter).start()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "encdec.cli",
            "up",
            "--redis-url",
            redis_url,
            "--decoder-port",
            str(squatter),
            "--encoder-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and f"encdec: error: 127.0.0.1:{squatter} is already in use" in result.stderr, result
    assert "ready" not in result.stdout and "Traceback" not in result.stderr


def test_decoder_stop_timeout_follows_its_grace(monkeypatch):
    """The grace as the decoder reads it: flag (abbreviated too), else ENCDEC_SHUTDOWN_GRACE_S, else 8 s; plus 7 s."""
    monkeypatch.delenv("ENCDEC_SHUTDOWN_GRACE_S", raising=False)
    assert launcher.shutdown_timeout_s(["serve-decoder"]) == 15.0
    assert launcher.shutdown_timeout_s(["serve-decoder", "--metrics-port", "0", "--shutdown-grace-s", "30"]) == 37.0
    assert launcher.shutdown_timeout_s(["serve-decoder", "--shutdown-grace=2"]) == 9.0
    monkeypatch.setenv("ENCDEC_SHUTDOWN_GRACE_S", "20")
    assert launcher.shutdown_timeout_s(["serve-decoder", "--port", "0"]) == 27.0
    assert launcher.shutdown_timeout_s(["serve-decoder", "--shutdown-grace-s", "1"]) == 8.0  # the flag wins
    assert launcher.shutdown_timeout_s(["serve-decoder", "--shutdown-grace-s", "-1"]) == 15.0  # refused: never started
