"""The planner's overlap model never hides more communication than the step
has compute to hide it behind.

For every layout the planner estimates, and every axis, the exposed time is
at least the axis's wire time (its collectives alone, ``comm_time``) minus the
step's pure compute. The bound matters when communication outweighs compute,
so one cluster here has a slow inter-node network; a model that lets each
micro-batch's gathers hide behind the whole step's compute fails it there.
"""
from __future__ import annotations

import functools

import pytest

from hpctrain.planner import comm_model as cm
from hpctrain.planner.estimate import estimate
from hpctrain.planner.layouts import Layout
from hpctrain.planner.plan import plan_inputs
from hpctrain.planner.search import _estimates

LLAMA_64 = ["model=llama3-8b", "cluster=h100-80gb", "cluster.gpus=64", "trainer.global_batch_size=512",
            "trainer.seq_len=8192"]


@functools.lru_cache(maxsize=None)  # read-only results; the issue command's serves two tests
def _all_estimates(overrides):
    """(arch, work, cluster, every layout's estimate, fitting or not)."""
    arch, work, cluster, cfg, _, _ = plan_inputs(list(overrides))
    found, _ = _estimates(arch, cfg.model, work, cluster, {})
    return arch, work, cluster, found


@pytest.mark.parametrize("overrides", [
    LLAMA_64,
    LLAMA_64 + ["cluster.inter_bw_gbs=0.5"],          # communication-bound: the bound bites
    ["model=llama3-8b", "cluster=h100-80gb", "cluster.gpus=16", "trainer.global_batch_size=64",
     "trainer.seq_len=4096", "cluster.inter_bw_gbs=1"],
], ids=["issue-command", "slow-network", "small-slow"])
def test_exposed_is_at_least_wire_time_minus_compute(overrides):
    *_, found = _all_estimates(tuple(overrides))
    assert len(found) > 20
    bites = 0
    for e in found:
        for axis, wire in e.comm_time.items():
            slack = wire - e.time.compute
            assert e.time.exposed[axis] >= slack * (1 - 1e-9), (e.layout.label(), e.layout.zero, axis)
            bites += slack > 0
    if "cluster.inter_bw_gbs=0.5" in overrides:
        assert bites > 0, "no layout is communication-bound: the test would not catch an overlap bug"


def test_zero3_wire_time_is_its_collectives_every_micro_batch():
    """dp64 ZeRO-3: each micro-batch gathers the weights twice (forward and
    backward) and reduce-scatters the gradients; the wire time is the
    comm model's time for exactly those collectives, and bytes agree."""
    arch, work, cluster, _ = _all_estimates(tuple(LLAMA_64))
    lay = Layout(tp=1, cp=1, ep=1, dp=64, pp=1, micro_batch=1, zero=3)
    e = estimate(arch, lay, work, cluster)
    m = e.microbatches
    assert m == 8
    params = arch.total_params
    w, g = params * work.state_bytes.weights, params * work.state_bytes.grads
    assert e.comm_bytes["dp"] == pytest.approx(m * (2 * w + g) * 63 / 64, rel=1e-12)

    def coll(kind, nbytes):  # bucketed like the estimate
        b = max(1, int(-(-nbytes // work.bucket_bytes)))
        return b * cm.group_time(kind, nbytes / b, 8, 8, cluster.intra, cluster.inter)

    assert e.comm_time["dp"] == pytest.approx(m * (2 * coll("all_gather", w) + coll("reduce_scatter", g)), rel=1e-12)
    # the NICs carry 1/8 of each spanning collective (one NIC per GPU, rails in parallel)
    nic_seconds = m * (2 * w + g) / 8 * 7 / 8 / cluster.inter.busbw
    assert e.comm_time["dp"] > nic_seconds
