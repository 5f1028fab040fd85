"""``trainer.elastic``: go on with the ranks there are.

A job that lost nodes and has no spare left relaunches on fewer ranks with
``trainer.elastic=true`` (``slurm/train.sbatch``). What changes: the
data-parallel size, recomputed from the world size (``parallel.dp`` is
taken as -1; an explicit value is overridden and the log says so), and with
it the gradient accumulation per rank, since the global batch is kept; the
local tier's copies are capped below the nodes that remain. What stays: the
other axes, the global batch, the global sample cursor (the same stream of
samples, in the same batches) and the learning-rate schedule. State comes
from the persistent checkpoint (layout independent) or from the local tier,
resharded over dp (``hpctrain.localckpt.reshard``).

``adapt`` runs on every rank before validation (it depends only on the
config, the world size and the node count, so every rank makes the same
change); ``describe`` is the line rank 0 logs once the mesh exists.
"""
from __future__ import annotations

from typing import Any, List

from hpctrain.mesh import SAMPLE_AXES


def adapt(cfg: Any, world_size: int, nodes: int) -> List[str]:
    """Make ``cfg`` fit ``world_size`` ranks on ``nodes`` nodes (in place); the changes, as log lines."""
    if not cfg.trainer.elastic:
        return []
    notes = []
    if int(cfg.parallel.dp) != -1:
        notes.append(f"trainer.elastic=true: parallel.dp={cfg.parallel.dp} is recomputed from the world size "
                     f"({world_size} ranks)")
        cfg.parallel.dp = -1
    lc = cfg.checkpoint.local
    if lc.every and lc.replicas >= nodes:
        notes.append(f"trainer.elastic=true: checkpoint.local.replicas={lc.replicas} lowered to {nodes - 1}: "
                     f"{nodes} node(s) remain")
        lc.replicas = nodes - 1
    return notes


def describe(cfg: Any, mesh: Any) -> str:
    """``trainer.elastic=true: dp=2 on 2 ranks; global batch 8 = 2 sample rank(s) x micro-batch 1 x 4
    accumulation step(s)``."""
    t = cfg.trainer
    samples = 1
    for a in SAMPLE_AXES:
        samples *= mesh.size(a)
    accumulation = int(t.global_batch_size) // (samples * int(t.micro_batch_size))
    return (f"trainer.elastic=true: dp={mesh.size('dp')} on {mesh.world_size} ranks; global batch "
            f"{t.global_batch_size} = {samples} sample rank(s) x micro-batch {t.micro_batch_size} x {accumulation} "
            "accumulation step(s)")
