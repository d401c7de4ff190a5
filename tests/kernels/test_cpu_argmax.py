"""kernels/cpu_argmax.py (C, AVX2) against its torch reference ``torch.argmax(x, dim=-1)``."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_argmax import argmax_rows, is_available

pytestmark = pytest.mark.skipif(
    not is_available(),
    reason="kernels/_cpu_kernels*.so not built (no C compiler at install, not x86-64 Linux) or no AVX2/FMA",
)


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (5, 8), (32, 9), (7, 32128), (64, 51864)])
def test_matches_torch(rows, cols):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 1000 + cols))
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


def test_ties_nan_and_infinities_as_torch():
    x = torch.zeros(6, 20)
    x[0, [3, 11, 17]] = 5.0  # ties: the first
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 12], x[2, 4] = float("nan"), float("inf")  # a NaN wins over inf
    x[3, [9, 2]] = float("nan")  # the first NaN
    x[4, 19] = 1.0  # in the scalar tail after the vectors
    x[5, [8, 16]] = float("inf")
    assert argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist() == [3, 0, 12, 2, 19, 8]


def test_strided_rows_other_dtypes_and_empty():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 40, generator=g)
    assert torch.equal(argmax_rows(x[::3, 5:37]), torch.argmax(x[::3, 5:37], dim=-1))  # row stride != cols
    assert torch.equal(argmax_rows(x.t()), torch.argmax(x.t(), dim=-1))  # columns not contiguous: torch
    assert torch.equal(argmax_rows(x.double()), torch.argmax(x.double(), dim=-1))
    assert argmax_rows(torch.empty(0, 5)).shape == (0,)
    with pytest.raises(IndexError):  # as torch.argmax
        argmax_rows(torch.empty(3, 0))


@pytest.mark.parametrize("num_threads", [1, 2, 5])
def test_thread_counts_agree(num_threads):
    x = torch.randn(33, 1001, generator=torch.Generator().manual_seed(2))
    assert torch.equal(argmax_rows(x, num_threads=num_threads), torch.argmax(x, dim=-1))
