"""Opt-in int8 (``shared.models.quantize``) on the text models: T5 (v1.0, v1.1), BART, mBART, Marian.

On the tiny random checkpoints (``text_checkpoints``: large random weights, so greedy outputs vary) a 1 % change
of an activation moves later logits by whole units (HF's own fp32 logits are off by ~0.1 from float64 there), so
int8 cannot give HF fp32's tokens everywhere. What is checked: every part is converted; batched equals one at a
time bit for bit; our int8 logits equal HF's modules running the same int8 products (``Int8Linear`` swapped into
HF's model), far closer than int8 is to fp32 and with the same argmax; the tokens equal to HF fp32 are counted
(printed) and no fewer than the int8 reference's own.
"""

from __future__ import annotations

import pytest
import torch
from helpers.text_paged import BLOCK, engine_greedy, teacher_forced_logits
from test_text_parity import ARCHS, hf_greedy, hf_model, sources
from torch import nn

from shared.models.quantize import Int8Linear, Int8OutputProjection, apply_quantization
from shared.models.registry import load_model, load_tokenizer

MAX_NEW = 16


def int8_model(path) -> nn.Module:
    """The model with both sides int8, as the encoder and decoder services load it."""
    model = load_model(path)
    apply_quantization(model, "int8", "decoder")
    apply_quantization(model, "int8", "encoder")
    return model


class _HFOutputProjection(nn.Module):
    """``Int8OutputProjection`` in place of HF's ``lm_head`` (``[B, T, d]`` inputs; ``weight`` kept for HF's checks)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.projection = weight, Int8OutputProjection(weight, bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.projection(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)


def hf_int8_reference(path) -> nn.Module:
    """HF's model with every ``nn.Linear`` of its encoder and decoder an ``Int8Linear`` and its ``lm_head`` (with
    ``final_logits_bias``) an ``Int8OutputProjection``: the int8 arithmetic on HF's own modules."""
    hf = hf_model(path)

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                int8 = Int8Linear.from_linear(child)
                int8.weight = child.weight  # HF's T5 FFN reads wo.weight.dtype
                setattr(module, name, int8)
            else:
                swap(child)

    base = hf.model if hasattr(hf, "model") else hf
    swap(base.encoder)
    swap(base.decoder)
    bias = None
    if hasattr(hf, "final_logits_bias"):
        bias = hf.final_logits_bias[0].clone()
        hf.final_logits_bias.zero_()  # added inside the projection, before its top-k, as ours does
    hf.lm_head = _HFOutputProjection(hf.lm_head.weight, bias)
    return hf


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_int8_converts_every_part(text_checkpoints, arch):
    model = int8_model(text_checkpoints[arch])
    parts = model.int8_parts()
    for layers in (parts.encoder_layers, parts.decoder_layers):
        assert not [n for n, m in layers.named_modules() if isinstance(m, nn.Linear)]
        assert any(isinstance(m, Int8Linear) for m in layers.modules())
    assert parts.cross_kv and all(isinstance(getattr(owner, name), Int8Linear) for owner, name in parts.cross_kv)
    assert isinstance(model.output_projection, Int8OutputProjection)
    assert not [m for m in model.modules() if getattr(m, "use_kernel", False)]  # torch's norms
    assert all(layer.fused is None for layer in parts.decoder_layers)  # the torch decode path, not the C layer
    assert model.batch_invariant_attention


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_batched_equals_alone(text_checkpoints, arch):
    """Sources of 1 to 60 tokens: greedy ids in one continuous batch equal each decoded alone, and teacher-forced
    logits of a padded batch (encoder) and one varlen prefill (decoder) equal each pair's alone, bit for bit."""
    path = text_checkpoints[arch]
    model, tokenizer = int8_model(path), load_tokenizer(path)
    srcs = sources(tokenizer)
    together = engine_greedy(model, tokenizer, srcs, MAX_NEW)
    assert together == [engine_greedy(model, tokenizer, [s], MAX_NEW)[0] for s in srcs]
    start = model.generation.decoder_start_token_id
    targets = [[start, *ids] for ids in together]
    with torch.inference_mode():
        batched = teacher_forced_logits(model, srcs, targets, block_size=BLOCK)
        for i, (src, tgt) in enumerate(zip(srcs, targets)):
            assert torch.equal(batched[i], teacher_forced_logits(model, [src], [tgt], block_size=BLOCK)[0]), i


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_logits_match_the_int8_reference(text_checkpoints, arch):
    """Teacher-forced on HF fp32's greedy outputs: ours equals HF's modules with the same int8 products (argmax at
    >= 99 % of positions, max |logit diff| within a quarter of the int8 reference's own distance from fp32), and
    its argmax agrees with HF fp32 at least as often as the reference's, less 2 positions."""
    path = text_checkpoints[arch]
    model, tokenizer, hf, ref = int8_model(path), load_tokenizer(path), hf_model(path), hf_int8_reference(path)
    srcs = sources(tokenizer)
    expected = [hf_greedy(hf, s, MAX_NEW) for s in srcs]
    start = model.generation.decoder_start_token_id
    ours_ref = ours_fp32 = ref_fp32 = positions = 0
    diff = ref_gap = 0.0
    with torch.inference_mode():
        for src, ids in zip(srcs, expected):
            tgt = [start, *ids]
            mine = teacher_forced_logits(model, [src], [tgt], block_size=BLOCK)[0]  # [T, V]
            inputs = dict(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt]))
            fp32, int8 = hf(**inputs).logits[0], ref(**inputs).logits[0]  # [T, V]
            diff, ref_gap = max(diff, float((mine - int8).abs().max())), max(ref_gap, float((fp32 - int8).abs().max()))
            ours_ref += int((mine.argmax(-1) == int8.argmax(-1)).sum())
            ours_fp32 += int((mine.argmax(-1) == fp32.argmax(-1)).sum())
            ref_fp32 += int((int8.argmax(-1) == fp32.argmax(-1)).sum())
            positions += len(tgt)
    greedy = engine_greedy(model, tokenizer, srcs, MAX_NEW)
    print(
        f"{arch} int8: argmax equal to HF fp32 at {ours_fp32}/{positions} positions (int8 reference: {ref_fp32}), "
        f"greedy outputs equal to HF fp32 {sum(g == e for g, e in zip(greedy, expected))}/{len(srcs)}; "
        f"max |logit diff| vs the int8 reference {diff:.3g}, the reference vs fp32 {ref_gap:.3g}"
    )
    assert ours_ref >= 0.99 * positions
    assert diff <= 0.25 * ref_gap
    assert ours_fp32 >= ref_fp32 - 2


def test_models_without_int8_parts_refuse_int8():
    """Encoder-only models declare no int8 parts: the refusal names the models that have them."""
    with pytest.raises(ValueError, match=r"quantize int8 is for encoder-decoder models .*not Linear"):
        apply_quantization(nn.Linear(2, 2), "int8", "encoder")
