"""Admission control over real processes (issue 20, failure 5): a bounded queue, priority, deadlines.

Redis + encoder + decoder (a tiny T5, ``--max-waiting-requests 4``, a cross pool of 4 blocks: two 12-token
sources encode at once). The encoder is frozen (SIGSTOP) so that the queue's contents are known exactly:

- a flood beyond the limit: every refusal (RESOURCE_EXHAUSTED naming how many wait and another replica) comes
  back while the encoder is still frozen, so at once; a higher-priority request still enters and displaces the
  latest queued request whose Encode had not started; once the encoder runs again the admitted requests equal
  HF ``generate`` and their single-request transcripts, every block is free, every record terminal;
- a 1 s deadline behind a queue that has not moved for seconds: DEADLINE_EXCEEDED from the decoder itself, no
  record, and the encoder never gets its Encode (``encdec_encoder_requests_total`` counts only the others).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from helpers.metrics import scrape
from helpers.text_checkpoints import sentence
from test_e2e_whisper import assert_all_blocks_free

from encdec.launcher import Services
from encdec.redis_server import free_ports
from shared.models.registry import load_tokenizer
from shared.proto import decoder_pb2, decoder_pb2_grpc

MAX_NEW = 8
MAX_WAITING = 4
SOURCE_LEN = 12  # 2 cross blocks of 8: the 4-block cross pool encodes two requests at once


PRIORITY_TOKEN = "operators-priority-token-0123456789"


def priority_token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("priority-token") / "token"
    path.write_text(PRIORITY_TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def served(text_checkpoints, redis_url, tmp_path_factory):
    path = text_checkpoints["t5"]
    decoder_metrics, encoder_metrics = free_ports(2)
    with Services(
        model=str(path),
        redis_url=redis_url,
        log_dir=str(tmp_path_factory.mktemp("admission-logs")),
        log_level="WARNING",
        extra_decoder_args=[
            *("--block-size", "8", "--max-num-seqs", "4", "--num-cross-blocks", "4", "--encoder-cache", "0"),
            *("--max-waiting-requests", str(MAX_WAITING), "--metrics-port", str(decoder_metrics)),
            *("--min-client-priority", "-1"),  # the flood test's urgent request
            *("--priority-token-file", str(priority_token_file(tmp_path_factory))),
        ],
        extra_encoder_args=["--metrics-port", str(encoder_metrics)],
    ) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield svc, path, decoder_pb2_grpc.DecoderServiceStub(channel), decoder_metrics, encoder_metrics


@pytest.fixture(scope="module")
def sources(served):
    _, path, _, _, _ = served
    tok = load_tokenizer(path)
    rng = random.Random(20)
    out = [tok(sentence(rng, 30))["input_ids"][:SOURCE_LEN] for _ in range(8)]
    assert all(len(s) == SOURCE_LEN for s in out) and len({tuple(s) for s in out}) == len(out)
    return out


def encoder_calls(port: int) -> float:
    return sum(v for (name, _), v in scrape(port).items() if name == "encdec_encoder_requests_total")


def request(src: list[int], request_id: str = "", priority: int = 0) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest(
        request_id=request_id,
        input_ids=decoder_pb2.TokenIds(ids=src),
        priority=priority,
        sampling=decoder_pb2.SamplingParams(max_tokens=MAX_NEW),
    )


class Call(threading.Thread):
    """One Generate in a thread: ``tokens`` when it finished, else ``error``."""

    def __init__(self, stub, req: decoder_pb2.GenerateRequest, timeout_s: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.stub, self.req, self.timeout_s = stub, req, timeout_s
        self.tokens: list[int] | None = None
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            self.tokens = [t for m in self.stub.Generate(self.req, timeout=self.timeout_s) for t in m.token_ids]
        except grpc.RpcError as exc:
            self.error = exc


def wait_for(predicate, what: str, timeout_s: float = 30.0, show=None) -> None:
    """Polls ``predicate`` until it holds; fails naming ``what`` (and ``show()``, what was seen) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: {show() if show else ''}"
        time.sleep(0.05)


