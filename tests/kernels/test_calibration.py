"""kernels/calibration.py: the packed kernel's instruction set chosen by measuring, never changing a result."""

from __future__ import annotations

import pytest
import torch

from kernels import calibration, packed_linear
from kernels.packed_linear import PackedWeight

pytestmark = pytest.mark.skipif(
    not packed_linear.is_available(), reason="kernels/_cpu_kernels*.so not built or no AVX2/FMA"
)


@pytest.fixture(autouse=True)
def restore_isa():
    yield
    packed_linear.use_isa(None)


def test_measures_every_isa_present_and_keeps_one_of_them():
    if len(packed_linear.isas_present()) < 2:
        pytest.skip("this CPU lacks avx512f: one micro-kernel, nothing to choose")
    g = torch.Generator().manual_seed(0)
    weights = [PackedWeight.pack(torch.randn(n, k, generator=g)) for n, k in ((700, 96), (96, 300))]
    x = torch.randn(9, 96, generator=g)
    before = packed_linear.packed_linear(x, weights[0])
    times = calibration.calibrate_packed_isa(weights, num_threads=2, rows=4, repeats=2)
    assert set(times) == set(packed_linear.isas_present()) and all(t > 0 for t in times.values())
    assert packed_linear.isa() in times
    assert torch.equal(packed_linear.packed_linear(x, weights[0]), before)  # the choice never changes a result


@pytest.mark.parametrize(
    ("fake", "chosen"),
    [
        ({"avx2": 1.0, "avx512": 2.0}, "avx2"),  # the best present is slower: replaced
        ({"avx2": 0.99, "avx512": 1.0}, "avx512"),  # within the margin: the best present stays
        ({"avx2": 2.0, "avx512": 1.0}, "avx512"),
    ],
)
def test_another_isa_replaces_the_best_present_only_past_the_margin(monkeypatch, fake, chosen):
    if packed_linear.isas_present() != ["avx2", "avx512"]:
        pytest.skip("this CPU lacks avx512f: one micro-kernel, nothing to choose")
    monkeypatch.setattr(calibration, "_best", lambda x, w, threads, repeats: fake[packed_linear.isa()])
    weight = PackedWeight.pack(torch.randn(32, 16))
    assert calibration.calibrate_packed_isa([weight], num_threads=1) == fake
    assert packed_linear.isa() == chosen


def test_nothing_to_measure_changes_nothing():
    current = packed_linear.isa()
    assert calibration.calibrate_packed_isa([], num_threads=1) == {}
    if packed_linear.bf16_available():  # bfloat16 weights have one micro-kernel
        assert calibration.calibrate_packed_isa([PackedWeight.pack(torch.randn(32, 16), dtype=torch.bfloat16)], 1) == {}
    assert packed_linear.isa() == current
