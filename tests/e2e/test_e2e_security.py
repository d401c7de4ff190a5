"""A secured deployment end to end: a Whisper tiny.en encoder and a decoder whose public port needs a bearer token
(``--auth-token-file``) and mutual TLS (``--tls-cert`` / ``--tls-key`` / ``--tls-client-ca``, a CA made at test
time with ``openssl``), at most 1 call in flight per client (``--max-requests-per-client 1``) and at most 40 new
tokens (``--max-new-tokens 40``); the HTTP gateway in front of it serving HTTPS and holding the backend token and a
client certificate. Real processes, real Redis, loopback only.

Server-side-only TLS and the token's corner cases run on a lighter server: tests/shared/test_tls.py,
tests/shared/test_public_auth.py.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.cli import encdec
from helpers.tls_certs import have_openssl, make_pki

from encdec import DATA_DIR
from encdec.launcher import encoder_service, stop_processes, wait_healthy
from encdec.redis_server import free_port
from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.tls import ClientSecurity

pytestmark = pytest.mark.skipif(not have_openssl(), reason="needs the openssl command line")

ROOT = Path(__file__).resolve().parents[2]
CLIP = DATA_DIR / "sample.wav"
TOKEN = "e2e-bearer-token-0123456789abcdef"
MAX_NEW_TOKENS = 40


class Secured:
    def __init__(self, address: str, pki, token_file: str, log: Path) -> None:
        self.address, self.pki, self.token_file, self.log = address, pki, token_file, log

    def security(self, token: str = TOKEN, cert: bool = True) -> ClientSecurity:
        pki = self.pki
        if not cert:
            return ClientSecurity(token=token, tls_ca=pki.ca)
        return ClientSecurity(token=token, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)


@pytest.fixture(scope="module")
def secured(redis_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("secured")
    pki = make_pki(root / "pki")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    log = root / "decoder.log"
    with encoder_service("whisper-tiny.en", ["--metrics-port", "0"]) as encoder:
        port = free_port()
        args = [
            *("serve-decoder", "--port", str(port), "--encoder-address", encoder, "--redis-url", redis_url),
            *("--metrics-port", "0", "--auth-token-file", str(token_file)),
            *("--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca),
            *("--max-requests-per-client", "1", "--max-new-tokens", str(MAX_NEW_TOKENS)),
        ]
        with open(log, "ab") as out:
            proc = subprocess.Popen(encdec(*args, log_level="INFO"), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            secured = Secured(f"127.0.0.1:{port}", pki, str(token_file), log)
            wait_healthy(secured.address, 180, proc, secured.security().credentials())
            yield secured
        finally:
            stop_processes([proc])


def generate(address: str, security: ClientSecurity, **sampling) -> list[decoder_pb2.GenerateResponse]:
    async def call():
        async with security.channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            request = decoder_pb2.GenerateRequest(
                audio=CLIP.read_bytes(), sampling=decoder_pb2.SamplingParams(**sampling)
            )
            return [m async for m in stub.Generate(request, timeout=60)]

    return asyncio.run(call())


def refusal(address: str, security: ClientSecurity, **sampling) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        generate(address, security, **sampling)
    return err.value


def text_of(messages) -> str:
    return "".join(m.text for m in messages).strip()


def test_health_needs_no_token(secured):
    with grpc.secure_channel(secured.address, secured.security().credentials()) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_token_and_wrong_token_are_unauthenticated(secured):
    missing = refusal(secured.address, secured.security(token=""))
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED and "missing bearer token" in missing.details()
    wrong = refusal(secured.address, secured.security(token="not-the-token-0123456789abcdef"))
    assert (wrong.code(), wrong.details()) == (grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
    assert TOKEN not in secured.log.read_text()


def test_plaintext_and_certificate_less_clients_are_refused(secured):
    assert refusal(secured.address, ClientSecurity(token=TOKEN)).code() == grpc.StatusCode.UNAVAILABLE
    assert refusal(secured.address, secured.security(cert=False)).code() == grpc.StatusCode.UNAVAILABLE
    pki = secured.pki
    other = ClientSecurity(token=TOKEN, tls_ca=pki.ca, tls_cert=pki.other_client_cert, tls_key=pki.other_client_key)
    assert refusal(secured.address, other).code() == grpc.StatusCode.UNAVAILABLE


def test_transcribe_cli_with_token_and_client_certificate(secured):
    want = text_of(generate(secured.address, secured.security()))
    assert want
    pki = secured.pki
    tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]
    run = subprocess.run(
        encdec("transcribe", "--address", secured.address, *tls, str(CLIP)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ENCDEC_TOKEN": TOKEN},  # the token from the environment
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == want
    from_file = subprocess.run(
        encdec("transcribe", "--address", secured.address, "--token-file", secured.token_file, *tls, str(CLIP)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert from_file.returncode == 0 and from_file.stdout.strip() == want, from_file.stderr
    no_token = subprocess.run(
        encdec("transcribe", "--address", secured.address, *tls, str(CLIP)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "ENCDEC_TOKEN"},
    )
    assert no_token.returncode == 1 and "UNAUTHENTICATED: missing bearer token" in no_token.stderr


def test_max_tokens_over_max_new_tokens_is_invalid_argument(secured):
    err = refusal(secured.address, secured.security(), max_tokens=MAX_NEW_TOKENS + 1)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_tokens is {MAX_NEW_TOKENS + 1}" in err.details() and "--max-new-tokens" in err.details()
    assert text_of(generate(secured.address, secured.security(), max_tokens=MAX_NEW_TOKENS))


def test_two_concurrent_calls_of_one_client_one_refused(secured):
    async def both():
        security = secured.security()
        request = decoder_pb2.GenerateRequest(audio=CLIP.read_bytes())

        async def one():
            async with security.channel(secured.address) as channel:
                stub = decoder_pb2_grpc.DecoderServiceStub(channel)
                return [m async for m in stub.Generate(request, timeout=60)]

        return await asyncio.gather(one(), one(), return_exceptions=True)

    results = asyncio.run(both())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 1, results
    assert refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-requests-per-client" in refused[0].details()
    assert [text_of(r) for r in results if isinstance(r, list)][0]


def start_gateway(secured, tmp_path, token_file: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """``encdec serve-http`` in front of the secured decoder, with a client certificate and ``token_file``."""
    pki, port = secured.pki, free_port()
    args = [
        *("serve-http", "--port", str(port), "--decoder-address", secured.address, *extra),
        *("--backend-token-file", token_file, "--backend-tls-ca", pki.ca),
        *("--backend-tls-cert", pki.client_cert, "--backend-tls-key", pki.client_key),
    ]
    with open(tmp_path / "gateway.log", "ab") as out:
        return subprocess.Popen(encdec(*args), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT), port


def gateway_health(client: httpx.Client, url: str, proc, tmp_path, status: int | None = None) -> httpx.Response:
    """The gateway's first ``/health`` answer (of ``status``, if given) within 60 s."""
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
        try:
            got = client.get(f"{url}/health")
            if status is None or got.status_code == status:
                return got
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the gateway never answered as expected"
        time.sleep(0.2)


