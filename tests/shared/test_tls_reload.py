"""TLS certificates re-read on change (``shared.tls_reload``): the rules of ``fetch`` with a clock of the test's own,
and a rotation on a real server process (``helpers.plumbing_server``) that is never restarted."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path

import grpc
import pytest
from helpers.plumbing_server import plumbing_server
from helpers.tls_certs import have_openssl, make_pki

from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.tls import ClientSecurity
from shared.tls_reload import ReloadingServerCredentials

pytestmark = pytest.mark.skipif(not have_openssl(), reason="needs the openssl command line")


@pytest.fixture(scope="module")
def pkis(tmp_path_factory):
    """Two unrelated CAs, each with a server and a client certificate."""
    root = tmp_path_factory.mktemp("pkis")
    return make_pki(root / "a"), make_pki(root / "b")


def install(src: str, dst: Path) -> None:
    """Replaces ``dst`` with a copy of ``src`` in one rename, as cert-manager or a Secret volume update does."""
    tmp = dst.with_name(dst.name + ".new")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fetch_looks_at_most_once_per_interval_and_answers_only_a_changed_pair(pkis, tmp_path):
    a, b = pkis
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    install(a.server_cert, cert), install(a.server_key, key)
    clock = Clock()
    reloader = ReloadingServerCredentials(str(cert), str(key), clock=clock)
    assert reloader.credentials() is not None
    clock.now += 5
    assert reloader.fetch() is None  # unchanged files
    install(b.server_key, key), install(b.server_cert, cert)
    clock.now += 0.5
    assert reloader.fetch() is None  # looked 0.5 s ago: not yet
    clock.now += 0.6
    assert isinstance(reloader.fetch(), grpc.ServerCertificateConfiguration) and reloader.reloads == 1
    clock.now += 2
    assert reloader.fetch() is None and reloader.reloads == 1  # loaded once


def test_a_half_written_rotation_keeps_the_previous_certificate_and_warns_once(pkis, tmp_path, caplog):
    a, b = pkis
    cert, key, ca = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    install(a.server_cert, cert), install(a.server_key, key), install(a.ca, ca)
    clock = Clock()
    reloader = ReloadingServerCredentials(str(cert), str(key), str(ca), clock=clock)
    install(b.server_key, key)  # the key first: it does not match the certificate still there
    with caplog.at_level(logging.WARNING, logger="shared.tls_reload"):
        for _ in range(3):
            clock.now += 1.5
            assert reloader.fetch() is None
        key.unlink()  # a file missing mid-rotation: one more warning, no exception
        clock.now += 1.5
        assert reloader.fetch() is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "matching private key" in warnings[0], warnings
    install(b.server_key, key), install(b.server_cert, cert), install(b.ca, ca)
    clock.now += 1.5
    assert reloader.fetch() is not None and reloader.reloads == 1


def stats(address: str, security: ClientSecurity) -> str:
    async def call():
        async with security.channel(address) as channel:
            reply = await decoder_pb2_grpc.DecoderServiceStub(channel).GetStats(
                decoder_pb2.GetStatsRequest(), timeout=5
            )
            return reply.model

    return asyncio.run(call())


def refused(address: str, security: ClientSecurity) -> bool:
    try:
        stats(address, security)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return True
    return False


def test_a_running_server_takes_a_rotated_certificate_and_client_ca_without_a_restart(pkis, tmp_path):
    """Mutual TLS with CA A's certificates; the files are replaced by CA B's (server certificate, key and client CA
    bundle); a client of B gets in, one of A no longer does, and the server process is the same."""
    a, b = pkis
    cert, key, ca = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    install(a.server_cert, cert), install(a.server_key, key), install(a.ca, ca)
    client_a = ClientSecurity(tls_ca=a.ca, tls_cert=a.client_cert, tls_key=a.client_key)
    client_b = ClientSecurity(tls_ca=b.ca, tls_cert=b.client_cert, tls_key=b.client_key)
    fields = {"tls_cert": str(cert), "tls_key": str(key), "tls_client_ca": str(ca)}
    log = tmp_path / "server.log"
    with plumbing_server(fields, log, client_a.credentials()) as (address, proc):
        assert stats(address, client_a) == "plumbing"
        assert refused(address, client_b)

        install(b.server_key, key)  # half a rotation: B's key beside A's certificate
        time.sleep(1.2)  # past the once-a-second look
        assert stats(address, client_a) == "plumbing"  # still A's certificate
        assert "still serving the previous certificate" in log.read_text()

        install(b.server_cert, cert), install(b.ca, ca)
        deadline = time.monotonic() + 15
        while refused(address, client_b):  # the first handshakes may fall inside the 1 s between looks
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        assert refused(address, client_a)  # A's CA does not sign B's certificate, B's CA not A's client
        assert proc.poll() is None and "TLS certificate reloaded" in log.read_text()
