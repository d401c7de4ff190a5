"""Scale-out end to end: many encoder and decoder replicas on one Redis, found through its registry.

Real processes (``helpers.replicas``), a redis-server of this module's own (it is restarted mid-run), loopback:
two whisper-tiny.en encoders and two whisper-tiny.en decoders with ``--encoder-address registry``, and a tiny
random T5 encoder + decoder on the same Redis (each decoder must pick encoders of its own model). Leases
live ``TTL_S`` seconds.

- 30 Whisper requests over both decoders and 10 T5 requests at once: every one equals HF's greedy output,
  both Whisper encoders did work and the T5 encoder did all of T5's.
- Abort and GetRequest through the decoder that does not own the request.
- kill -9 of an encoder mid-run: its in-flight requests fail with UNAVAILABLE naming it, the rest and every
  later request finish on the other encoder.
- kill -9 of a decoder mid-request: its records become FAILED ("decoder ... lost") within the lease + 1 s,
  the other decoder's requests finish.
- Redis restarted (nothing persisted) mid-run: running requests finish and their final records are written
  once it is back; new requests are served again.
- A decoder started late takes traffic.

After each: no leaked KV blocks on the live decoders (GetStats), every Redis record terminal.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
import torch
from helpers.metrics import scrape
from helpers.replicas import Replicas, registered_id
from helpers.text_checkpoints import sentence
from helpers.whisper_hf import RATE, joined_clip
from test_e2e_whisper import assert_all_blocks_free

from encdec import DATA_DIR
from encdec.launcher import wait_healthy
from encdec.redis_server import LocalRedisServer
from shared.internal_auth import generate_token_file
from shared.models.registry import load_tokenizer
from shared.proto import decoder_pb2, decoder_pb2_grpc

pytestmark = pytest.mark.timeout(900)

MODEL = "whisper-tiny.en"
TTL_S = 2.0
CLIPS = ["sample.wav", "numbers.wav", "short.wav"]
T5_MAX_NEW = 12
TERMINAL = {decoder_pb2.REQUEST_STATE_FINISHED, decoder_pb2.REQUEST_STATE_ABORTED, decoder_pb2.REQUEST_STATE_FAILED}
STATE_NAMES = {"FINISHED", "ABORTED", "FAILED"}


@pytest.fixture(scope="module")
def redis_server():
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(redis_server, text_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("scale-out")
    token = generate_token_file(str(root / "internal-token"))
    t5 = str(text_checkpoints["t5"])
    reps = Replicas(redis_server.url, str(root / "logs"), token, lease_ttl_s=TTL_S)
    try:
        reps.start(
            [
                reps.encoder("enc1", MODEL),
                reps.encoder("enc2", MODEL),
                reps.encoder("enc-t5", t5),
                reps.decoder("dec1", MODEL, "--encode-timeout-s", "30", "--encoder-cache", "0"),
                reps.decoder("dec2", MODEL, "--encode-timeout-s", "30", "--encoder-cache", "0"),
                reps.decoder("dec-t5", t5, "--block-size", "8", "--max-num-seqs", "8"),
            ]
        )
        yield reps, t5
    finally:
        reps.stop()


class Stubs:
    """One channel per decoder replica, opened on first use."""

    def __init__(self, reps: Replicas) -> None:
        self.reps, self.channels = reps, {}

    def __getitem__(self, name: str) -> decoder_pb2_grpc.DecoderServiceStub:
        address = self.reps[name].address
        if name not in self.channels or self.channels[name][0] != address:
            self.channels[name] = (address, grpc.insecure_channel(address))
        return decoder_pb2_grpc.DecoderServiceStub(self.channels[name][1])


@pytest.fixture(scope="module")
def stubs(cluster):
    s = Stubs(cluster[0])
    yield s
    for _, channel in s.channels.values():
        channel.close()


@pytest.fixture(scope="module")
def t5_cases(cluster):
    """10 T5 sources and HF's greedy ids for each."""
    from transformers import AutoModelForSeq2SeqLM

    _, path = cluster
    tok = load_tokenizer(path)
    rng = random.Random(7)
    sources = [tok(sentence(rng, rng.randint(3, 30)))["input_ids"] for _ in range(10)]
    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([s]), max_new_tokens=T5_MAX_NEW, do_sample=False)[0].tolist()[1:] for s in sources
        ]
    return list(zip(sources, expected))


def whisper(stub, clip: str, request_id: str, timeout: float = 180) -> list:
    request = decoder_pb2.GenerateRequest(request_id=request_id, audio=(DATA_DIR / clip).read_bytes())
    return list(stub.Generate(request, timeout=timeout))


