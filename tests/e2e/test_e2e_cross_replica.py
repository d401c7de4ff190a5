"""Abort and GetRequest through another decoder replica, and a killed decoder's requests failed by the survivor.

Real processes (``helpers.replicas``) on a redis-server of this module's own, loopback: one whisper-tiny.en
encoder and two decoders pointed at it (``--encoder-address``), leases of ``TTL_S`` seconds.

- A long request on dec1, Abort through dec2: the owner aborts it (aborted=True), its stream ends ABORT,
  GetRequest through dec2 shows ABORTED and dec1 as owner, dec1's blocks are all free again.
- A running request's record deleted (what a Redis restart without persistence does): its final state is
  written whole (owner, model, created_at, tokens).
- dec1 stalled (SIGSTOP) past its lease mid-request: dec2 fails the record; once dec1 runs again it registers
  again and ends the request with UNAVAILABLE saying so (its next state write was refused), blocks freed, and
  serves new requests.
- kill -9 of dec1 mid-request: dec2 marks its record FAILED ("decoder <id> lost") within the lease + ~1 s and
  drops dec1 from the registry.
"""

from __future__ import annotations

import signal
import time
import uuid

import grpc
import pytest
import redis
from helpers.replicas import Replicas, registered_id
from helpers.whisper_hf import RATE, joined_clip
from test_e2e_whisper import assert_all_blocks_free

from encdec import DATA_DIR
from encdec.redis_server import LocalRedisServer
from shared.internal_auth import generate_token_file
from shared.proto import decoder_pb2, decoder_pb2_grpc

pytestmark = pytest.mark.timeout(300)

MODEL = "whisper-tiny.en"
TTL_S = 2.0
AUDIO = (DATA_DIR / "short.wav").read_bytes()
TERMINAL = {decoder_pb2.REQUEST_STATE_FINISHED, decoder_pb2.REQUEST_STATE_ABORTED, decoder_pb2.REQUEST_STATE_FAILED}


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("cross-replica")
    reps = Replicas(redis_server.url, str(root / "logs"), generate_token_file(str(root / "token")), lease_ttl_s=TTL_S)
    try:
        (encoder,) = reps.start([reps.encoder("enc", MODEL)])
        static = ["--model", MODEL, "--encoder-address", encoder.address]
        reps.start([("dec1", "decoder", static), ("dec2", "decoder", static)])
        channels = {name: grpc.insecure_channel(reps[name].address) for name in ("dec1", "dec2")}
        yield reps, {name: decoder_pb2_grpc.DecoderServiceStub(c) for name, c in channels.items()}
        for channel in channels.values():
            channel.close()
    finally:
        reps.stop()


def long_request(request_id: str) -> decoder_pb2.GenerateRequest:
    """440 tokens (no end token): seconds of decoding on 2 cores."""
    sampling = decoder_pb2.SamplingParams(max_tokens=440, ignore_eos=True)
    return decoder_pb2.GenerateRequest(request_id=request_id, audio=AUDIO, sampling=sampling)


def get(stub, request_id: str) -> decoder_pb2.RequestRecord:
    return stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id), timeout=10)


def test_abort_through_the_other_replica(cluster, redis_server):
    reps, stubs = cluster
    dec1_id = registered_id(redis_server.url, reps["dec1"].address)
    request_id = f"xr-abort-{uuid.uuid4().hex[:8]}"
    call = stubs["dec1"].Generate(long_request(request_id), timeout=120)
    first = next(call)  # decoding on dec1 now
    assert first.token_ids
    record = get(stubs["dec2"], request_id)
    assert record.owner == dec1_id and record.state not in TERMINAL, record
    t0 = time.monotonic()
    assert stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id=request_id), timeout=10).aborted
    assert time.monotonic() - t0 < 2.0
    rest = list(call)
    assert rest[-1].finish_reason == decoder_pb2.FINISH_REASON_ABORT
    generated = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert generated < 440  # stopped early
    deadline = time.monotonic() + 10
    while (record := get(stubs["dec2"], request_id)).state not in TERMINAL:
        assert time.monotonic() < deadline, record
        time.sleep(0.05)
    assert record.state == decoder_pb2.REQUEST_STATE_ABORTED and record.owner == dec1_id, record
    assert record.finish_reason == "abort"
    assert_all_blocks_free(stubs["dec1"])  # the owner freed its blocks
    # Ended, unknown, or asked of the owner itself when it does not run it: not aborted.
    assert not stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id=request_id), timeout=10).aborted
    assert not stubs["dec1"].Abort(decoder_pb2.AbortRequest(request_id=request_id), timeout=10).aborted
    assert not stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id="xr-never-sent"), timeout=10).aborted


