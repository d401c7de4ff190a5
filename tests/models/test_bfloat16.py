"""shared.models.bfloat16 (``--dtype bfloat16`` on the CPU) against float64 torch references on bfloat16-rounded
operands: the mixed-precision ``Linear`` product, the chunked bfloat16 attention, and a model loaded that way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.packed_linear import activate
from shared.models.bfloat16 import bfloat16_attention
from shared.models.linear import Linear, products_dtype, use_bfloat16_products
from shared.models.registry import load_model_in

BF16_EPS = 2.0**-8  # bfloat16's relative rounding step (8 bits of significand): one rounding is within half of it


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_mixed_linear_is_the_bfloat16_product_in_float32(rows, activation, bias):
    g = torch.Generator().manual_seed(rows)
    lin = Linear(40, 24, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 40, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(24, generator=g))
    assert use_bfloat16_products(torch.nn.Sequential(lin)) == 1
    assert lin.weight.dtype == torch.bfloat16 and lin.mixed_bfloat16
    assert not bias or lin.bias.dtype == torch.float32  # biases stay float32
    x = torch.randn(rows, 40, generator=g)
    residual = torch.randn(rows, 24, generator=g)
    got = lin(x, activation=activation, residual=residual)
    assert got.dtype == torch.float32 and got.shape == (rows, 24)
    product = rounded(x) @ lin.weight.double().t()  # exact products of the rounded operands, float64 sums
    want = activate(product + (lin.bias.double() if bias else 0.0), activation) + residual.double()
    scale = rounded(x).abs() @ lin.weight.double().abs().t()  # the size of each sum: its roundings scale with it
    assert ((got.double() - want).abs() <= BF16_EPS * scale + 1e-6).all()
    # a bfloat16 input (the attention's output) takes the same path
    torch.testing.assert_close(lin(x.to(torch.bfloat16)), lin(x.to(torch.bfloat16).float()))


@pytest.mark.parametrize(("shape", "chunk"), [((1, 2, 130, 16), 64), ((2, 3, 257, 64), 128), ((1, 1, 5, 8), 128)])
def test_bfloat16_attention_matches_softmax_attention_of_the_rounded_operands(shape, chunk):
    g = torch.Generator().manual_seed(shape[2])
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    got = bfloat16_attention(q, k, v, chunk=chunk)
    assert got.dtype == torch.bfloat16 and got.shape == shape
    scale = shape[-1] ** -0.5
    want = F.scaled_dot_product_attention(rounded(q * scale), rounded(k), rounded(v), scale=1.0)
    # scores and probabilities are rounded to bfloat16 too: a few rounding steps of outputs of size ~1
    assert (got.double() - want).abs().max() < 8 * BF16_EPS
    unscaled = F.scaled_dot_product_attention(rounded(q), rounded(k), rounded(v), scale=1.0)
    assert (unscaled - want).abs().max() > 8 * BF16_EPS  # the check above tells a missing 1/sqrt(D) apart
    # chunking changes nothing: each query row's block of scores is the same product
    assert torch.equal(got, bfloat16_attention(q, k, v, chunk=shape[2]))


def test_load_model_in_bfloat16_on_the_cpu_keeps_float32_outside_the_products():
    model = load_model_in("whisper-tiny.en", "bfloat16", torch.device("cpu"))
    assert products_dtype(model) == torch.bfloat16
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 and m.mixed_bfloat16 for m in linears)
    assert model.embed_tokens.weight.dtype == torch.float32 and model.conv1.weight.dtype == torch.float32
    assert model.encoder_norm.weight.dtype == torch.float32
    features = torch.randn(1, model.config.num_mel_bins, 2 * model.config.max_source_positions) * 0.5
    with torch.inference_mode():
        out = model.encode(features)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        reference = load_model_in("whisper-tiny.en", "float32", torch.device("cpu")).encode(features)
        assert products_dtype(load_model_in("whisper-tiny.en", "float32", torch.device("cpu"))) == torch.float32
        # bfloat16 weights move the output, but it stays the same encoding (not noise, not another scale)
        cosine = F.cosine_similarity(out.flatten(), reference.flatten(), dim=0)
        assert cosine > 0.99, cosine
        cross = model.compute_cross_kv(out)
    assert cross.dtype == torch.bfloat16  # what a bfloat16 KV pool stores: no float32 copy in between
