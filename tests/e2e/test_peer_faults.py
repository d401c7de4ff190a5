"""The decoder under its peers' faults (issue 20, failures 3 and 4), with real processes.

A redis-server this module starts on a free port (so it can be stopped and
started again on the same port), an encoder and a decoder (``encdec.launcher``):

- Redis stopped while requests encode: the running requests finish (issue 23:
  Redis is the record, not a condition of serving what was admitted) within a
  bounded time (none hangs), GetStats shows every block free again, the
  decoder's health turns NOT_SERVING and a new request is refused naming Redis;
  Redis back on the same port, empty: health SERVING again, the finished
  requests' records are written whole (FINISHED), and a new request is served.
- Redis frozen (SIGSTOP) while requests encode: the requests finish once the
  store's socket timeouts run out, and once Redis answers again their records
  read FINISHED (written late: none left ENCODING).
- Encoder killed (SIGKILL): the decoder's health turns NOT_SERVING, a request
  sent meanwhile fails with UNAVAILABLE naming the encoder once
  ``--encode-timeout-s`` runs out, its blocks freed; encoder restarted: the
  very first request after the encoder's health returns succeeds (no fast
  failures during gRPC's reconnect backoff), and the decoder's health is
  SERVING again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_e2e_whisper import HF_RULES, assert_all_blocks_free

from encdec import DATA_DIR
from encdec.launcher import Services
from encdec.redis_server import LocalRedisServer
from shared.proto import decoder_pb2, decoder_pb2_grpc

ENCODE_TIMEOUT_S = 10
NUM_REQUESTS = 4
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def services(redis_server, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("peer-faults")
    args = ["--encode-timeout-s", str(ENCODE_TIMEOUT_S), "--max-num-seqs", str(NUM_REQUESTS)]
    with Services(redis_url=redis_server.url, log_dir=str(log_dir), extra_decoder_args=args) as svc:
        yield svc


@pytest.fixture
def stub(services):
    with grpc.insecure_channel(services.decoder_address) as channel:
        yield decoder_pb2_grpc.DecoderServiceStub(channel)


def health_of(address: str) -> dict[str, int | None]:
    """The health status of ``""`` and of the decoder's service name at ``address`` (None: no answer)."""
    out = {}
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "encdec.v1.DecoderService"):
            try:
                out[name] = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=2).status
            except grpc.RpcError:
                out[name] = None
    return out


def wait_health(address: str, status: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = health_of(address)
        if all(s == status for s in seen.values()):
            return
        if time.monotonic() > deadline:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            raise AssertionError(f"decoder health never became {name} within {timeout_s} s: {seen}")
        time.sleep(0.2)


def unique_pcm(seed: int, seconds: float = 2.0) -> bytes:
    """Noise no other request has (so the encoder cache shares nothing): float32 PCM at 16 kHz."""
    return (np.random.default_rng(seed).standard_normal(int(seconds * 16000)) * 0.05).astype("<f4").tobytes()


def generate_pcm(stub, request_id: str, pcm: bytes, timeout_s: float = 60.0, **sampling) -> list:
    request = decoder_pb2.GenerateRequest(
        request_id=request_id,
        pcm=decoder_pb2.PcmAudio(samples=pcm, sample_rate=16000),
        sampling=decoder_pb2.SamplingParams(**sampling),
        # HF rules encode every window: the openai rules' VAD gate finds no speech in noise and needs no encoder
        whisper=HF_RULES,
    )
    return list(stub.Generate(request, timeout=timeout_s))


def generate_clip(stub, name: str, timeout_s: float = 60.0) -> list[int]:
    request = decoder_pb2.GenerateRequest(audio=(DATA_DIR / name).read_bytes())
    return [t for m in stub.Generate(request, timeout=timeout_s) for t in m.token_ids]


def record_state(stub, request_id: str) -> int | None:
    try:
        return stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id), timeout=5).state
    except grpc.RpcError:
        return None


