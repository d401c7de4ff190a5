"""The build generates shared/proto/*_pb2*.py importable as shared.proto.*."""

from decoder_svc.replicas.request_state import RequestState
from shared.proto import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc


def test_modules_import_under_shared_proto():
    assert decoder_pb2.DESCRIPTOR.package == "encdec.v1"
    assert hasattr(decoder_pb2_grpc, "DecoderServiceStub")
    assert hasattr(decoder_pb2_grpc, "add_DecoderServiceServicer_to_server")
    assert hasattr(encoder_pb2_grpc, "EncoderServiceStub")
    assert decoder_pb2_grpc.shared_dot_proto_dot_decoder__pb2 is decoder_pb2


def test_generate_request_round_trips():
    req = decoder_pb2.GenerateRequest(
        request_id="r1",
        pcm=decoder_pb2.PcmAudio(samples=b"\x00\x00\x80\x3f", sample_rate=16000),
        sampling=decoder_pb2.SamplingParams(temperature=0.0, max_tokens=5),
    )
    back = decoder_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("input") == "pcm"
    assert back.sampling.HasField("temperature") and not back.sampling.HasField("top_p")


def test_encode_request_round_trips():
    req = encoder_pb2.EncodeRequest(
        request_id="r2",
        block_ids=[3, 1, 4],
        target=encoder_pb2.KVTarget(transport="shm", segment="pool", shape=[4, 2, 8, 16, 6, 64], dtype="float32"),
    )
    assert encoder_pb2.EncodeRequest.FromString(req.SerializeToString()) == req


def test_request_state_enum_matches_proto():
    proto_names = {n for n in decoder_pb2.RequestState.keys() if n != "REQUEST_STATE_UNSPECIFIED"}
    assert proto_names == {"REQUEST_STATE_" + s.name for s in RequestState}
    for s in RequestState:
        assert decoder_pb2.RequestState.Value("REQUEST_STATE_" + s.name) == s.value
