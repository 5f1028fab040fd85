"""Inputs every rank can rebuild, numpy references, and stated tolerances.

Each rank builds every rank's input from (seed, rank), so it knows the
expected result of a collective without communicating. References are
computed in numpy float64 (int64 for integers), which is exact for the sums
of at most 8 terms used here.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import pytest
import torch

BACKENDS = ["gloo", "mpi", "hier"]

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}

#: (dtype name, op) pairs a reduction test covers: AVG only for floats
REDUCE_CASES = [(d, op) for d in DTYPES for op in ("sum", "avg", "max")
                if not (op == "avg" and d.startswith("int"))]

#: Relative tolerance of a reduction result against the float64 reference.
#: float32: the backend adds up to 8 values in float32 in some order; each
#:   addition rounds by <= 2^-24 relative, and inputs are in [1, 2) so
#:   nothing cancels: 8 * 2^-24 ~ 5e-7 < 1e-6.
#: float16 / bfloat16: the backend returns round16(float32 sum); the
#:   reference is round16(float64 sum). The float32 sum can sit on the other
#:   side of a 16-bit rounding boundary, so they may differ by one 16-bit
#:   unit in the last place: 2^-10 (fp16) and 2^-7 (bf16) relative for
#:   values >= 1 (both have their implicit leading bit).
#: integers: exact.
RTOL = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7,
        torch.int32: 0.0, torch.int64: 0.0}


def rank_input(rank: int, shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input: floats in [1, 2) (no cancellation), ints in [-50, 50)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return (1 + torch.rand(tuple(shape), generator=gen, dtype=torch.float64)).to(dtype)
    return torch.randint(-50, 50, tuple(shape), generator=gen, dtype=torch.int64).to(dtype)


def all_inputs(n: int, shape: Sequence[int], dtype: torch.dtype, seed: int) -> List[torch.Tensor]:
    return [rank_input(r, shape, dtype, seed) for r in range(n)]


def to_numpy64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64 if t.dtype.is_floating_point else torch.int64).numpy()


def reduce_reference(inputs: Sequence[torch.Tensor], op: str) -> np.ndarray:
    stacked = np.stack([to_numpy64(x) for x in inputs])
    if op == "sum":
        return stacked.sum(axis=0)
    if op == "avg":
        return stacked.sum(axis=0) / len(inputs)
    if op == "max":
        return stacked.max(axis=0)
    raise ValueError(op)


def assert_reduced(got: torch.Tensor, reference: np.ndarray, dtype: torch.dtype) -> None:
    """``got`` equals the float64 reference rounded to ``dtype`` (via float32,
    as the backends round), within ``RTOL[dtype]``."""
    expected = torch.from_numpy(np.ascontiguousarray(reference))
    expected = expected.to(torch.float32).to(dtype) if dtype.is_floating_point else expected.to(dtype)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=RTOL[dtype], atol=0)


def assert_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Data movement is bit-exact (compared as bytes, so NaN patterns would count too)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got.contiguous().view(torch.uint8) if got.numel() else got,
                       expected.contiguous().view(torch.uint8) if expected.numel() else expected)


def strided_like(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of ``shape`` that is NOT contiguous: every other column
    of a twice-as-wide tensor (contiguous only when it has <= 1 element)."""
    rows, cols = tuple(shape)
    t = torch.zeros(rows, 2 * cols, dtype=dtype)[:, ::2]
    assert not t.is_contiguous() or t.numel() <= 1
    return t


#: Call styles: ``plain`` (blocking, contiguous), ``async`` (async_op=True,
#: then wait()), ``strided`` (non-contiguous tensors: copied in and out).
VARIANTS = ("plain", "async", "strided")

#: dtypes run in every call style: float32 (the zero-copy path) and bfloat16
#: (a staged/converted path); the others run ``plain`` only (every dtype is
#: still covered for every op and backend, at a third of the cost).
_ALL_STYLES = ("float32", "bfloat16")


def dtype_params():
    """(dtype, variant) parameters for data-movement tests."""
    return [pytest.param(DTYPES[d], v, id=f"{d}-{v}") for d in DTYPES for v in VARIANTS
            if v == "plain" or d in _ALL_STYLES]


def reduce_params():
    """(dtype, op, variant) parameters for reduction tests (AVG only for floats)."""
    return [pytest.param(DTYPES[d], op, v, id=f"{d}-{op}-{v}") for d, op in REDUCE_CASES for v in VARIANTS
            if v == "plain" or d in _ALL_STYLES]


def plain_dtype_params():
    return [pytest.param(DTYPES[d], id=d) for d in DTYPES]