def queued(stub) -> int:
    return stub.GetStats(decoder_pb2.GetStatsRequest()).num_queued_requests


def engine_and_admission_counts(stub) -> tuple[int, int]:
    """(sequences in the engine not running, requests in the admission queue)."""
    stats = stub.GetStats(decoder_pb2.GetStatsRequest())
    return stats.num_waiting, stats.num_queued_requests


def state(stub, request_id: str) -> int | None:
    try:
        return stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=request_id), timeout=5).state
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return None


def alone(stub, src: list[int]) -> list[int]:
    return [t for m in stub.Generate(request(src), timeout=120) for t in m.token_ids]


def test_flood_is_refused_at_once_priority_enters_and_the_admitted_equal_hf(served, sources):
    svc, path, stub, decoder_metrics, _ = served
    from transformers import AutoModelForSeq2SeqLM

    hf = AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([s]), max_new_tokens=MAX_NEW, do_sample=False)[0].tolist()[1:] for s in sources
        ]
    single = [alone(stub, s) for s in sources[:5]]
    assert single == expected[:5]
    baseline = assert_all_blocks_free(stub)
    assert baseline.max_waiting_requests == MAX_WAITING

    tag = uuid.uuid4().hex[:6]
    ids = [f"adm-{tag}-{i}" for i in range(MAX_WAITING)]
    encoder = svc.process("encoder")
    os.kill(encoder.pid, signal.SIGSTOP)
    try:
        admitted = []
        for i, rid in enumerate(ids):
            admitted.append(Call(stub, request(sources[i], rid)))
            # One at a time, each into the engine before the next is sent, so that admission and scheduling order
            # are both ids' order. (Admitted is not enough: parsing and the Redis record run in threads, and under
            # the full suite's load a later request reached the engine first and took the cross blocks.)
            wait_for(lambda n=i + 1: engine_and_admission_counts(stub) == (n, n), f"request {i} queued")
        # The first two hold the cross pool and are encoding (the frozen encoder has them); two wait for blocks.
        wait_for(
            lambda: [state(stub, rid) for rid in ids[:2]] == [decoder_pb2.REQUEST_STATE_ENCODING] * 2,
            "encoding",
            show=lambda: ([state(stub, rid) for rid in ids], [c.error for c in admitted]),
        )
        stats = stub.GetStats(decoder_pb2.GetStatsRequest())
        assert stats.num_queued_requests == MAX_WAITING and stats.oldest_queue_wait_s > 0, stats

        flood_ids = [f"adm-{tag}-flood-{i}" for i in range(8)]
        flood = [Call(stub, request(sources[5], rid, priority=(1 if i == 7 else 0))) for i, rid in enumerate(flood_ids)]
        for call in flood:
            call.join(30)
        # Every refusal came back while the encoder is still frozen: none waited for it.
        for call in flood:
            assert not call.is_alive() and call.error is not None, "a request beyond the limit was not refused"
            assert call.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.error
            details = call.error.details()
            assert f"{MAX_WAITING} requests are waiting" in details and "another replica" in details, details
        assert all(state(stub, rid) is None for rid in flood_ids)  # refused before any record
        assert queued(stub) == MAX_WAITING

        # Priority: a more urgent request still enters; the latest queued one not yet encoding makes room.
        high = Call(stub, request(sources[4], f"adm-{tag}-high", priority=-1))
        admitted[3].join(30)
        assert not admitted[3].is_alive() and admitted[3].error is not None
        assert admitted[3].error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, admitted[3].error
        assert "displaced" in admitted[3].error.details(), admitted[3].error.details()
        assert all(call.is_alive() for call in admitted[:3]) and high.is_alive()
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    for call in [*admitted, high]:
        call.join(120)
        assert not call.is_alive()
    for i in range(3):
        assert admitted[i].error is None and admitted[i].tokens == single[i] == expected[i], i
    assert high.error is None and high.tokens == single[4]

    after = assert_all_blocks_free(stub)  # no leak: every block back
    assert after.num_free_cross_blocks == baseline.num_free_cross_blocks
    assert after.num_free_self_blocks == baseline.num_free_self_blocks
    assert after.num_queued_requests == 0
    assert [state(stub, rid) for rid in ids[:3]] == [decoder_pb2.REQUEST_STATE_FINISHED] * 3
    assert state(stub, f"adm-{tag}-high") == decoder_pb2.REQUEST_STATE_FINISHED
    record = stub.GetRequest(decoder_pb2.GetRequestRequest(request_id=ids[3]))
    assert record.state == decoder_pb2.REQUEST_STATE_FAILED and "displaced" in record.error
    got = scrape(decoder_metrics)
    assert got[("encdec_decoder_admission_refusals_total", (("reason", "queue_full"),))] >= 8
    assert got[("encdec_decoder_admission_refusals_total", (("reason", "displaced"),))] >= 1
    assert got[("encdec_decoder_queue_requests", ())] == 0


