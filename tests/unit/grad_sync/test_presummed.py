"""Which gradients the core divides after the fact: a weight whose
*dimension* is split on a data axis (experts on ep) is divided by that
axis's size; replicated weights, tp splits and ZeRO's flat shards over the
data axes are not touched (their reduction already averages them)."""
from __future__ import annotations

import torch

from hpctrain.grad_sync.presummed import scale_presummed
from hpctrain.mesh import Mesh
from hpctrain.shard import replicated_spec, set_spec


def _param(spec):
    p = torch.nn.Parameter(torch.ones(4, 2))
    set_spec(p, spec)
    return p


def test_only_dimension_splits_on_data_axes_are_scaled():
    mesh = Mesh({"ep": 2, "dp": 2, "tp": 2}, world_rank=0, world_size=8)
    base = replicated_spec("w", (8, 2))
    expert = _param(base.split(0, "ep"))
    dense = _param(replicated_spec("d", (4, 2)))
    tp_split = _param(base.split(0, "tp"))
    zero_shard = _param(replicated_spec("z", (4, 2)).flat_split(("ep", "dp")))
    assert scale_presummed([expert, dense, tp_split, zero_shard], mesh) == [expert]
    for p in (expert, dense, tp_split, zero_shard):
        (p * 1.0).sum().backward()
    assert float(expert.grad[0, 0]) == 0.5
    assert all(float(p.grad[0, 0]) == 1.0 for p in (dense, tp_split, zero_shard))