def test_final_state_written_whole_when_redis_lost_the_record(cluster, redis_server):
    reps, stubs = cluster
    request_id = f"xr-lost-{uuid.uuid4().hex[:8]}"
    call = stubs["dec2"].Generate(long_request(request_id), timeout=120)
    first = next(call)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        created = get(stubs["dec1"], request_id)
        assert client.delete(f"encdec:request:{request_id}") == 1
        with pytest.raises(grpc.RpcError) as info:  # nothing to read any more
            get(stubs["dec1"], request_id)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id=request_id), timeout=10).aborted  # its owner
        rest = list(call)
        assert rest[-1].finish_reason == decoder_pb2.FINISH_REASON_ABORT
        record = wait_terminal(stubs["dec1"], request_id, 10)
        assert record.state == decoder_pb2.REQUEST_STATE_ABORTED and record.finish_reason == "abort", record
        assert (record.owner, record.model) == (created.owner, MODEL) and created.owner
        assert record.created_at == pytest.approx(created.created_at)
        assert record.completion_tokens == len(first.token_ids) + sum(len(m.token_ids) for m in rest)
        assert client.pttl(f"encdec:request:{request_id}") > 0
    finally:
        client.close()


def wait_terminal(stub, request_id: str, timeout_s: float) -> decoder_pb2.RequestRecord:
    deadline = time.monotonic() + timeout_s
    while (record := get(stub, request_id)).state not in TERMINAL:
        assert time.monotonic() < deadline, record
        time.sleep(0.05)
    return record


def test_stalled_decoder_ends_the_request_another_replica_failed(cluster, redis_server):
    reps, stubs = cluster
    dec1 = reps["dec1"].proc
    dec1_id = registered_id(redis_server.url, reps["dec1"].address)
    request_id = f"xr-stall-{uuid.uuid4().hex[:8]}"
    pcm = joined_clip(2, 3)  # about 65 s: three long-form windows, each window's end a state write
    request = decoder_pb2.GenerateRequest(
        request_id=request_id, pcm=decoder_pb2.PcmAudio(samples=pcm.astype("<f4").tobytes(), sample_rate=RATE)
    )
    call = stubs["dec1"].Generate(request, timeout=120)
    next(call)  # the first window decodes
    dec1.send_signal(signal.SIGSTOP)
    try:
        record = wait_terminal(stubs["dec2"], request_id, TTL_S + 3)
    finally:
        dec1.send_signal(signal.SIGCONT)
    assert record.state == decoder_pb2.REQUEST_STATE_FAILED and dec1_id in record.error, record
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert "failed by another replica after this decoder's lease expired" in info.value.details()
    assert get(stubs["dec2"], request_id).error == record.error  # the first end stands
    assert_all_blocks_free(stubs["dec1"])
    deadline = time.monotonic() + 10
    while "registered again" not in reps.log("dec1"):  # its lease came back under the same id
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert registered_id(redis_server.url, reps["dec1"].address) == dec1_id
    after = f"xr-after-{uuid.uuid4().hex[:8]}"
    messages = list(stubs["dec1"].Generate(decoder_pb2.GenerateRequest(request_id=after, audio=AUDIO), timeout=60))
    assert messages[-1].finish_reason == decoder_pb2.FINISH_REASON_STOP
    assert get(stubs["dec2"], after).state == decoder_pb2.REQUEST_STATE_FINISHED


def test_killed_decoder_requests_fail_within_the_lease(cluster, redis_server):
    reps, stubs = cluster
    dec1_id = registered_id(redis_server.url, reps["dec1"].address)
    request_id = f"xr-kill-{uuid.uuid4().hex[:8]}"
    call = stubs["dec1"].Generate(long_request(request_id), timeout=120)
    next(call)
    reps.kill("dec1")
    killed_at = time.monotonic()
    with pytest.raises(grpc.RpcError):
        list(call)
    while (record := get(stubs["dec2"], request_id)).state not in TERMINAL:
        assert time.monotonic() - killed_at < TTL_S + 1.0, record  # the lease + 1 s (issue 23)
        time.sleep(0.05)
    assert record.state == decoder_pb2.REQUEST_STATE_FAILED, record
    assert record.error == f"decoder {dec1_id} lost (its lease expired)" and record.owner == dec1_id
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:  # reaped once: no owner set left, no longer a registered decoder
        assert client.exists(f"encdec:owner:{dec1_id}") == 0
        assert dec1_id not in client.smembers("encdec:replicas:decoder")
        assert client.pttl(f"encdec:request:{request_id}") > 0  # expires like any finished record
    finally:
        client.close()
    assert not stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id=request_id), timeout=10).aborted
    assert "lost (lease expired)" in reps.log("dec2")
