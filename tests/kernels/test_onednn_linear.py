"""oneDNN's packed linear against its torch reference ``F.linear``, and the per-shape choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import onednn_linear
from shared.models.linear import SMALL_ROWS, Linear

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize(("rows", "out_f", "in_f"), [(1, 7, 5), (65, 33, 17), (1500, 96, 64), (333, 200, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_product_matches_f_linear(rows, out_f, in_f, bias):
    torch.manual_seed(rows + out_f)
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
    b = torch.randn(out_f) if bias else None
    got = onednn_linear.linear(x, onednn_linear.pack(w, rows), b, out_f)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = x.view(1, rows, in_f)  # [B, S, in] inputs keep their leading dims
    assert onednn_linear.linear(x3, onednn_linear.pack(w, rows), b, out_f).shape == (1, rows, out_f)


def test_linear_uses_it_only_where_chosen_and_for_many_rows(monkeypatch):
    layer = Linear(64, 96)
    monkeypatch.setattr("shared.models.linear.prefer_onednn", lambda *a: True)
    assert layer.use_onednn(1500) and layer.onednn is not None
    calls = []
    real = onednn_linear.linear
    monkeypatch.setattr("shared.models.linear.onednn_linear", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        for rows in (SMALL_ROWS, SMALL_ROWS + 1, 1500):
            x = torch.randn(1, rows, 64)
            res = torch.randn(1, rows, 96)
            torch.testing.assert_close(
                layer(x, activation="gelu", residual=res),
                res + F.gelu(F.linear(x, layer.weight, layer.bias)),
                rtol=1e-5,
                atol=1e-4,
            )
    assert len(calls) == 2  # not for the SMALL_ROWS-row input (decode steps keep their own path)
    off = Linear(64, 96)
    monkeypatch.setattr("shared.models.linear.prefer_onednn", lambda *a: False)
    assert not off.use_onednn(1500) and off.onednn is None


def test_the_choice_is_measured_once_per_shape():
    w = torch.randn(48, 32)
    first = onednn_linear.prefer_onednn(w, None, 200)
    assert onednn_linear.prefer_onednn(torch.randn(48, 32), None, 200) is first  # cached by shape
    assert not onednn_linear.prefer_onednn(w.double(), None, 200)  # float32 CPU only