def test_a_priority_past_the_client_floor_needs_the_priority_token(served, sources):
    """Issue 34 item 5: priorities from --min-client-priority (-1 here) up are open; a more urgent one needs the
    --priority-token-file token in metadata x-encdec-priority-token (a wrong one: PERMISSION_DENIED), and even
    then not past MIN_PRIORITY."""
    _, _, stub, _, _ = served

    def outcome(priority: int, token: str | None = None):
        metadata = [("x-encdec-priority-token", token)] if token is not None else None
        try:
            return [t for m in stub.Generate(request(sources[0], priority=priority), metadata=metadata, timeout=60)
                    for t in m.token_ids]  # fmt: skip
        except grpc.RpcError as exc:
            return exc.code(), exc.details()

    assert isinstance(outcome(-1), list)
    code, details = outcome(-5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "x-encdec-priority-token" in details, details
    code, details = outcome(-5, "not-the-token-at-all-0123456789")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "--priority-token-file" in details, details
    assert outcome(-5, PRIORITY_TOKEN) == outcome(0)  # admitted, and the same tokens
    code, details = outcome(-(2**31), PRIORITY_TOKEN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "even with the priority token" in details, details


def test_short_deadline_behind_a_stalled_queue_is_refused_and_never_encoded(served, sources):
    svc, _, stub, _, encoder_metrics = served
    for _ in range(2):  # a service rate to estimate from (departures of a busy queue)
        calls = [Call(stub, request(s)) for s in sources[:3]]
        for call in calls:
            call.join(120)
            assert call.error is None
    assert_all_blocks_free(stub)
    before = encoder_calls(encoder_metrics)
    tag = uuid.uuid4().hex[:6]
    encoder = svc.process("encoder")
    os.kill(encoder.pid, signal.SIGSTOP)
    try:
        waiting = Call(stub, request(sources[6], f"dl-{tag}-waiting"))
        wait_for(lambda: queued(stub) == 1, "queued")
        # Cross blocks are free for one more, so without admission control the next request would go straight to
        # the frozen encoder. The queue has not moved: its estimated wait grows past the deadline below.
        wait_for(lambda: stub.GetStats(decoder_pb2.GetStatsRequest()).estimated_queue_wait_s > 1.5, "estimate", 120)
        late_id = f"dl-{tag}-late"
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request(sources[7], late_id), timeout=1.0))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "estimated wait" in info.value.details(), info.value.details()  # the decoder's answer, not the timer
        assert waiting.is_alive()
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    waiting.join(120)
    assert waiting.error is None and waiting.tokens == alone(stub, sources[6])
    assert state(stub, late_id) is None  # never queued
    assert_all_blocks_free(stub)
    # Two Encodes since `before`: the waiting request's and the single run above; none for the late one.
    wait_for(lambda: encoder_calls(encoder_metrics) >= before + 2, "encoder metrics")
    time.sleep(0.5)
    assert encoder_calls(encoder_metrics) == before + 2


