"""Parameters without a gradient: no deadlock, correct averages, ``None`` when
no rank used them.

A four-parameter module whose forward depends on the rank and micro-batch:
``a`` and ``d`` are always used, ``b`` only by rank 0 in micro-batch 0 and by
rank 1 in micro-batch 1 (so on rank 1 it arrives in the syncing micro-batch,
on rank 0 it does not), ``never`` by nobody. With one bucket per parameter,
``never`` sits in the middle of the launch order and blocks the later
buckets on every rank until after backward. Inputs are small integers and the
group sizes powers of two, so the expected averages are exact in fp32 and
compared with equality.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parity import data_parallel


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))
        self.b = nn.Parameter(torch.ones(5))
        self.never = nn.Parameter(torch.ones(3))
        self.d = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = (self.a * x[:4]).sum() + (self.d * x[:6]).sum()
        return out + (self.b * x[:5]).sum() if use_b else out


def _x(rank: int, micro: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) + (rank + 1) * (micro + 1)


def _uses_b(rank: int, micro: int) -> bool:
    return (rank, micro) in ((0, 0), (1, 1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend,overlap", [("torch", True), ("torch", False), ("mpi", True), ("hier", True)])
def test_unused_parameters_neither_hang_nor_get_a_gradient(backend, overlap, world, make_config, pm):
    from hpctrain.bootstrap import with_device
    from hpctrain.plugins import capabilities
    from hpctrain.run import build_mesh

    n, rank = world.Get_size(), world.Get_rank()
    if n & (n - 1):
        pytest.skip("exact averages need a power-of-two group")
    if backend not in capabilities(pm).get("comm.backend", []):
        pytest.skip(f"no installed plugin serves comm.backend={backend}")
    cfg = make_config("comm.bucket_mb=0", f"comm.dp.overlap={str(overlap).lower()}", "trainer.device=cpu",
                      f"comm.backend={backend}")
    mesh = build_mesh(cfg, with_device("cpu"), pm)
    data = data_parallel(Branchy(), mesh, cfg, pm)
    model = data.model
    micro = 2
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        for m in range(micro):
            data.before_backward(m, micro)
            (model(_x(rank, m), _uses_b(rank, m)) / micro).backward()
        data.reduce_gradients()

        def expected(width, used=lambda r, m: True):
            total = sum(_x(r, m)[:width] / micro for r in range(n) for m in range(micro) if used(r, m))
            return total / n

        assert torch.equal(model.a.grad, expected(4))
        assert torch.equal(model.d.grad, expected(6))
        assert torch.equal(model.b.grad, expected(5, _uses_b))  # rank 2, 3, ... never used it
        assert model.never.grad is None

    reducer = data.engine
    order = [bucket.params[0] for bucket in reducer.buckets]
    assert order == [model.d, model.never, model.b, model.a]  # reverse registration, one per bucket
    launches = reducer.trace.launches
    assert [x.bucket for x in launches] == [0, 1, 2, 3]
    # only ``d`` can go out during backward: ``never`` blocks everything after it
    assert [x.in_backward for x in launches] == [overlap, False, False, False]
