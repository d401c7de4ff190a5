"""The embed service process (real all-MiniLM-L6-v2) under hostile input and load (issue 20,
failures 2 and 8): huge texts and pairs under a memory ceiling, its /metrics, deadlines and
cancellations dropping queued work unrun. The in-process checks: tests/encoder/test_embed_bounds.py."""

from __future__ import annotations

import grpc
import pytest
import torch
import torch.nn.functional as F
from helpers.embed_sentences import SENTENCES
from helpers.embed_service import (
    MemoryWatchdog,
    embed_process,
    proc_status_kb,
    reset_peak_rss,
    wait_for,
)
from helpers.metrics import scrape

from encdec.redis_server import free_port
from encoder_svc.embed.engine import finish_embedding, load_embed_engine
from shared.proto import embed_pb2, embed_pb2_grpc

CEILING_MB = 400
"""Most the service's peak RSS may grow over its idle RSS while serving the huge requests below
(50 x 1 MB texts arrive as one 50 MB message: the message, its parsed strings and gRPC's buffers
are most of it)."""
ONE_MB = "word " * 200_000
BIG_FORWARD = ["word " * 300] * 96  # 96 x 256 tokens: three 8192-token forwards (~0.8 s each on a 2-core Xeon): a
# call queued behind them waits over a second, however fast the machine (with one forward a 0.5 s deadline raced it)


def _stub(address: str) -> embed_pb2_grpc.EmbedServiceStub:
    return embed_pb2_grpc.EmbedServiceStub(grpc.insecure_channel(address))


@pytest.fixture(scope="module")
def memory_service():
    with embed_process("all-MiniLM-L6-v2", ["--metrics-port", "0"]) as (address, proc):
        yield address, proc


@pytest.fixture(scope="module")
def metrics_service():
    port = free_port()
    with embed_process("all-MiniLM-L6-v2", ["--metrics-port", str(port), "--max-batch-tokens", "8192"]) as (a, p):
        yield a, p, port


@pytest.fixture(scope="module")
def reference():
    return load_embed_engine("all-MiniLM-L6-v2")


