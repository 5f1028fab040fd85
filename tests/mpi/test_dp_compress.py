"""Compressed gradient communication: 16 bits on the wire, fp32 sums, a
stated error bound against the exact (float64) average.

Every rank gets a random gradient whose elements span six decades of
magnitude (so fp16's subnormal range is exercised too). Bound per element,
with u the wire dtype's unit roundoff (bf16 2^-8, fp16 2^-11) and g_r the
rank gradients: each g_r is rounded once (|err| <= u|g_r|), summed in fp32
(negligible: ~n 2^-24), divided by n, and the mean rounded once more
(<= u|mean|), so |result - mean| <= 2u * mean_r |g_r|, plus, for fp16, one
subnormal spacing 2^-24 per element for the two roundings near zero. We
allow 1% slack on the u term for the fp32 arithmetic. Without compression the
result must be within (n + 1) 2^-24 * mean_r |g_r| (fp32 sum and division).
A factor-n error, a dropped rank or a chunk sent to the wrong rank breaks
these bounds by orders of magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from parity import data_parallel

WIRE = {"none": (None, 0.0), "bf16": (torch.bfloat16, 2.0**-8), "fp16": (torch.float16, 2.0**-11)}
SIZES = (1000, 37, 5000, 3)  # several buckets at 0.01 MiB, none a multiple of most group sizes


class Recorder:
    """Wraps the dp communicator; records (op, dtype, numel) of every call."""

    def __init__(self, inner):
        self.inner, self.backend, self.rank, self.size = inner, inner.backend, inner.rank, inner.size
        self.calls = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _wrap(name):
        def call(self, *args, **kwargs):
            tensor = args[1] if name in ("all_to_all", "all_gather") else args[0]
            self.calls.append((name, tensor.dtype, tensor.numel()))
            return getattr(self.inner, name)(*args, **kwargs)
        return call

    all_reduce, all_to_all, all_gather = _wrap("all_reduce"), _wrap("all_to_all"), _wrap("all_gather")


class Linearish(nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(k)) for k in SIZES])

    def forward(self, gs):
        return sum((p * g).sum() for p, g in zip(self.ps, gs))  # d/dp = g exactly


def _rank_grads(rank: int):
    rng = np.random.default_rng(1000 + rank)
    return [torch.from_numpy((rng.standard_normal(k) * 10.0 ** rng.uniform(-5, 1, k)).astype(np.float32))
            for k in SIZES]


@pytest.mark.every_size  # the average over the world: its roundings grow with the replicas
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["torch", "mpi"])
@pytest.mark.parametrize("compress", list(WIRE))
def test_compressed_average_is_within_two_roundings(compress, backend, world, make_config, pm):
    from hpctrain.bootstrap import with_device
    from hpctrain.plugins import capabilities
    from hpctrain.run import build_mesh

    n, rank = world.Get_size(), world.Get_rank()
    wire, u = WIRE[compress]
    if backend not in capabilities(pm).get("comm.backend", []):
        pytest.skip(f"no installed plugin serves comm.backend={backend}")
    cfg = make_config("comm.bucket_mb=0.01", f"comm.dp.compress={compress}", "trainer.device=cpu",
                      f"comm.backend={backend}")
    mesh = build_mesh(cfg, with_device("cpu"), pm)
    spy = Recorder(mesh.group("dp").communicator())
    mesh.group("dp").comm = spy
    data = data_parallel(Linearish(), mesh, cfg, pm)
    model = data.model
    mine = _rank_grads(rank)
    data.before_backward(0, 1)
    model(mine).backward()
    data.reduce_gradients()

    everyone = [_rank_grads(r) for r in range(n)]
    for i, p in enumerate(model.ps):
        stack = torch.stack([g[i].double() for g in everyone])
        mean, mean_abs = stack.mean(0), stack.abs().mean(0)
        if wire is None:
            bound = (n + 1) * 2.0**-24 * mean_abs
        else:
            bound = 2 * u * 1.01 * mean_abs + (2.0**-24 if wire == torch.float16 else 0.0)
        err = (p.grad.double() - mean).abs()
        assert p.grad.dtype == torch.float32
        assert bool((err <= bound).all()), f"param {i}: worst excess {float((err - bound).max()):.3g}"

    ops = {(name, dtype) for name, dtype, _ in spy.calls}
    if wire is None:
        assert ops == {("all_reduce", torch.float32)}
    else:  # gradients only travel in the wire dtype
        assert ops == {("all_to_all", wire), ("all_gather", wire)}
    flat = torch.cat([p.grad for p in model.ps]).numpy().tobytes()
    assert all(b == flat for b in world.allgather(flat)), "replicas got different gradients"
