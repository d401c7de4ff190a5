"""The gateway's limits on calls in flight and its memory per upload (issue 34 item 6), over raw HTTP against real
processes: a gateway with ``--max-requests-per-client 2 --max-concurrent-requests 3`` in front of a speech backend
that holds each call as long as its prompt says (``helpers.plumbing_server``); clients told apart by their source
address (127.0.0.x).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import httpx
import pytest
from helpers.gateway_process import gateway_process
from helpers.plumbing_server import plumbing_server

from gateway_svc.limits import client_of

TRANSCRIBE = "/v1/audio/transcriptions"


@pytest.fixture(scope="module")
def speech_backend(tmp_path_factory):
    """``(address, log, token flags)`` of a plumbing speech backend that needs a bearer token (the gateway's
    Generate goes through its token interceptor): a transcription's prompt ``S[:N]`` holds it S seconds."""
    root = tmp_path_factory.mktemp("limits")
    token = root / "token"
    token.write_text("plumbing-token-5e1d")
    fields = {"input_kind": "audio", "auth_token_file": str(token)}
    with plumbing_server(fields, root / "server.log") as (address, _):
        yield address, root / "server.log", ["--backend-token-file", str(token)]


@pytest.fixture(scope="module")
def limited(speech_backend, tmp_path_factory):
    address, _, token_flags = speech_backend
    flags = [*token_flags, "--max-requests-per-client", "2", "--max-concurrent-requests", "3"]
    with gateway_process([address], extra_args=flags, log=tmp_path_factory.mktemp("limited") / "gw.log") as (url, _):
        yield url


def transcribe(url: str, prompt: str, source: str = "127.0.0.1", audio: bytes = b"RIFF....WAVE", **form):
    """A transcription from the client address ``source``."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(base_url=url, transport=transport, timeout=60) as client:
        files = {"file": ("a.wav", audio, "audio/wav")}
        return client.post(TRANSCRIBE, files=files, data={"model": "plumbing", "prompt": prompt, **form})


def wait_for_audio(log: Path, count: int, timeout_s: float = 30.0) -> None:
    """Returns once the backend's log holds ``count`` audio requests in all."""
    deadline = time.monotonic() + timeout_s
    while log.read_text().count("audio of ") < count:
        assert time.monotonic() < deadline, f"the backend did not get {count} audio requests"
        time.sleep(0.05)


