"""Opt-in int8 decoder/encoder weights (``shared.models.quantize``) on the real Whisper tiny.en: transcripts and batch
invariance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.paged_greedy import paged_greedy_decode

from shared.config import DecoderServiceConfig, EncoderServiceConfig
from shared.models.quantize import Int8Linear, apply_quantization
from shared.models.registry import load_model


def test_int8_model_transcribes_like_hf(whisper_model_dir, whisper_features, hf_whisper_tokens):
    """int8 encoder, cross-KV projections and decoder: every bundled clip's greedy transcript stays HF's (with
    torch's per-tensor dynamic quantization in the encoder, one of the five flipped)."""
    model = load_model(whisper_model_dir)
    apply_quantization(model, "int8", "decoder")
    apply_quantization(model, "int8", "encoder")
    assert isinstance(model.decoder_layers[0].fc1, Int8Linear)
    assert isinstance(model.encoder_layers[0].fc1, Int8Linear)
    assert isinstance(model.decoder_layers[0].cross_kv, Int8Linear)
    assert model.output_projection is not None
    assert not model.decoder_layers[0].ffn_norm.use_kernel  # int8 keeps torch's norms (shared.models.quantize)
    names = sorted(whisper_features)
    with torch.inference_mode():
        ours = paged_greedy_decode(model, torch.stack([whisper_features[n] for n in names]))
    assert {n: o for n, o in zip(names, ours)} == {n: hf_whisper_tokens[n] for n in names}


def test_int8_decoder_alone_keeps_every_transcript(whisper_model_dir, whisper_features, hf_whisper_tokens):
    """int8 decoder layers + int8 output projection whose top candidates are rescored in fp32."""
    model = load_model(whisper_model_dir)
    apply_quantization(model, "int8", "decoder")
    names = sorted(whisper_features)
    with torch.inference_mode():
        ours = paged_greedy_decode(model, torch.stack([whisper_features[n] for n in names]))
    assert {n: o for n, o in zip(names, ours)} == {n: hf_whisper_tokens[n] for n in names}


def test_int8_output_projection_rescores_top_candidates_exactly():
    from shared.models.quantize import Int8OutputProjection

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 24, generator=g)
    hidden = torch.randn(6, 24, generator=g)
    exact = hidden @ weight.T  # [6, 500]
    got = Int8OutputProjection(weight, rescore_top_k=8)(hidden)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = exact.topk(3, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)


def test_quantize_setting_is_validated():
    with pytest.raises(ValueError, match="quantize"):
        DecoderServiceConfig(quantize="int4")
    with pytest.raises(ValueError, match="quantize"):
        EncoderServiceConfig(quantize="fp8")
    with pytest.raises(ValueError, match="quantize"):
        apply_quantization(torch.nn.Linear(2, 2), "int4", "decoder")


def test_int8_linear_rows_do_not_depend_on_each_other():
    """Per-row activation scales and integer sums: a row's output is the same bit for bit alone or among rows of
    very different magnitudes (torch's dynamic quantization, one scale per tensor, fails this)."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(48, 40)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 48, generator=g))
    x = torch.randn(7, 48, generator=g) * torch.tensor([1e-3, 0.1, 1, 3, 10, 100, 0.0]).unsqueeze(1)
    int8 = Int8Linear.from_linear(layer)
    together = int8(x)
    assert torch.equal(together, torch.cat([int8(x[i : i + 1]) for i in range(len(x))]))
    assert torch.equal(int8(x.view(7, 1, 48)), together.view(7, 1, 40))  # [..., in] inputs
    exact = layer(x)
    err = (together - exact).abs().amax(1) / exact.abs().amax(1)
    assert (err[:6] < 0.03).all(), err  # within ~1 % of each row's scale
    assert torch.equal(together[6], layer.bias.detach())  # a zero row gives the bias


def test_int8_whisper_decoding_is_batch_invariant(whisper_model_dir, whisper_features):
    """Each clip's logits, decoded alone, equal its logits decoded next to the others joining one by one (prefills
    beside decode rows), bit for bit."""
    model = load_model(whisper_model_dir)
    apply_quantization(model, "int8", "decoder")
    names = sorted(whisper_features)[:3]
    batched: list[list[torch.Tensor]] = []
    with torch.inference_mode():
        paged_greedy_decode(
            model, torch.stack([whisper_features[n] for n in names]), max_new_tokens=12, stagger=2, scores=batched
        )
        for i, n in enumerate(names):
            alone: list[torch.Tensor] = []
            paged_greedy_decode(model, whisper_features[n].unsqueeze(0), max_new_tokens=12, scores=alone)
            assert len(alone[0]) == len(batched[i])
            assert all(torch.equal(a, b) for a, b in zip(alone[0], batched[i])), n


def test_int8_encoder_is_batch_invariant(whisper_model_dir, whisper_features):
    """A clip's cross-attention KV from the int8 encoder is the same bit for bit alone or encoded with others (so the
    encoder service batches int8 requests)."""
    model = load_model(whisper_model_dir)
    apply_quantization(model, "int8", "encoder")
    feats = torch.stack([whisper_features[n] for n in sorted(whisper_features)[:3]])
    with torch.inference_mode():
        together = model.compute_cross_kv(model.encode(feats))  # [L, 2, B, S, H, Dh]
        for i in range(len(feats)):
            assert torch.equal(model.compute_cross_kv(model.encode(feats[i : i + 1]))[:, :, 0], together[:, :, i])


def test_int8_embed_service_exits_with_the_reason():
    """The Embed service (encoder-only models) has no int8 path: asking for one is an error, not silently fp32."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "encdec.cli",
            "serve-encoder",
            "--model",
            "all-MiniLM-L6-v2",
            "--quantize",
            "int8",
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        check=False,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "encdec: error: quantize int8 is for encoder-decoder models only" in result.stderr, result.stderr[-2000:]
