"""EmbedService through the real encoder service process over gRPC: the real MiniLM
(Embed) and a tiny random BERT cross-encoder (Rerank, Classify, Tokenize, list limits)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
import torch.nn.functional as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.embed_checkpoints import build_classifier
from helpers.embed_sentences import SENTENCES

from encdec.launcher import encoder_service
from encoder_svc.embed.engine import finish_embedding, load_embed_engine
from shared.proto import embed_pb2, embed_pb2_grpc


def _stub(address: str) -> embed_pb2_grpc.EmbedServiceStub:
    return embed_pb2_grpc.EmbedServiceStub(grpc.insecure_channel(address))


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """Both encoder processes, started concurrently (each spends seconds importing and loading)."""
    path = build_classifier(tmp_path_factory.mktemp("cross") / "model", "bert", num_labels=1)
    managers = [encoder_service("all-MiniLM-L6-v2"), encoder_service(str(path), ["--max-inputs-per-request", "10000"])]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        addresses = []
        for m, f in zip(managers, futures):
            try:
                addresses.append(f.result())
                stack.push(m)
            except Exception:
                addresses.append(None)
        if None in addresses:
            pytest.fail("an encoder service did not start (see its output above)")
        yield {"minilm": addresses[0], "cross": addresses[1], "cross_path": path}


@pytest.fixture(scope="module")
def minilm(services):
    return services["minilm"], _stub(services["minilm"])


@pytest.fixture(scope="module")
def cross(services):
    return services["cross_path"], _stub(services["cross"])


def vectors(response) -> torch.Tensor:
    return torch.tensor([list(e.values) for e in response.embeddings])


def test_health_and_minilm_embed_matches_in_process_reference(minilm):
    address, stub = minilm
    with grpc.insecure_channel(address) as ch:
        status = (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="encdec.v1.EmbedService")).status
        )
    assert status == health_pb2.HealthCheckResponse.SERVING
    texts = SENTENCES[::3]
    resp = stub.Embed(embed_pb2.EmbedRequest(inputs=texts, truncate=True))
    assert resp.model == "all-MiniLM-L6-v2" and len(resp.embeddings) == len(texts)
    engine = load_embed_engine("all-MiniLM-L6-v2")  # checked against sentence-transformers in test_embed_minilm
    seqs = engine.tokenize(texts, truncate=True)
    ref = torch.stack([finish_embedding(v, True, 0) for v in engine.forward(seqs, ["mean"] * len(seqs))])
    got = vectors(resp)
    assert F.cosine_similarity(got, ref, dim=1).min().item() >= 0.99999
    torch.testing.assert_close(got.norm(dim=1), torch.ones(len(texts)), atol=1e-5, rtol=0)
    assert [e.num_tokens for e in resp.embeddings] == [len(s.ids) for s in seqs]
    assert resp.usage.prompt_tokens == sum(len(s.ids) for s in seqs)


def test_eight_concurrent_clients_get_what_one_list_gets(minilm):
    _, stub = minilm
    texts = SENTENCES[:24]
    together = vectors(stub.Embed(embed_pb2.EmbedRequest(inputs=texts, truncate=True)))
    with ThreadPoolExecutor(8) as pool:
        alone = list(
            pool.map(lambda t: vectors(stub.Embed(embed_pb2.EmbedRequest(inputs=[t], truncate=True)))[0], texts)
        )
    assert (torch.stack(alone) - together).abs().max().item() < 1e-6


def test_options_pooling_normalize_dimensions(minilm):
    _, stub = minilm
    base = dict(inputs=["hello world", ""])
    raw = vectors(stub.Embed(embed_pb2.EmbedRequest(**base, normalize=False)))
    assert abs(raw[0].norm().item() - 1) > 1e-3  # MiniLM's mean-pooled vectors are not unit length
    cut = vectors(stub.Embed(embed_pb2.EmbedRequest(**base, dimensions=64)))
    torch.testing.assert_close(cut, F.normalize(raw[:, :64], dim=1), atol=1e-6, rtol=0)
    cls = vectors(stub.Embed(embed_pb2.EmbedRequest(**base, pooling=embed_pb2.POOLING_CLS, normalize=False)))
    assert not torch.allclose(cls, raw)


@pytest.mark.parametrize(
    "request_kwargs, code, message",
    [
        (
            dict(inputs=["ok", "word " * 300]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input 1 has 302 tokens, more than this model's limit of 256",
        ),
        (
            dict(inputs=["x"] * 10_000),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "10000 inputs is more than this server's limit of 2048",
        ),
        (dict(inputs=[]), grpc.StatusCode.INVALID_ARGUMENT, "inputs is empty"),
        (dict(inputs=["x"], dimensions=500), grpc.StatusCode.INVALID_ARGUMENT, "dimensions 500"),
        (dict(inputs=["x"], model="other-model"), grpc.StatusCode.NOT_FOUND, "not served here"),
        (dict(inputs=["x"], pooling=7), grpc.StatusCode.INVALID_ARGUMENT, "pooling 7 is not a known Pooling value"),
    ],
    ids=["too-long", "10000-items", "empty-list", "dimensions", "model", "unknown-pooling"],
)
def test_embed_errors(minilm, request_kwargs, code, message):
    _, stub = minilm
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_pb2.EmbedRequest(**request_kwargs))
    assert err.value.code() == code and message in err.value.details()


def test_rerank_on_an_embedding_model_is_a_failed_precondition(minilm):
    _, stub = minilm
    with pytest.raises(grpc.RpcError) as err:
        stub.Rerank(embed_pb2.RerankRequest(query="q", documents=["d"]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_rerank_and_classify_match_hf_over_grpc(cross):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path, stub = cross
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    query, docs = "where is paris?", ["paris is in france.", "the dog runs", "", "blue " * 200]
    resp = stub.Rerank(embed_pb2.RerankRequest(query=query, documents=docs, truncate=True))
    with torch.inference_mode():
        enc = tok([query] * len(docs), docs, padding=True, truncation=True, max_length=128, return_tensors="pt")
        ref = hf(**enc).logits[:, 0].sigmoid()
    scores = {r.index: r.score for r in resp.results}
    assert max(abs(scores[i] - ref[i].item()) for i in range(len(docs))) <= 1e-5
    assert [r.score for r in resp.results] == sorted(scores.values(), reverse=True)
    top = stub.Rerank(embed_pb2.RerankRequest(query=query, documents=docs, truncate=True, top_n=2, raw_scores=True))
    assert len(top.results) == 2 and top.results[0].index == resp.results[0].index
    cls = stub.Classify(embed_pb2.ClassifyRequest(inputs=[embed_pb2.EmbedInput(text=query, text_pair=docs[0])]))
    assert cls.results[0].scores[0].label == "label_a" and abs(cls.results[0].scores[0].score - ref[0].item()) <= 1e-5


def test_tokenize_pairs_carry_token_type_ids(cross):
    _, stub = cross
    resp = stub.Tokenize(embed_pb2.TokenizeRequest(inputs=[embed_pb2.EmbedInput(text="a dog", text_pair="runs")]))
    t = resp.tokens[0]
    assert t.tokens[0] == "[CLS]" and t.tokens[-1] == "[SEP]" and resp.max_input_length == 128
    assert list(t.token_type_ids) == [0] * (len(t.ids) - 2) + [1, 1]
    assert len(t.starts) == len(t.ids)


def test_ten_thousand_items_at_the_configured_limit(cross):
    _, stub = cross
    texts = ["", "a dog runs", " ", "the old boat"] * 2500
    resp = stub.Embed(embed_pb2.EmbedRequest(inputs=texts))
    got = vectors(resp)
    assert got.shape[0] == 10_000
    alone = vectors(stub.Embed(embed_pb2.EmbedRequest(inputs=texts[:4])))
    assert (got[-4:] - alone).abs().max().item() < 1e-6 and torch.equal(got[0], got[2])
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_pb2.EmbedRequest(inputs=texts + ["one more"]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- token-id inputs (EmbedRequest.input_ids, OpenAI's `input` as lists of ids) ---------------------------------


@pytest.fixture(scope="module")
def minilm_engine():
    """The in-process MiniLM: its HF tokenizer gives the ids a client would send."""
    return load_embed_engine("all-MiniLM-L6-v2")


def token_ids(engine, texts: list[str]) -> list[embed_pb2.EmbedTokenIds]:
    return [embed_pb2.EmbedTokenIds(ids=engine.tokenizer(t)["input_ids"]) for t in texts]


ID_TEXTS = [SENTENCES[9], "", "🙂 naïve café", *SENTENCES[20:26]]


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(normalize=False),
        dict(dimensions=64),
        dict(dimensions=64, normalize=False),
        dict(pooling=embed_pb2.POOLING_CLS),
    ],
    ids=["default", "raw", "dimensions", "dimensions-raw", "cls"],
)
@pytest.mark.parametrize("count", [1, len(ID_TEXTS)], ids=["single", "several"])
def test_token_ids_embed_bit_for_bit_as_their_texts(minilm, minilm_engine, options, count):
    _, stub = minilm
    texts = ID_TEXTS[:count]
    by_text = stub.Embed(embed_pb2.EmbedRequest(inputs=texts, **options))
    by_ids = stub.Embed(embed_pb2.EmbedRequest(input_ids=token_ids(minilm_engine, texts), **options))
    assert torch.equal(vectors(by_ids), vectors(by_text))
    assert [e.num_tokens for e in by_ids.embeddings] == [e.num_tokens for e in by_text.embeddings]
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == sum(e.num_tokens for e in by_ids.embeddings)
    assert by_ids.model == "all-MiniLM-L6-v2" and len(vectors(by_ids)[0]) == options.get("dimensions", 384)


def test_token_ids_and_texts_batched_together_embed_bit_for_bit(minilm, minilm_engine):
    _, stub = minilm
    texts = SENTENCES[:12]
    requests = [embed_pb2.EmbedRequest(inputs=texts), embed_pb2.EmbedRequest(input_ids=token_ids(minilm_engine, texts))]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(4):  # sent at once: the batcher may run both in one forward or one after the other
            by_text, by_ids = pool.map(lambda r: vectors(stub.Embed(r)), requests)
            assert torch.equal(by_ids, by_text)


def test_token_id_sequences_share_a_forward_with_other_texts(minilm_engine):
    engine = minilm_engine
    texts, others = ID_TEXTS, SENTENCES[30:36]
    from_ids = engine.encode_ids([t.ids for t in token_ids(engine, texts)])
    from_text = engine.tokenize(texts)
    assert [(s.ids, s.type_ids) for s in from_ids] == [(s.ids, s.type_ids) for s in from_text]
    seqs = from_text + engine.tokenize(others) + from_ids  # one packed forward holding all three
    outs = engine.forward(seqs, ["mean"] * len(seqs))
    for a, b in zip(outs[: len(texts)], outs[-len(texts) :]):
        assert torch.equal(a, b)


def test_over_long_token_ids_fail_or_keep_their_first_max_length_ids(minilm, minilm_engine):
    _, stub = minilm
    ids = token_ids(minilm_engine, ["fine", "word " * 300])
    assert len(ids[1].ids) == 302
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_pb2.EmbedRequest(input_ids=ids))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_ids[1] has 302 tokens, more than this model's limit of 256" in err.value.details()
    cut = stub.Embed(embed_pb2.EmbedRequest(input_ids=ids, truncate=True))
    assert [e.num_tokens for e in cut.embeddings] == [3, 256] and cut.usage.prompt_tokens == 259
    first = embed_pb2.EmbedTokenIds(ids=ids[1].ids[:256])
    assert torch.equal(vectors(cut), vectors(stub.Embed(embed_pb2.EmbedRequest(input_ids=[ids[0], first]))))


@pytest.mark.parametrize(
    "request_kwargs, code, message",
    [
        (
            dict(input_ids=[embed_pb2.EmbedTokenIds(ids=[101, 102]), embed_pb2.EmbedTokenIds(ids=[101, 7, 30522])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input_ids[1] holds token id 30522 (at position 2), outside this model's vocabulary [0, 30522)",
        ),
        (
            dict(input_ids=[embed_pb2.EmbedTokenIds(ids=[101, -1, 102])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input_ids[0] holds token id -1 (at position 1)",
        ),
        (
            dict(input_ids=[embed_pb2.EmbedTokenIds(ids=[101, 102]), embed_pb2.EmbedTokenIds()]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "input_ids[1] is empty; send at least one token id",
        ),
        (
            dict(inputs=["hello"], input_ids=[embed_pb2.EmbedTokenIds(ids=[101, 102])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sets both inputs and input_ids; set only one",
        ),
        (
            dict(input_ids=[embed_pb2.EmbedTokenIds(ids=[101, 102])] * 2049),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "2049 input_ids is more than this server's limit of 2048",
        ),
        (
            dict(input_ids=[embed_pb2.EmbedTokenIds(ids=[101, 102])], dimensions=500),
            grpc.StatusCode.INVALID_ARGUMENT,
            "dimensions 500",
        ),
    ],
    ids=["out-of-vocab", "negative", "empty-list", "both-fields", "2049-lists", "dimensions"],
)
def test_embed_token_id_errors(minilm, request_kwargs, code, message):
    _, stub = minilm
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_pb2.EmbedRequest(**request_kwargs))
    assert err.value.code() == code and message in err.value.details(), err.value.details()
