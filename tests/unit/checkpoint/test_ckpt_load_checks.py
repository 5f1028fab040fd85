"""The cheap checks a load runs on every tensor: finiteness by one sum
(exact, with the elementwise check behind it) and which hyperslabs are one
contiguous range of the file (read independently)."""
from __future__ import annotations

import pytest
import torch

from hpctrain_h5ckpt.finite import all_finite
from hpctrain_h5ckpt.reader import contiguous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_nonfinite_element_is_found(dtype, bad):
    t = torch.randn(64, 33).to(dtype)
    assert all_finite(t)
    t[17, 5] = bad
    assert not all_finite(t)


def test_infinities_of_both_signs_are_found():
    t = torch.zeros(1000)
    t[3], t[900] = float("inf"), float("-inf")  # their sum is NaN, still not finite
    assert not all_finite(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
    big = torch.finfo(dtype).max
    t = torch.full((4096,), big, dtype=dtype)
    assert all_finite(t)
    assert all_finite(torch.full((2,), torch.finfo(torch.float32).max))  # float32's own sum overflows


def test_integers_and_empty_tensors_are_finite():
    assert all_finite(torch.arange(10)) and all_finite(torch.empty(0))


@pytest.mark.parametrize("box,shape,expected", [
    ((), (), True),
    (((0, 8), (0, 4)), (8, 4), True),           # whole
    (((2, 5), (0, 4)), (8, 4), True),           # rows: a dim-0 shard
    (((3, 4), (1, 3)), (8, 4), True),           # part of one row
    (((2, 5), (0, 2)), (8, 4), False),          # columns: strided
    (((1, 2), (2, 4), (0, 3)), (2, 4, 3), True),
    (((1, 2), (2, 4), (0, 2)), (2, 4, 3), False),
    (((0, 2), (2, 3), (0, 3)), (2, 4, 3), False),
])
def test_contiguous_hyperslabs(box, shape, expected):
    assert contiguous(box, shape) is expected
