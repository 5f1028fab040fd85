"""Bucket planning of the gradient-sync engine (pure logic, one process)."""
from __future__ import annotations

import torch

from hpctrain.grad_sync.buckets import cap_bytes_from_mb, plan_buckets


def _params(*numels, dtype=torch.float32):
    return [torch.empty(n, dtype=dtype) for n in numels]


def test_reverse_order_and_cap():
    # fp32: 4 bytes each; cap 400 bytes = 100 elements
    params = _params(128, 16, 256, 16, 64, 4)
    plans = plan_buckets(params, 400)
    assert [p.indices for p in plans] == [(5, 4, 3), (2,), (1,), (0,)]
    assert plans[0].offsets == (0, 4, 68) and plans[0].numel == 84
    assert all(p.nbytes <= 400 or len(p.indices) == 1 for p in plans)


def test_parameter_larger_than_cap_gets_its_own_bucket():
    params = _params(10, 1000, 10)
    plans = plan_buckets(params, 100)  # 25 elements: the middle one is 40x over
    assert [p.indices for p in plans] == [(2,), (1,), (0,)]
    assert plans[1].numel == 1000


def test_zero_cap_is_one_bucket_per_parameter_and_huge_cap_is_one_bucket():
    params = _params(3, 5, 7)
    assert [p.indices for p in plan_buckets(params, 0)] == [(2,), (1,), (0,)]
    (only,) = plan_buckets(params, cap_bytes_from_mb(25))
    assert only.indices == (2, 1, 0) and only.offsets == (0, 7, 12) and only.numel == 15


def test_dtypes_never_share_a_bucket_and_keep_opening_order():
    bf16 = torch.bfloat16
    params = [torch.empty(4), torch.empty(4, dtype=bf16), torch.empty(4), torch.empty(4, dtype=bf16)]
    plans = plan_buckets(params, 1 << 20)
    assert [(p.dtype, p.indices) for p in plans] == [(torch.bfloat16, (3, 1)), (torch.float32, (2, 0))]


def test_every_parameter_exactly_once_and_offsets_pack_tightly():
    sizes = [17, 1, 300, 0, 64, 64, 5, 1000, 3]
    plans = plan_buckets(_params(*sizes), 256)
    seen = sorted(i for p in plans for i in p.indices)
    assert seen == list(range(len(sizes)))
    for p in plans:
        ends = [o + sizes[i] for o, i in zip(p.offsets, p.indices)]
        assert list(p.offsets[1:]) == ends[:-1] and p.numel == ends[-1]


def test_fractional_megabytes():
    assert cap_bytes_from_mb(0.01) == 10485
    assert cap_bytes_from_mb(25) == 25 * 2**20
