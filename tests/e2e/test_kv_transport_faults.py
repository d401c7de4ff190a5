"""Cross-KV transport end to end and under faults, per transport, with the real services.

Redis + encoder + decoder run as separate processes (``encdec.launcher``).
Encoders are killed (SIGKILL) or frozen (SIGSTOP) mid-request, decoders
restarted; every time the request fails with UNAVAILABLE, its Redis record is
FAILED, GetStats shows every block free again, and the next request is served
(the encoder re-attaches to a restarted decoder by its new instance id).
A payload cut off inside the transfer itself is covered at the transport level
in tests/shared/test_kv_transport_dist.py.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
import torch
from test_e2e_whisper import assert_all_blocks_free, wait_state

from encdec import DATA_DIR
from encdec.launcher import Services
from shared.kv_transport import create_pool
from shared.proto import decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc

DATA = DATA_DIR
ENCODE_TIMEOUT_S = 10  # the frozen-encoder case waits this long (tiny.en encodes a clip in well under 1 s)
WHISPER = dict(layers=4, heads=6, head_dim=64, encoder_len=1500)


@pytest.fixture(scope="module", params=["shm", "torch_dist"])
def services(request, redis_url, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp(f"faults-{request.param}")
    args = ["--kv-transport", request.param, "--encode-timeout-s", str(ENCODE_TIMEOUT_S), "--max-num-seqs", "2"]
    with Services(redis_url=redis_url, log_dir=str(log_dir), extra_decoder_args=args) as svc:
        svc.transport = request.param
        yield svc


def stub_for(services):
    channel = grpc.insecure_channel(services.decoder_address)
    return channel, decoder_pb2_grpc.DecoderServiceStub(channel)


def generate(stub, name: str, request_id: str = "", **sampling) -> list[int]:
    request = decoder_pb2.GenerateRequest(
        request_id=request_id, audio=(DATA / name).read_bytes(), sampling=decoder_pb2.SamplingParams(**sampling)
    )
    return [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]


def test_clip_matches_hf(services, hf_whisper_tokens):
    channel, stub = stub_for(services)
    with channel:
        tokens = generate(stub, "numbers.wav")
        assert tokens[:-1] == hf_whisper_tokens["numbers.wav"] and tokens[-1] == 50256
        assert_all_blocks_free(stub)


def _failing_request(stub, request_id: str, errors: list) -> None:
    try:
        generate(stub, "short.wav", request_id)
        errors.append(None)
    except grpc.RpcError as exc:
        errors.append(exc)


def _wait_encoding(stub, request_id: str, timeout_s: float = 60.0) -> None:
    """Polls until the request's Redis record says ENCODING (the record may not exist yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (
                stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id)).state
                == decoder_pb2.REQUEST_STATE_ENCODING
            ):
                return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never reached ENCODING")


def _assert_failed_cleanly(stub, request_id: str, errors: list, thread: threading.Thread) -> None:
    thread.join(ENCODE_TIMEOUT_S + 60)
    assert errors and errors[0] is not None, "the request should have failed"
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors[0].details()
    record = wait_state(stub, request_id, decoder_pb2.REQUEST_STATE_FAILED)
    assert "encoder" in record.error or "cross KV" in record.error, record.error
    assert_all_blocks_free(stub)


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_encoder_fault_fails_request_and_frees_blocks(services, hf_whisper_tokens, fault):
    if fault == "frozen" and services.transport != "torch_dist":
        pytest.skip("the timeout path is the same for shm; run it once")
    channel, stub = stub_for(services)
    encoder = services.process("encoder")
    with channel:
        baseline = assert_all_blocks_free(stub)
        if fault == "frozen":  # the decoder's channel is up, as in service: Encode itself then runs out of time
            generate(stub, "short.wav", max_tokens=1)
        request_id = f"fault-{fault}-{uuid.uuid4().hex[:8]}"
        errors: list = []
        os.kill(encoder.pid, signal.SIGSTOP)  # the request is surely in the encoder's hands when the fault hits
        thread = threading.Thread(target=_failing_request, args=(stub, request_id, errors))
        try:
            thread.start()
            _wait_encoding(stub, request_id)
            if fault == "killed":
                services.kill("encoder")
            else:  # frozen past encode_timeout_s: the decoder gives up on its own
                thread.join(ENCODE_TIMEOUT_S + 60)
        finally:
            if encoder.poll() is None:
                os.kill(encoder.pid, signal.SIGCONT)
        _assert_failed_cleanly(stub, request_id, errors, thread)
        if fault == "frozen":  # the message names the setting that ran out
            assert f"encode_timeout_s={ENCODE_TIMEOUT_S}" in errors[0].details(), errors[0].details()
        if fault == "killed":
            services.restart("encoder")
        tokens = generate(stub, "short.wav")  # a fresh encoder pairs again / the thawed one serves on
        assert tokens[:-1] == hf_whisper_tokens["short.wav"]
        stats = assert_all_blocks_free(stub)
        assert stats.num_cross_blocks == baseline.num_cross_blocks


