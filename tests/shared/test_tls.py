"""TLS and mutual TLS of a public gRPC port (``shared.tls``) on real server processes (``helpers.plumbing_server``),
with a CA and certificates made at test time by the ``openssl`` command line."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.plumbing_server import plumbing_server
from helpers.tls_certs import have_openssl, make_pki

from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.tls import ClientSecurity, server_credentials

pytestmark = pytest.mark.skipif(not have_openssl(), reason="needs the openssl command line")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory):
    """Server-side TLS only (no client CA)."""
    fields = {"tls_cert": pki.server_cert, "tls_key": pki.server_key}
    log = tmp_path_factory.mktemp("tls") / "server.log"
    with plumbing_server(fields, log, ClientSecurity(tls_ca=pki.ca).credentials()) as (address, _):
        yield address


@pytest.fixture(scope="module")
def mtls_server(pki, tmp_path_factory):
    """Mutual TLS: clients need a certificate of ``pki.ca``."""
    fields = {"tls_cert": pki.server_cert, "tls_key": pki.server_key, "tls_client_ca": pki.ca}
    log = tmp_path_factory.mktemp("mtls") / "server.log"
    health = ClientSecurity(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key).credentials()
    with plumbing_server(fields, log, health) as (address, _):
        yield address, log


def stats(address: str, security: ClientSecurity) -> decoder_pb2.DecoderStats:
    async def call():
        async with security.channel(address) as channel:
            stub = decoder_pb2_grpc.DecoderServiceStub(channel)
            return await stub.GetStats(decoder_pb2.GetStatsRequest(), timeout=10)

    return asyncio.run(call())


def refused(address: str, security: ClientSecurity) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        stats(address, security)
    return err.value


def test_tls_client_with_the_ca_works(tls_server, pki):
    assert stats(tls_server, ClientSecurity(tls_ca=pki.ca)).model == "plumbing"
    # the certificate's other name, checked instead of the address's host
    assert stats(tls_server, ClientSecurity(tls_ca=pki.ca, tls_server_name="localhost")).model == "plumbing"
    assert stats(tls_server.replace("127.0.0.1", "localhost"), ClientSecurity(tls_ca=pki.ca)).model == "plumbing"


def test_plaintext_client_fails_on_a_tls_port(tls_server):
    assert refused(tls_server, ClientSecurity()).code() == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_fails(tls_server, pki):
    assert refused(tls_server, ClientSecurity(tls_ca=pki.other_ca)).code() == grpc.StatusCode.UNAVAILABLE


def test_name_the_certificate_lacks_fails(tls_server, pki):
    err = refused(tls_server, ClientSecurity(tls_ca=pki.ca, tls_server_name="elsewhere.example"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_server, pki):
    assert refused(mtls_server[0], ClientSecurity(tls_ca=pki.ca)).code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_certificate_of_another_ca(mtls_server, pki):
    other = ClientSecurity(tls_ca=pki.ca, tls_cert=pki.other_client_cert, tls_key=pki.other_client_key)
    assert refused(mtls_server[0], other).code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_accepts_a_certificate_of_its_ca(mtls_server, pki):
    security = ClientSecurity(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    assert stats(mtls_server[0], security).model == "plumbing"
    with grpc.secure_channel(mtls_server[0], security.credentials()) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "mutual TLS" in mtls_server[1].read_text()


def test_server_credentials_refuse_unusable_files(pki, tmp_path):
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    cases = [
        ((str(tmp_path / "missing.pem"), pki.server_key), "tls_cert .* cannot be read"),
        ((str(tmp_path / "junk.pem"), pki.server_key), "not a PEM file"),
        ((pki.server_cert, pki.client_key), "matching private key"),  # a key of another certificate
        ((pki.server_cert, pki.server_key, str(tmp_path / "junk.pem")), "tls_client_ca .* not a PEM file"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            server_credentials(*args)
    assert server_credentials(pki.server_cert, pki.server_key, pki.ca) is not None


def test_client_security_rules(pki):
    with pytest.raises(ValueError, match="go together"):
        ClientSecurity(tls_ca=pki.ca, tls_cert=pki.client_cert)
    with pytest.raises(ValueError, match="--tls-server-name is for TLS"):
        ClientSecurity(tls_server_name="localhost")
    with pytest.raises(ValueError, match="--tls-ca .* cannot be read"):
        ClientSecurity(tls_ca="/nonexistent/ca.pem").credentials()
    assert ClientSecurity().credentials() is None and not ClientSecurity(token="t" * 20).tls


def test_health_port_answers_plaintext_probes_beside_a_tls_port(pki, tmp_path_factory):
    """Kubernetes' native gRPC probes speak no TLS: ``health_port`` serves health alone in plaintext."""
    from encdec.redis_server import free_port

    health_port = free_port()
    fields = {"tls_cert": pki.server_cert, "tls_key": pki.server_key, "health_port": health_port}
    log = tmp_path_factory.mktemp("health-port") / "server.log"
    with plumbing_server(fields, log, ClientSecurity(tls_ca=pki.ca).credentials()) as (address, _):
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:  # the health port serves nothing else
                decoder_pb2_grpc.DecoderServiceStub(channel).GetStats(decoder_pb2.GetStatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert refused(address, ClientSecurity()).code() == grpc.StatusCode.UNAVAILABLE  # main port: TLS only