def long_whisper_request(request_id: str) -> decoder_pb2.GenerateRequest:
    """About 65 s of speech: three long-form windows, seconds of work on 2 cores."""
    pcm = joined_clip(2, 3)
    return decoder_pb2.GenerateRequest(
        request_id=request_id,
        pcm=decoder_pb2.PcmAudio(samples=pcm.astype("<f4").tobytes(), sample_rate=RATE),
        whisper=decoder_pb2.WhisperOptions(timestamps=decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT),
    )


def tokens_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def encoder_ok(reps: Replicas, name: str) -> float:
    samples = scrape(reps[name].metrics_port)
    return samples.get(("encdec_encoder_requests_total", (("outcome", "ok"),)), 0.0)


def records(url: str) -> dict[str, dict]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return {key: client.hgetall(key) for key in client.scan_iter(match="encdec:request:*", count=1000)}
    finally:
        client.close()


def assert_records_terminal(url: str, timeout_s: float = 10.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = records(url)
        open_ = {k: v.get("state") for k, v in got.items() if v.get("state") not in STATE_NAMES}
        if not open_ or time.monotonic() > deadline:
            assert not open_, open_
            return got
        time.sleep(0.2)


def assert_clean(reps: Replicas, stubs: Stubs, url: str, decoders=("dec1", "dec2", "dec-t5")) -> None:
    for name in decoders:
        if reps[name].proc.poll() is None:
            assert_all_blocks_free(stubs[name])
    assert_records_terminal(url)


def test_requests_over_both_decoders_and_encoders_equal_hf(cluster, stubs, redis_server, hf_whisper_tokens, t5_cases):
    reps, _ = cluster
    before = {name: encoder_ok(reps, name) for name in ("enc1", "enc2", "enc-t5")}

    def one_whisper(i: int):
        clip = CLIPS[i % len(CLIPS)]
        return "whisper", clip, whisper(stubs["dec1" if i % 2 else "dec2"], clip, f"so-w{i}-{uuid.uuid4().hex[:6]}")

    def one_t5(i: int):
        source, _ = t5_cases[i]
        request = decoder_pb2.GenerateRequest(
            request_id=f"so-t{i}-{uuid.uuid4().hex[:6]}",
            input_ids=decoder_pb2.TokenIds(ids=source),
            sampling=decoder_pb2.SamplingParams(max_tokens=T5_MAX_NEW),
        )
        return "t5", i, list(stubs["dec-t5"].Generate(request, timeout=180))

    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(one_whisper, i) for i in range(30)] + [pool.submit(one_t5, i) for i in range(10)]
        results = [f.result() for f in futures]
    for kind, key, messages in results:
        ids = tokens_of(messages)
        if kind == "whisper":
            assert ids[-1] == 50256 and ids[:-1] == hf_whisper_tokens[key], key
        else:
            assert ids == t5_cases[key][1], key
    after = {name: encoder_ok(reps, name) for name in before}
    done = {name: after[name] - before[name] for name in after}
    assert done["enc1"] > 0 and done["enc2"] > 0, done  # least loaded first: both whisper encoders worked
    assert done["enc1"] + done["enc2"] == 30 and done["enc-t5"] == 10, done  # each decoder: its model's encoders
    assert_clean(reps, stubs, redis_server.url)


def test_abort_and_get_request_through_the_other_decoder(cluster, stubs, redis_server):
    reps, _ = cluster
    request_id = f"so-abort-{uuid.uuid4().hex[:8]}"
    call = stubs["dec1"].Generate(long_whisper_request(request_id), timeout=300)
    first = next(call)  # running on dec1 now
    assert first.request_id == request_id
    record = stubs["dec2"].GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    assert record.owner.startswith("decoder-") and record.state not in TERMINAL, record
    assert stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id=request_id)).aborted
    rest = list(call)
    assert rest[-1].finish_reason == decoder_pb2.FINISH_REASON_ABORT
    deadline = time.monotonic() + 10
    while (
        record := stubs["dec2"].GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
    ).state not in TERMINAL:
        assert time.monotonic() < deadline, record
        time.sleep(0.1)
    assert record.state == decoder_pb2.REQUEST_STATE_ABORTED
    owner = stubs["dec1"].GetStats(decoder_pb2.GetStatsRequest()).replica_id
    assert record.owner == owner == registered_id(redis_server.url, reps["dec1"].address)  # the replica that ran it
    assert not stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id=request_id)).aborted  # ended already
    assert not stubs["dec2"].Abort(decoder_pb2.AbortRequest(request_id="so-never-sent")).aborted
    assert_clean(reps, stubs, redis_server.url)