def test_a_client_past_its_limit_is_429_and_the_gateway_past_its_limit_503(limited, speech_backend):
    _, log, _ = speech_backend
    seen = log.read_text().count("audio of ")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = [pool.submit(transcribe, limited, "3", source) for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2")]
        wait_for_audio(log, seen + 3)
        refused = transcribe(limited, "0")  # 127.0.0.1's third
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
        assert "2 calls from 127.0.0.1 are in flight" in error["message"], error
        assert "--max-requests-per-client" in error["message"] and refused.headers["retry-after"] == "1"
        full = transcribe(limited, "0", source="127.0.0.3")  # a client with none in flight: the gateway is full
        assert full.status_code == 503, full.text
        assert "--max-concurrent-requests" in full.json()["error"]["message"], full.text
        assert full.headers["retry-after"] == "1" and "x-request-id" in full.headers
        assert httpx.get(limited + "/health", timeout=10).status_code in (200, 503)  # answered, never refused
        assert httpx.get(limited + "/metrics", timeout=10).status_code == 200
        assert all(f.result().status_code == 200 for f in held), [f.result().text for f in held]
    assert transcribe(limited, "0").status_code == 200  # every slot was given back


def test_a_stream_gives_its_slot_back_when_the_client_goes_away(limited):
    files = {"file": ("a.wav", b"RIFF....WAVE", "audio/wav")}
    form = {"model": "plumbing", "prompt": "0:600", "stream": "true"}  # 30 s of events
    with httpx.Client(base_url=limited, timeout=60) as client:
        streams = [client.stream("POST", TRANSCRIBE, files=files, data=form) for _ in range(2)]
        lines = []  # kept: an iterator's close closes its response
        for stream in streams:
            response = stream.__enter__()
            assert response.status_code == 200
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("data: ")
        assert transcribe(limited, "0").status_code == 429
        for stream in streams:
            stream.__exit__(None, None, None)
    deadline = time.monotonic() + 10  # well before the streams' 30 s
    while (answer := transcribe(limited, "0")).status_code == 429:
        assert time.monotonic() < deadline, "the closed streams kept their slots"
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_uploads_waiting_on_the_backend_hold_no_audio_in_the_gateway(speech_backend, tmp_path):
    """8 concurrent 20 MB uploads held 5 s by the backend: the gateway held each one's bytes for the whole call
    (+195 MiB while they waited); now the audio is on disk (spooled) and freed once sent."""
    address, log, token_flags = speech_backend
    with gateway_process([address], extra_args=token_flags, log=tmp_path / "gw.log") as (url, proc):
        assert transcribe(url, "0").status_code == 200  # warm: imports, channels
        before = rss_mib(proc.pid)
        seen = log.read_text().count("audio of ")
        audio = os.urandom(20_000_000)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(transcribe, url, "5", audio=audio) for _ in range(8)]
            wait_for_audio(log, seen + 8)  # every upload was sent on; all 8 calls wait on the backend
            samples = []
            for _ in range(40):  # 2 s of the 5 s wait: the sends' buffers are freed as their writes complete
                samples.append(rss_mib(proc.pid) - before)
                time.sleep(0.05)
            held = min(samples)
            answers = [c.result() for c in calls]
        assert all(a.status_code == 200 and a.json()["text"] == "20000000 bytes" for a in answers), answers[0].text
        assert held < 40, f"the gateway holds {held:.0f} MiB more while 8 uploads of 20 MB wait"


def test_a_call_counts_against_its_api_key_or_its_address():
    def scope(auth: str | None, ip: str = "10.0.0.7") -> dict:
        headers = [(b"authorization", auth.encode())] if auth else []
        return {"headers": headers, "client": (ip, 5555)}

    assert client_of(scope("Bearer sk-1"), "sk-1") == ("key", "sk-1")
    assert client_of(scope("Bearer sk-1", "10.0.0.8"), "sk-1") == ("key", "sk-1")  # one key, one client
    assert client_of(scope("Bearer sk-wrong"), "sk-1") == ("ip", "10.0.0.7")  # a wrong key: its address (a 401)
    assert client_of(scope(None), "sk-1") == ("ip", "10.0.0.7")
    assert client_of(scope("Bearer sk-1"), "") == ("ip", "10.0.0.7")  # no key configured: addresses