STALL_S = 6.0  # the stalled request's wait: 6 x the quick stack's --max-queue-time-s


@pytest.fixture(scope="module")
def quick(text_checkpoints, redis_url, tmp_path_factory):
    """A fresh tiny-T5 stack with ``--max-queue-time-s 1``, so one slow request is long next to the limit."""
    path = text_checkpoints["t5"]
    no_metrics = ["--metrics-port", "0"]
    with Services(
        model=str(path),
        redis_url=redis_url,
        log_dir=str(tmp_path_factory.mktemp("admission-quick-logs")),
        log_level="WARNING",
        extra_decoder_args=[*no_metrics, "--max-num-seqs", "4", "--encoder-cache", "0", "--max-queue-time-s", "1"],
        extra_encoder_args=no_metrics,
    ) as svc:
        with grpc.insecure_channel(svc.decoder_address) as channel:
            yield svc, decoder_pb2_grpc.DecoderServiceStub(channel)


def test_one_stalled_request_never_wedges_the_idle_decoder(quick, sources):
    """Issue 34 item 0: after one request that waited long (a huge upload, an encoder stopped for a while), the
    old estimate (the mean gap, times one more than the queue) stayed over --max-queue-time-s with nothing queued,
    and no request was ever admitted again to lower it. Now: a cold burst of max-num-seqs all enter, and after
    the stall an idle decoder admits every request."""
    svc, stub = quick
    burst = [Call(stub, request(s)) for s in sources[:4]]  # cold: no service rate measured yet
    for call in burst:
        call.join(120)
        assert call.error is None, call.error
    encoder = svc.process("encoder")
    os.kill(encoder.pid, signal.SIGSTOP)
    try:
        slow = Call(stub, request(sources[4]))
        wait_for(lambda: queued(stub) == 1, "queued")
        time.sleep(STALL_S)
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    slow.join(120)
    assert slow.error is None, slow.error
    for src in sources[5:8]:  # one after another on the idle decoder: each admitted, none refused
        assert stub.GetStats(decoder_pb2.GetStatsRequest()).estimated_queue_wait_s == 0.0
        assert alone(stub, src)
    assert_all_blocks_free(stub)


LONG_NEW = 255  # tokens a seat-holding request decodes (ignore_eos; the tiny T5 holds 256)


def test_held_seats_are_priced_by_the_measured_service_time(quick, sources):
    """Issue 34 break test (--max-queue-time-s not kept): with every seat held by requests still decoding and
    nothing queued, the old estimate had no departure gap to go by and priced a new request at 0 (a burst entered up
    to --max-waiting-requests and waited for the seats). Now finished requests measure the service time, and the
    wait for a seat is priced by it: above 0 while the seats are held, 0 again once the decoder is idle."""
    svc, stub = quick

    def long(src: list[int]) -> decoder_pb2.GenerateRequest:
        return decoder_pb2.GenerateRequest(
            input_ids=decoder_pb2.TokenIds(ids=src),
            sampling=decoder_pb2.SamplingParams(max_tokens=LONG_NEW, ignore_eos=True),
        )

    estimates = []
    for round_ in range(2):  # the first measures the service time, the second holds every seat
        seated = [Call(stub, long(s)) for s in sources[:4]]
        while any(call.is_alive() for call in seated):
            stats = stub.GetStats(decoder_pb2.GetStatsRequest())
            if round_ == 1 and stats.num_running == 4 and stats.num_queued_requests == 0:
                estimates.append(stats.estimated_queue_wait_s)
            time.sleep(0.01)
        for call in seated:
            assert call.error is None and len(call.tokens) == LONG_NEW, call.error
    assert estimates, "never saw the four seats held"
    assert all(e > 0 for e in estimates), estimates  # the old code: 0.0 each time
    assert stub.GetStats(decoder_pb2.GetStatsRequest()).estimated_queue_wait_s == 0.0  # idle again: admits
    assert alone(stub, sources[5])
    assert_all_blocks_free(stub)