def transcribe_over_http(client: httpx.Client, url: str) -> httpx.Response:
    return client.post(
        f"{url}/v1/audio/transcriptions",
        data={"model": "whisper-tiny.en"},
        files={"file": (CLIP.name, CLIP.read_bytes(), "audio/wav")},
    )


def test_https_gateway_with_backend_token_and_certificate(secured, tmp_path):
    pki = secured.pki
    proc, port = start_gateway(
        secured, tmp_path, secured.token_file, "--tls-cert", pki.server_cert, "--tls-key", pki.server_key
    )
    try:
        url = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=pki.ca), timeout=60) as client:
            gateway_health(client, url, proc, tmp_path, 200)
            got = transcribe_over_http(client, url)
        assert got.status_code == 200, got.text
        assert got.json()["text"] == text_of(generate(secured.address, secured.security()))
        with pytest.raises(httpx.TransportError):  # plaintext HTTP to the HTTPS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        stop_processes([proc])


def test_gateway_with_a_wrong_backend_token_says_so(secured, tmp_path):
    """The decoder's health is open to all, so only the gateway's own discovery sees the refusal: /health and
    the request say it is the gateway's credentials, not a backend that "did not answer"."""
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-deployment-token-0123456789\n")
    proc, port = start_gateway(secured, tmp_path, str(wrong))
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=60) as client:
            health = gateway_health(client, url, proc, tmp_path)
            assert health.status_code == 503 and health.json()["backends"] == {"serving": 0, "total": 1}, health.text
            got = transcribe_over_http(client, url)
        assert got.status_code == 503, got.text
        message = got.json()["error"]["message"]
        assert "UNAUTHENTICATED" in message and "--backend-token-file" in message, message
        assert secured.address not in message and secured.address not in health.text  # the log names it (issue 34)
        logged = (tmp_path / "gateway.log").read_text()
        assert "refuses the gateway's credentials" in logged and secured.address in logged, logged
        assert "not-the-deployment-token" not in logged  # never logged
    finally:
        stop_processes([proc])
