"""A request body that is not a valid protobuf gets INVALID_ARGUMENT on every service (issue 20, failure 7).

The real decoder, encoder and embed services run as separate processes; raw channels
(``request_serializer=None``) send bytes that do not parse. The answer names the message the method takes
(``shared.grpc_server.ErrorStatusInterceptor``), instead of gRPC's UNKNOWN "Unexpected DecodeError", and each
service goes on serving.
"""

from __future__ import annotations

import grpc
import pytest

from encdec import DATA_DIR
from encdec.launcher import Services, encoder_service
from shared.proto import decoder_pb2, decoder_pb2_grpc, embed_pb2, embed_pb2_grpc

GARBAGE = [
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a tag varint that never ends
    b"\x0a\x64abc",  # field 1, length 100, 3 bytes follow
    b"\x0f",  # wire type 7 does not exist
]


@pytest.fixture(scope="module")
def services(redis_url, tmp_path_factory):
    with Services(redis_url=redis_url, log_dir=str(tmp_path_factory.mktemp("invalid-protobuf"))) as svc:
        yield svc


@pytest.fixture(scope="module")
def embed_address():
    with encoder_service("all-MiniLM-L6-v2") as address:
        yield address


def send_raw(address: str, method: str, body: bytes, streaming: bool = False) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            result = call(body, timeout=30)
            if streaming:
                list(result)
    return info.value


@pytest.mark.parametrize(
    "service,method,message,streaming",
    [
        ("decoder", "/encdec.v1.DecoderService/Generate", "encdec.v1.GenerateRequest", True),
        ("decoder", "/encdec.v1.DecoderService/GetRequest", "encdec.v1.GetRequestRequest", False),
        ("encoder", "/encdec.v1.EncoderService/Encode", "encdec.v1.EncodeRequest", False),
        ("embed", "/encdec.v1.EmbedService/Embed", "encdec.v1.EmbedRequest", False),
        ("embed", "/encdec.v1.EmbedService/Tokenize", "encdec.v1.TokenizeRequest", False),
        ("decoder", "/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest", False),
        ("encoder", "/grpc.health.v1.Health/Watch", "grpc.health.v1.HealthCheckRequest", True),
    ],
)
def test_garbage_bytes_get_invalid_argument_naming_the_message(request, services, service, method, message, streaming):
    address = (
        request.getfixturevalue("embed_address") if service == "embed" else getattr(services, f"{service}_address")
    )
    for body in GARBAGE:
        error = send_raw(address, method, body, streaming)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, error.code(), error.details())
        assert f"not a valid {message} protobuf" in error.details(), error.details()


def test_services_go_on_serving_after_garbage(services, embed_address):
    for address, method in (
        (services.decoder_address, "/encdec.v1.DecoderService/GetStats"),
        (embed_address, "/encdec.v1.EmbedService/Embed"),
    ):
        send_raw(address, method, GARBAGE[0])
    with grpc.insecure_channel(services.decoder_address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        request = decoder_pb2.GenerateRequest(audio=(DATA_DIR / "short.wav").read_bytes())
        assert [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]
    with grpc.insecure_channel(embed_address) as channel:
        response = embed_pb2_grpc.EmbedServiceStub(channel).Embed(embed_pb2.EmbedRequest(inputs=["hello"]), timeout=60)
        assert len(response.embeddings) == 1
