"""kernels/cpu_norm.py (C, AVX2) against its torch references: HF T5's RMS norm and ``F.layer_norm``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_norm import is_available, layer_norm, reference_rms_norm, rms_norm

pytestmark = pytest.mark.skipif(
    not is_available(),
    reason="kernels/_cpu_kernels*.so not built (no C compiler at install, not x86-64 Linux) or no AVX2/FMA",
)

SHAPES = [
    (1, 1),
    (3, 7),
    (5, 8),
    (2, 33),
    (32, 512),
    (4, 3, 768),
    (700, 384),
]  # tails, 3-D, and one past the 1 MB split


def _inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    return torch.randn(shape, generator=g) * 3 + 0.5, torch.randn(d, generator=g), torch.randn(d, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_hf_formula(shape):
    x, w, _ = _inputs(shape, 1)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rms_norm(x, None, 1e-6), reference_rms_norm(x, None, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_matches_torch(shape):
    x, w, b = _inputs(shape, 2)
    d = shape[-1]
    for weight, bias in ((w, b), (w, None), (None, None)):
        torch.testing.assert_close(
            layer_norm(x, weight, bias, 1e-5), F.layer_norm(x, (d,), weight, bias, 1e-5), rtol=1e-5, atol=1e-5
        )


def test_large_offset_is_stable():
    """Two-pass variance: a row far from zero keeps its small spread (one-pass E[x^2] - E[x]^2 loses it)."""
    x = 1e4 + torch.randn(4, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = F.layer_norm(x, (256,), eps=1e-5)
    torch.testing.assert_close(layer_norm(x.float(), None, None, 1e-5).double(), ref, rtol=0, atol=2e-3)


def test_non_contiguous_and_in_place_inputs():
    x, w, b = _inputs((6, 40), 4)
    view = x[::2, 3:35]  # rows strided, a column slice: made contiguous first
    torch.testing.assert_close(layer_norm(view, w[:32], b[:32], 1e-5), F.layer_norm(view, (32,), w[:32], b[:32], 1e-5))
    torch.testing.assert_close(rms_norm(x.t(), w[:6], 1e-6), reference_rms_norm(x.t(), w[:6], 1e-6))
    before = x.clone()
    rms_norm(x, w, 1e-6)
    assert torch.equal(x, before)  # the input is never written


def test_nan_and_inf_propagate_as_torch():
    x = torch.ones(3, 16)
    x[0, 5] = float("nan")
    x[1, 2] = float("inf")
    for got, ref in (
        (layer_norm(x, None, None, 1e-5), F.layer_norm(x, (16,), eps=1e-5)),
        (rms_norm(x, None, 1e-6), reference_rms_norm(x, None, 1e-6)),
    ):
        assert torch.equal(got.isnan(), ref.isnan())
        torch.testing.assert_close(got[2], ref[2])


def test_other_dtypes_and_autograd_take_the_reference():
    x, w, b = _inputs((3, 8), 5)
    assert layer_norm(x.double(), w.double(), b.double(), 1e-5).dtype == torch.float64
    torch.testing.assert_close(rms_norm(x.double(), w.double(), 1e-6), reference_rms_norm(x.double(), w.double(), 1e-6))
    xg = x.clone().requires_grad_(True)
    layer_norm(xg, w, b, 1e-5).sum().backward()  # the reference keeps the graph
    assert xg.grad is not None
    with pytest.raises(RuntimeError):  # a weight of the wrong size: torch's error
        layer_norm(x, w[:4], None, 1e-5)
    assert rms_norm(torch.empty(0, 8), w, 1e-6).shape == (0, 8)


def test_strided_weight_and_bias():
    """A strided ``[d]`` weight / bias is copied to a contiguous one that must stay alive through the C call."""
    x, _, _ = _inputs((5, 37), 6)
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(2 * 37, generator=g)[::2], (torch.randn(2 * 37, generator=g) * 10)[::2]  # [37], stride 2
    assert not w.is_contiguous() and not b.is_contiguous()
    for _ in range(20):  # freed copies are reused by the next allocation: once is not always enough
        torch.testing.assert_close(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (37,), w, b, 1e-5))
        torch.testing.assert_close(rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6))