def test_redis_stopped_mid_encode_running_requests_finish_and_are_recorded_once_it_is_back(
    services, redis_server, stub, hf_whisper_tokens
):
    baseline = assert_all_blocks_free(stub)
    ids = [f"redis-fault-{i}-{uuid.uuid4().hex[:6]}" for i in range(NUM_REQUESTS)]
    outcomes: dict[str, object] = {}
    ended_at: dict[str, float] = {}

    def call(request_id: str, seed: int) -> None:
        try:
            generate_pcm(stub, request_id, unique_pcm(seed), timeout_s=100, max_tokens=8)
            outcomes[request_id] = None
        except grpc.RpcError as exc:
            outcomes[request_id] = exc
        ended_at[request_id] = time.monotonic()

    encoder = services.process("encoder")
    os.kill(encoder.pid, signal.SIGSTOP)  # every request is surely ENCODING when Redis goes
    threads = [threading.Thread(target=call, args=(rid, 100 + i)) for i, rid in enumerate(ids)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(record_state(stub, rid) == decoder_pb2.REQUEST_STATE_ENCODING for rid in ids):
            assert time.monotonic() < deadline, {rid: record_state(stub, rid) for rid in ids}
            time.sleep(0.1)
        redis_server.stop()
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    stopped_at = time.monotonic()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hangs after Redis stopped"
    for rid in ids:
        assert outcomes[rid] is None, f"{rid} failed: {outcomes[rid]}"  # admitted before Redis went: it finished
        assert ended_at[rid] - stopped_at < 30, f"{rid} ended {ended_at[rid] - stopped_at:.1f} s after Redis stopped"
    stats = assert_all_blocks_free(stub)  # GetStats needs no Redis
    assert stats.num_free_cross_blocks == baseline.num_cross_blocks
    wait_health(services.decoder_address, NOT_SERVING)
    with pytest.raises(grpc.RpcError) as info:  # a new request is refused at once, naming Redis
        generate_clip(stub, "short.wav", timeout_s=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis at" in info.value.details()

    redis_server.start()  # the same port: the decoder's URL is valid again; nothing kept
    wait_health(services.decoder_address, SERVING)
    deadline = time.monotonic() + 15  # written when the readiness probe finds Redis back
    while any(record_state(stub, rid) != decoder_pb2.REQUEST_STATE_FINISHED for rid in ids):
        assert time.monotonic() < deadline, {rid: record_state(stub, rid) for rid in ids}
        time.sleep(0.2)
    tokens = generate_clip(stub, "short.wav")
    assert tokens[:-1] == hf_whisper_tokens["short.wav"]
    assert_all_blocks_free(stub)


def test_redis_frozen_mid_encode_requests_finish_and_are_recorded_once_redis_answers(services, redis_server, stub):
    wait_health(services.decoder_address, SERVING)
    ids = [f"redis-frozen-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    outcomes: dict[str, object] = {}

    def call(request_id: str, seed: int) -> None:
        try:
            generate_pcm(stub, request_id, unique_pcm(seed), timeout_s=100, max_tokens=8)
            outcomes[request_id] = None
        except grpc.RpcError as exc:
            outcomes[request_id] = exc

    encoder = services.process("encoder")
    os.kill(encoder.pid, signal.SIGSTOP)
    threads = [threading.Thread(target=call, args=(rid, 200 + i)) for i, rid in enumerate(ids)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(record_state(stub, rid) == decoder_pb2.REQUEST_STATE_ENCODING for rid in ids):
            assert time.monotonic() < deadline, {rid: record_state(stub, rid) for rid in ids}
            time.sleep(0.1)
        os.kill(redis_server.pid, signal.SIGSTOP)
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    try:
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request hangs while Redis is frozen"
        for rid in ids:
            assert outcomes[rid] is None, f"{rid} failed: {outcomes[rid]}"
        assert_all_blocks_free(stub)
        wait_health(services.decoder_address, NOT_SERVING)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    wait_health(services.decoder_address, SERVING)
    deadline = time.monotonic() + 15
    while any(record_state(stub, rid) != decoder_pb2.REQUEST_STATE_FINISHED for rid in ids):
        assert time.monotonic() < deadline, {rid: record_state(stub, rid) for rid in ids}
        time.sleep(0.2)
    for rid in ids:  # caught up from ENCODING through DECODING, with the usage
        record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=rid))
        assert record.finish_reason in ("stop", "length") and record.completion_tokens > 0, record


def test_encoder_killed_then_restarted_first_request_succeeds(services, stub, hf_whisper_tokens):
    wait_health(services.decoder_address, SERVING)
    baseline = assert_all_blocks_free(stub)
    services.kill("encoder")  # SIGKILL: a crash
    wait_health(services.decoder_address, NOT_SERVING)
    # A request while no encoder is reachable waits for one up to --encode-timeout-s, then fails naming it.
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate_pcm(stub, f"no-encoder-{uuid.uuid4().hex[:6]}", unique_pcm(7), timeout_s=60, max_tokens=4)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert "encoder at" in info.value.details() and f"encode_timeout_s={ENCODE_TIMEOUT_S}" in info.value.details()
    assert time.monotonic() - started < ENCODE_TIMEOUT_S + 20
    assert_all_blocks_free(stub)
    assert health_of(services.decoder_address)[""] == NOT_SERVING  # still no encoder

    services.restart("encoder")  # returns once the encoder's own health says SERVING
    tokens = generate_clip(stub, "short.wav")  # the very first request after it: no reconnect-backoff failure
    assert tokens[:-1] == hf_whisper_tokens["short.wav"]
    wait_health(services.decoder_address, SERVING)
    stats = assert_all_blocks_free(stub)
    assert stats.num_cross_blocks == baseline.num_cross_blocks
