"""Rerank / Classify scores against HF ``AutoModelForSequenceClassification`` on tiny random
BERT, RoBERTa and XLM-R checkpoints (tokenizers trained here), loaded through the registry."""

from __future__ import annotations

import pytest
import torch
from helpers.embed_checkpoints import build_classifier

from encoder_svc.embed.engine import label_scores, load_embed_engine
from shared.models.registry import is_encoder_only, resolve_model

TOL = 1e-5
QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "the cat runs over the bridge", "", "blue " * 30, "rain?", "日本 🙂"]
PAIRS = [("a dog runs", "a cat runs"), ("the old boat", None), ("", "empty first segment"), ("who likes music?", "")]


@pytest.fixture(
    scope="module", params=[("bert", 1), ("roberta", 3), ("xlm-roberta", 2)], ids=lambda p: f"{p[0]}-{p[1]}"
)
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    kind, num_labels = request.param
    path = build_classifier(tmp_path_factory.mktemp(kind) / "model", kind, num_labels)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    return kind, path, load_embed_engine(str(path)), hf, AutoTokenizer.from_pretrained(str(path))


def hf_logits(hf, tok, texts, pairs=None) -> torch.Tensor:
    with torch.inference_mode():
        return hf(**tok(texts, pairs, padding=True, return_tensors="pt")).logits


def test_registry_detects_the_architecture(checkpoint):
    kind, path, engine, _, _ = checkpoint
    assert resolve_model(str(path))[0] == kind and is_encoder_only(str(path))
    assert engine.max_input_length == 128  # BERT: 128 positions; RoBERTa: 130 - (padding_idx + 1)


def test_rerank_pairs_match_hf(checkpoint):
    _, _, engine, hf, tok = checkpoint
    seqs = engine.tokenize([QUERY] * len(DOCS), DOCS)
    ours = torch.stack(engine.forward(seqs, ["logits"] * len(seqs)))
    ref = hf_logits(hf, tok, [QUERY] * len(DOCS), DOCS)
    assert (ours - ref).abs().max().item() <= TOL
    multi = engine.multi_label
    assert (label_scores(ours, multi, False) - (ref.sigmoid() if multi else ref.softmax(-1))).abs().max().item() <= TOL


def test_classify_singles_and_pairs_match_hf(checkpoint):
    kind, _, engine, hf, tok = checkpoint
    texts, pairs = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    seqs = engine.tokenize(texts, pairs)
    if kind == "bert":  # a pair's second segment carries token type 1
        assert seqs[0].type_ids is not None and 1 in seqs[0].type_ids and set(seqs[1].type_ids) == {0}
    ours = torch.stack(engine.forward(seqs, ["logits"] * len(seqs)))
    for i, (a, b) in enumerate(PAIRS):  # HF one input at a time: a single and a pair are tokenized differently
        ref = hf_logits(hf, tok, [a], [b] if b is not None else None)[0]
        assert (ours[i] - ref).abs().max().item() <= TOL, (a, b)


def test_truncation_of_pairs_is_longest_first_like_hf(checkpoint):
    _, _, engine, hf, tok = checkpoint
    long_doc = "the quick red boat runs under the old stone bridge " * 20
    seqs = engine.tokenize([QUERY], [long_doc], truncate=True)
    assert len(seqs[0].ids) == engine.max_input_length
    with torch.inference_mode():
        ref = hf(
            **tok([QUERY], [long_doc], truncation=True, max_length=engine.max_input_length, return_tensors="pt")
        ).logits[0]
    assert (engine.forward(seqs, ["logits"])[0] - ref).abs().max().item() <= TOL


def test_embed_on_a_classifier_checkpoint_uses_hidden_states(checkpoint):
    _, _, engine, hf, tok = checkpoint
    seqs = engine.tokenize(["a dog runs"])
    with torch.inference_mode():
        states = hf(**tok(["a dog runs"], return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0]
    assert (engine.forward(seqs, ["cls"])[0] - states[0]).abs().max().item() <= TOL
    assert (engine.forward(seqs, ["mean"])[0] - states.mean(0)).abs().max().item() <= TOL


def test_load_weights_checks_names_and_shapes(checkpoint):
    _, _, engine, _, _ = checkpoint
    model = engine.model
    weights = {name: t.clone() for name, t in model.head_names().items()}
    with pytest.raises(KeyError, match="embeddings.word_embeddings.weight"):
        model.load_weights(weights)
    from shared.models.bert import _copy

    with pytest.raises(ValueError, match="checkpoint shape"):
        _copy(model.embeddings.word_embeddings.weight, torch.zeros(3, 3), "embeddings.word_embeddings.weight")
