"""shared.models.linear against F.linear: the small-row CPU path and the chunked large-output path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.models.linear import CHUNK, SMALL_ROWS, Linear, linear
from shared.models.quantize import Int8Linear, _to_int8_linears


@pytest.mark.parametrize("rows", [1, 3, SMALL_ROWS, SMALL_ROWS + 1, 200])
@pytest.mark.parametrize("out_features", [24, CHUNK + 37])  # 2 chunks, the last one partial
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, out_features, bias):
    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, 48, generator=g)
    w = torch.randn(out_features, 48, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    got = linear(x, w, b)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_leading_dims_and_empty_input():
    x = torch.randn(2, 3, 16)
    w = torch.randn(8, 16)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert linear(torch.randn(0, 16), w).shape == (0, 8)


def test_other_dtypes_take_f_linear():
    x, w = torch.randn(4, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_module_keeps_nn_linear_state_dict_and_quantizes():
    plain = nn.Linear(16, 8)
    ours = Linear(16, 8)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(5, 16)
    torch.testing.assert_close(ours(x), plain(x), atol=1e-5, rtol=1e-5)
    model = nn.Sequential(ours)
    _to_int8_linears(model)  # what --quantize int8 swaps in
    assert isinstance(model[0], Int8Linear)


def test_packed_weights_lists_one_weight_per_decode_shape():
    from shared.models.registry import load_model

    model = load_model("whisper-tiny.en")
    assert model.packed_weights() == []  # nothing packed yet
    if not model.pack_decode_weights():
        pytest.skip("the packed kernel is not built for this CPU")
    weights = model.packed_weights()
    c = model.config
    assert weights[0] is model.packed_projection
    shapes = [(w.out_features, w.in_features) for w in weights]
    assert len(shapes) == len(set(shapes))
    assert set(shapes) == {
        (c.vocab_size, c.d_model),
        (3 * c.d_model, c.d_model),  # self-attention q/k/v
        (c.d_model, c.d_model),
        (c.ffn_dim, c.d_model),
        (c.d_model, c.ffn_dim),
    }