def test_realtime_websockets_count_against_the_client_limit(limited):
    """A WebSocket holds a slot from its handshake to its close: with 2 open from one address a third handshake is
    denied with the 429 (it was never counted, so one client could hold every realtime stream); another address
    still connects, and a closed socket gives its slot back."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws_url = limited.replace("http://", "ws://") + "/v1/realtime?model=plumbing"

    def open_from(source: str):
        return connect(ws_url, source_address=(source, 0), open_timeout=30)

    first, second = open_from("127.0.0.7"), open_from("127.0.0.7")
    try:
        with pytest.raises(InvalidStatus) as err:
            open_from("127.0.0.7")
        assert err.value.response.status_code == 429
        assert b"--max-requests-per-client" in err.value.response.body
        open_from("127.0.0.8").close()  # another client is not held up
    finally:
        first.close()
    for _ in range(100):  # the server sees the close shortly after
        try:
            open_from("127.0.0.7").close()
            break
        except InvalidStatus:
            time.sleep(0.05)
    else:
        raise AssertionError("the closed socket's slot never came back")
    second.close()


def test_uploads_past_the_bytes_in_flight_are_503_until_one_ends(speech_backend, tmp_path):
    """An upload spools to /tmp for its whole call (1 GiB in compose and Kubernetes): --max-uploads-in-flight-mb
    bounds the bytes held at once (40 uploads of 25 MB filled /tmp before). Here 0.05 MB: a 40 kB upload held by
    the backend leaves no room for a second one (503 naming the flag) until it ends."""
    address, log, token_flags = speech_backend
    flags = [*token_flags, "--max-uploads-in-flight-mb", "0.05", "--max-requests-per-client", "0"]
    audio = b"RIFF" + bytes(40_000)
    with gateway_process([address], extra_args=flags, log=tmp_path / "gw.log") as (url, _):
        seen = log.read_text().count("audio of ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(transcribe, url, "3", "127.0.0.1", audio)
            wait_for_audio(log, seen + 1)  # the first upload is at the backend: its bytes are held
            second = transcribe(url, "0", "127.0.0.2", audio)
            assert second.status_code == 503 and "--max-uploads-in-flight-mb" in second.text, second.text
            assert held.result(timeout=60).status_code == 200
        assert transcribe(url, "0", "127.0.0.2", audio).status_code == 200  # room again


def test_x_forwarded_for_does_not_make_a_new_client(limited, speech_backend):
    """Issue 34 break test: uvicorn trusted 127.0.0.1's X-Forwarded-For by default, so a local caller naming a new
    address on each call stepped around --max-requests-per-client. No proxy is trusted unless
    --forwarded-allow-ips names it: the third call from one peer is a 429 whatever address it claims."""
    _, log, _ = speech_backend
    seen = log.read_text().count("audio of ")

    def claimed(address: str, prompt: str):
        transport = httpx.HTTPTransport(local_address="127.0.0.9")
        with httpx.Client(base_url=limited, transport=transport, timeout=60) as client:
            files = {"file": ("a.wav", b"RIFF....WAVE", "audio/wav")}
            return client.post(
                TRANSCRIBE,
                files=files,
                data={"model": "plumbing", "prompt": prompt},
                headers={"X-Forwarded-For": address},
            )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(claimed, f"10.0.0.{i}", "3") for i in (1, 2)]
        wait_for_audio(log, seen + 2)
        third = claimed("10.0.0.3", "0")
        assert third.status_code == 429 and "127.0.0.9" in third.text, third.text
        assert all(f.result().status_code == 200 for f in held)


def test_a_request_head_past_64_kib_is_refused_before_it_is_parsed(limited):
    """Issue 34 break test: uvicorn's httptools parser took a header of any size (100 MB of one header: 11 s and
    +200 MB in the gateway before its 401). The gateway runs h11 with a bounded head: 400 at once, and it serves on."""
    import socket

    host, port = limited.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (128 << 10))  # head not ended
        answer = sock.recv(4096)  # refused once 64 KiB are in, without waiting for the rest
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert httpx.get(limited + "/health", timeout=10).status_code in (200, 503)


def test_the_gateway_caps_its_calls_before_a_backend_refuses_its_address():
    """Issue 34 break test: behind one gateway every HTTP user shares the backends' per-address bucket, which was
    256 while the gateway admitted 512 in all, so the 257th call got the backend's "calls from <gateway address>"
    refusal instead of the gateway's own 503. The defaults now agree: the gateway's cap is at most the limit a
    decoder or encoder puts on one address."""
    from gateway_svc.config import GatewayConfig
    from shared.config.decoder import DecoderServiceConfig
    from shared.config.encoder import EncoderServiceConfig

    gateway = GatewayConfig(decoder_address="127.0.0.1:50051")
    for backend in (DecoderServiceConfig(), EncoderServiceConfig()):
        assert 0 < gateway.max_concurrent_requests <= backend.max_requests_per_client, type(backend).__name__
    assert gateway.max_requests_per_client < gateway.max_concurrent_requests