def test_restarted_decoder_is_re_attached(services, hf_whisper_tokens):
    encoder_pid = services.process("encoder").pid
    channel, stub = stub_for(services)
    with channel:
        generate(stub, "short.wav", max_tokens=2)  # the encoder maps / pairs with this decoder instance
    # shm: a graceful restart (a SIGKILLed decoder cannot unlink its segment); torch_dist: a crash
    services.restart("decoder", signal.SIGTERM if services.transport == "shm" else signal.SIGKILL)
    channel, stub = stub_for(services)
    with channel:
        tokens = generate(stub, "short.wav")
        assert tokens[:-1] == hf_whisper_tokens["short.wav"]
        assert_all_blocks_free(stub)
    assert services.process("encoder").pid == encoder_pid  # the same encoder re-attached


def _direct_encode(services, target, block_ids: list[int], transfer_id: int = 0):
    request = encoder_pb2.EncodeRequest(
        request_id=f"direct-{uuid.uuid4().hex[:6]}",
        pcm=np.zeros(16000, "<f4").tobytes(),
        block_ids=block_ids,
        target=target,
        transfer_id=transfer_id,
    )
    with grpc.insecure_channel(services.encoder_address) as channel:
        return encoder_pb2_grpc.EncoderServiceStub(channel).Encode(request, timeout=60)


def _pool(transport: str, num_blocks: int, block_size: int = 16):
    shape = (WHISPER["layers"], 2, num_blocks, block_size, WHISPER["heads"], WHISPER["head_dim"])
    pool = create_pool(transport, shape) if transport == "shm" else create_pool(transport, shape, address="127.0.0.1:0")
    pool.tensor.fill_(-3.0)
    return pool


def _target(pool) -> encoder_pb2.KVTarget:
    s = pool.spec
    return encoder_pb2.KVTarget(
        transport=s.transport, segment=s.segment, shape=s.shape, dtype=s.dtype, instance_id=s.instance_id
    )


def test_encode_reports_transfer_bytes_and_time(services):
    """The encoder writes into a pool this test process owns; Encode reports what moved."""
    needed = math.ceil(WHISPER["encoder_len"] / 16)
    pool = _pool(services.transport, needed + 3)
    try:
        block_ids = list(range(needed + 2, 2, -1))[:needed]  # descending, not starting at 0
        arrival = pool.expect(11, block_ids)
        response = _direct_encode(services, _target(pool), block_ids, 11)
        nbytes = WHISPER["layers"] * 2 * WHISPER["encoder_len"] * WHISPER["heads"] * WHISPER["head_dim"] * 4
        assert response.transfer_bytes == nbytes and response.transfer_ms > 0 and response.encoder_len == 1500
        if arrival is not None:
            assert arrival.result(timeout=30).nbytes == nbytes
        written = pool.tensor[:, :, block_ids].reshape(WHISPER["layers"], 2, -1, WHISPER["heads"], WHISPER["head_dim"])
        assert torch.all(written[:, :, :1500] != -3.0)
        assert torch.all(pool.tensor[:, :, [0, 1, 2]] == -3.0)  # other requests' blocks untouched
    finally:
        pool.close()


def test_oversized_or_unannounced_transfer_touches_no_block(services):
    if services.transport != "torch_dist":
        pytest.skip("shm's malformed targets are covered in test_e2e_whisper / test_kv_transport")
    needed = math.ceil(WHISPER["encoder_len"] / 16)
    pool = _pool("torch_dist", needed + 2)
    try:
        announced = pool.expect(21, list(range(needed - 1)))  # the decoder reserved one block too few
        with pytest.raises(grpc.RpcError) as info:
            _direct_encode(services, _target(pool), list(range(needed)), 21)
        assert (
            info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not fit the blocks" in info.value.details()
        )
        with pytest.raises(Exception, match="refused"):
            announced.result(timeout=30)
        with pytest.raises(grpc.RpcError) as info:  # never announced
            _direct_encode(services, _target(pool), list(range(needed)), 22)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expects no transfer" in info.value.details()
        assert torch.all(pool.tensor == -3.0)
    finally:
        pool.close()
    for segment, code in [("127.0.0.1:1", grpc.StatusCode.UNAVAILABLE), ("no-port", grpc.StatusCode.INVALID_ARGUMENT)]:
        target = encoder_pb2.KVTarget(
            transport="torch_dist",
            segment=segment,
            shape=[4, 2, 100, 16, 6, 64],
            dtype="float32",
            instance_id="0123456789abcdef",
        )
        with pytest.raises(grpc.RpcError) as info:
            _direct_encode(services, target, list(range(needed)), 1)
        assert info.value.code() == code, info.value.details()
    channel, stub = stub_for(services)
    with channel:
        assert_all_blocks_free(stub)
