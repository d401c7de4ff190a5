"""Opt-in int8 decoder/encoder weights on the real Whisper tiny.en: close to HF, not equal by construction."""

from __future__ import annotations

import difflib

import pytest
import torch
from paged_greedy import paged_greedy_decode

from shared.config import DecoderServiceConfig, EncoderServiceConfig
from shared.models.quantize import apply_quantization
from shared.models.registry import load_model
from shared.models.whisper_features import load_tokenizer


def test_int8_model_transcribes_like_hf(whisper_model_dir, whisper_features, hf_whisper_tokens):
    model = load_model(whisper_model_dir)
    apply_quantization(model, "int8", "decoder")
    apply_quantization(model, "int8", "encoder")
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    assert isinstance(model.decoder_layers[0].fc1, DynamicQuantizedLinear)
    assert isinstance(model.encoder_layers[0].fc1, DynamicQuantizedLinear)
    assert model.output_projection is not None
    assert not model.decoder_layers[0].ffn_norm.use_kernel  # int8 keeps torch's norms (shared.models.quantize)
    names = sorted(whisper_features)
    with torch.inference_mode():
        ours = paged_greedy_decode(model, torch.stack([whisper_features[n] for n in names]))
    same = sum(ours[i] == hf_whisper_tokens[n] for i, n in enumerate(names))
    # int8 changes logits slightly; CTranslate2 int8 is held to the same bar (issue 7: >= 15/16).
    assert same >= len(names) - 1, (same, len(names))
    tokenizer = load_tokenizer(whisper_model_dir)
    for i, n in enumerate(names):  # and even a differing transcript reads almost like HF's
        ours_text, hf_text = tokenizer.decode(ours[i]), tokenizer.decode(hf_whisper_tokens[n])
        assert difflib.SequenceMatcher(a=ours_text, b=hf_text).ratio() >= 0.9, (n, ours_text, hf_text)


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