def test_killed_encoder_fails_its_requests_and_the_other_takes_over(cluster, stubs, redis_server, hf_whisper_tokens):
    reps, _ = cluster
    errors, finished = [], []

    def one(i: int) -> None:
        clip = CLIPS[i % len(CLIPS)]
        try:
            messages = whisper(stubs["dec1" if i % 2 else "dec2"], clip, f"so-ke{i}-{uuid.uuid4().hex[:6]}")
            finished.append((clip, tokens_of(messages)))
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    reps.kill("enc1")
    for t in threads:
        t.join(timeout=240)
    for exc in errors:  # only requests that were on the killed encoder fail, and they say so
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        assert "encoder" in exc.details(), exc.details()
    for clip, ids in finished:
        assert ids[:-1] == hf_whisper_tokens[clip]
    later = [
        whisper(stubs["dec1" if i % 2 else "dec2"], CLIPS[i % 3], f"so-ka{i}-{uuid.uuid4().hex[:6]}") for i in range(4)
    ]
    assert all(tokens_of(m)[:-1] == hf_whisper_tokens[CLIPS[i % 3]] for i, m in enumerate(later))
    assert_clean(reps, stubs, redis_server.url)
    reps.start([reps.encoder("enc1", MODEL)])  # a new replica (new id) for the tests after this one


def test_killed_decoder_requests_fail_within_the_lease(cluster, stubs, redis_server, hf_whisper_tokens):
    reps, _ = cluster
    request_id = f"so-kd-{uuid.uuid4().hex[:8]}"
    call = stubs["dec2"].Generate(long_whisper_request(request_id), timeout=300)
    next(call)
    finished: list = []  # the other decoder's request, sent while dec2 dies
    survivor = threading.Thread(
        target=lambda: finished.append(whisper(stubs["dec1"], "sample.wav", "so-kd-other-" + uuid.uuid4().hex[:6]))
    )
    survivor.start()
    reps.kill("dec2")
    killed_at = time.monotonic()
    with pytest.raises(grpc.RpcError):
        list(call)
    while True:
        record = stubs["dec1"].GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id))
        if record.state in TERMINAL:
            break
        assert time.monotonic() - killed_at < TTL_S + 1.0, record  # the lease + 1 s (issue 23)
        time.sleep(0.1)
    assert record.state == decoder_pb2.REQUEST_STATE_FAILED and "lost" in record.error, record
    assert record.owner in record.error
    survivor.join(timeout=120)
    assert finished and tokens_of(finished[0])[:-1] == hf_whisper_tokens["sample.wav"]
    assert_clean(reps, stubs, redis_server.url, decoders=("dec1", "dec-t5"))


def test_redis_restart_mid_run(cluster, stubs, redis_server, hf_whisper_tokens):
    reps, _ = cluster
    results: dict[str, list] = {}
    ids = [f"so-rr{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]

    refused: list[grpc.RpcError] = []

    def one(i: int) -> None:
        try:
            results[ids[i]] = whisper(stubs["dec1"], CLIPS[i], ids[i])
        except grpc.RpcError as exc:  # sent while Redis was down: refused, never half-run
            refused.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    redis_server.stop()
    time.sleep(1.0)
    redis_server.start()  # same port and password, nothing kept
    for t in threads:
        t.join(timeout=180)
    assert all(exc.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in exc.details() for exc in refused), refused
    for i, request_id in enumerate(ids):
        if request_id in results:  # admitted before the restart: it finished, equal to HF
            assert tokens_of(results[request_id])[:-1] == hf_whisper_tokens[CLIPS[i]]
    wait_healthy(reps["dec1"].address, 30)
    deadline = time.monotonic() + 15
    got = {}
    while time.monotonic() < deadline and len(got) < len(results):  # final states written once Redis answers
        got = {k: v for k, v in records(redis_server.url).items() if k.rsplit(":", 1)[1] in results}
        time.sleep(0.3)
    assert {v["request_id"] for v in got.values()} == set(results), got
    assert all(v["state"] == "FINISHED" for v in got.values()), got
    again = whisper(stubs["dec1"], "short.wav", f"so-rr-after-{uuid.uuid4().hex[:6]}")
    assert tokens_of(again)[:-1] == hf_whisper_tokens["short.wav"]
    assert_clean(reps, stubs, redis_server.url, decoders=("dec1", "dec-t5"))


def test_decoder_started_late_takes_traffic(cluster, stubs, redis_server, hf_whisper_tokens):
    reps, _ = cluster
    reps.start([reps.decoder("dec3", MODEL)])
    with ThreadPoolExecutor(4) as pool:
        out = list(
            pool.map(lambda i: whisper(stubs["dec3"], CLIPS[i % 3], f"so-late{i}-{uuid.uuid4().hex[:6]}"), range(4))
        )
    assert all(tokens_of(m)[:-1] == hf_whisper_tokens[CLIPS[i % 3]] for i, m in enumerate(out))
    assert_clean(reps, stubs, redis_server.url, decoders=("dec1", "dec3", "dec-t5"))