def test_huge_texts_and_pairs_stay_under_the_memory_ceiling(memory_service, reference):
    address, proc = memory_service
    stub = _stub(address)
    texts = SENTENCES[::2]
    # Normal inputs: the same vectors and tokens as in process (checked against HF there).
    got = torch.tensor(
        [list(e.values) for e in stub.Embed(embed_pb2.EmbedRequest(inputs=texts, truncate=True)).embeddings]
    )
    seqs = reference.tokenize(texts, truncate=True)
    ref = torch.stack([finish_embedding(v, True, 0) for v in reference.forward(seqs, ["mean"] * len(seqs))])
    assert F.cosine_similarity(got, ref, dim=1).min().item() >= 0.99999
    pair = embed_pb2.EmbedInput(text="a short question?", text_pair="a short answer. " * 60)
    tokens = stub.Tokenize(embed_pb2.TokenizeRequest(inputs=[pair], truncate=True)).tokens[0]
    hf = reference.tokenizer(pair.text, pair.text_pair, truncation="longest_first", max_length=256)
    assert list(tokens.ids) == hf["input_ids"] and list(tokens.token_type_ids) == hf["token_type_ids"]

    idle_kb = proc_status_kb(proc.pid, "VmRSS")
    reset_peak_rss(proc.pid)
    limit_kb = idle_kb + CEILING_MB * 1024
    with MemoryWatchdog(proc.pid, limit_kb) as watchdog:
        try:
            huge_pair = embed_pb2.EmbedInput(text=ONE_MB, text_pair=ONE_MB)
            out = stub.Tokenize(embed_pb2.TokenizeRequest(inputs=[huge_pair], truncate=True), timeout=120).tokens[0]
            assert len(out.ids) == 256 and list(out.token_type_ids).count(1) == 128  # B: 127 tokens + [SEP]
            embedded = stub.Embed(embed_pb2.EmbedRequest(inputs=[ONE_MB] * 50, truncate=True), timeout=300)
            assert [e.num_tokens for e in embedded.embeddings] == [256] * 50
            with pytest.raises(grpc.RpcError) as err:
                stub.Embed(embed_pb2.EmbedRequest(inputs=["fine", ONE_MB]), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "input 1 has 1000000 characters, more than this model's limit of 8192" in err.value.details()
            assert "truncate=true" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.Tokenize(embed_pb2.TokenizeRequest(inputs=[huge_pair]), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        except grpc.RpcError:
            if watchdog.killed_at_kb is not None:
                pytest.fail(f"the service grew to {watchdog.killed_at_kb // 1024} MB RSS (idle {idle_kb // 1024} MB)")
            raise
    assert watchdog.killed_at_kb is None
    peak_kb = proc_status_kb(proc.pid, "VmHWM")
    assert peak_kb - idle_kb < CEILING_MB * 1024, f"peak {peak_kb // 1024} MB over idle {idle_kb // 1024} MB"
    after = stub.Embed(embed_pb2.EmbedRequest(inputs=texts, truncate=True))  # still serving, same vectors
    assert torch.equal(torch.tensor([list(e.values) for e in after.embeddings]), got)


def test_metrics_port_serves_embed_metrics(metrics_service):
    address, _, port = metrics_service
    stub = _stub(address)
    stub.Embed(embed_pb2.EmbedRequest(inputs=["hello", "world"]))
    stub.Tokenize(embed_pb2.TokenizeRequest(inputs=[embed_pb2.EmbedInput(text="hello")]))
    with pytest.raises(grpc.RpcError):
        stub.Embed(embed_pb2.EmbedRequest(inputs=[]))
    m = scrape(port)
    assert m[("encdec_embed_requests_total", (("code", "OK"), ("rpc", "Embed")))] >= 1
    assert m[("encdec_embed_requests_total", (("code", "OK"), ("rpc", "Tokenize")))] >= 1
    assert m[("encdec_embed_requests_total", (("code", "INVALID_ARGUMENT"), ("rpc", "Embed")))] == 1
    assert m[("encdec_embed_request_seconds_count", (("rpc", "Embed"),))] >= 2
    assert m[("encdec_embed_batch_size_count", ())] >= 1 and m[("encdec_embed_sequences_total", ())] >= 2
    assert m[("encdec_embed_queue_requests", ())] == 0 and m[("encdec_embed_queue_sequences", ())] == 0
    assert ("encdec_embed_queue_oldest_wait_seconds", ()) in m
    assert m[("process_resident_memory_bytes", ())] > 0


def _queued(port: int) -> float:
    return scrape(port)[("encdec_embed_queue_requests", ())]


def _dropped(port: int) -> tuple[float, float]:
    m = scrape(port)
    return tuple(m[("encdec_embed_dropped_requests_total", (("reason", r),))] for r in ("expired", "cancelled"))


@pytest.mark.parametrize("how", ["deadline", "cancel"])
def test_a_queued_call_past_its_deadline_or_cancelled_is_never_computed(metrics_service, how):
    address, _, port = metrics_service
    stub = _stub(address)
    before = scrape(port)
    dropped_before = sum(_dropped(port))
    big = stub.Embed.future(embed_pb2.EmbedRequest(inputs=BIG_FORWARD, truncate=True), timeout=300)
    assert wait_for(lambda: _queued(port) == 1, 60)  # in the batcher: its one long forward is under way
    if how == "deadline":
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(embed_pb2.EmbedRequest(inputs=["never computed"] * 3), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        short = stub.Embed.future(embed_pb2.EmbedRequest(inputs=["never computed"] * 3), timeout=300)
        assert wait_for(lambda: _queued(port) == 2, 30)
        short.cancel()
    assert len(big.result().embeddings) == len(BIG_FORWARD)
    assert wait_for(lambda: sum(_dropped(port)) == dropped_before + 1, 30)  # expired or cancelled, dropped unrun
    after = scrape(port)
    reason = "expired" if how == "deadline" else "cancelled"  # a passed deadline is not counted as a cancel
    key = ("encdec_embed_dropped_requests_total", (("reason", reason),))
    assert after[key] - before.get(key, 0.0) == 1
    if how == "deadline":
        code = ("encdec_embed_requests_total", (("code", "DEADLINE_EXCEEDED"), ("rpc", "Embed")))
        assert wait_for(lambda: scrape(port).get(code, 0.0) - before.get(code, 0.0) == 1, 30)
    ran = after[("encdec_embed_sequences_total", ())] - before[("encdec_embed_sequences_total", ())]
    assert ran == len(BIG_FORWARD)  # only the big request's sequences ran
    assert after[("encdec_embed_queue_requests", ())] == 0
    assert len(stub.Embed(embed_pb2.EmbedRequest(inputs=["still serving"]), timeout=60).embeddings) == 1
