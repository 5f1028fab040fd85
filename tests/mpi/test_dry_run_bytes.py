"""The dry run's recorded bytes are the real step's counted bytes, group by group, op by op.

Each of the 8 ranks trains one real step (the mpi backend, the counting
wrapper's bus bytes per group and op: ``hpctrain.comm.counting``), then plays
itself in a dry run of the same config (``hpctrain.dry_run.play_rank``: the
meta device, the recording backend ``hpctrain_comm_record``), and the two
must be equal, exactly: the same collectives on the same groups with the
same sizes. Two layouts cover every axis:

- tp 2 (sequence parallel) x pp 2 (1F1B) x dp 2 with ZeRO-1 (dense);
- ep 2 x cp 2 (ring) x dp 2 with ZeRO-3 on ``tiny-moe`` with
  ``top_k = num_experts``: every token goes to every expert, so the real
  routing is the even spread the dry run assumes, and the all-to-alls move
  the same rows.
"""
from __future__ import annotations

from typing import Dict, Tuple

import pytest

from hpctrain.dry_run import dry_config, play_rank

from parity import world_trainer

BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "trainer.steps=1", "comm.backend=mpi")
LAYOUTS = {
    "tp2-sp-pp2-dp2-zero1": ("model.n_layers=2", "parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                             "parallel.zero.stage=1"),
    "ep2-cp2-dp2-zero3-moe": ("model=tiny-moe", "model.moe.top_k=4", "parallel.ep=2", "parallel.cp=2",
                              "parallel.dp=2", "parallel.zero.stage=3"),
}


def counted(mesh) -> Dict[Tuple[str, str], float]:
    """{(group, op): bus bytes} the counting wrapper of each group counted."""
    out = {}
    for g in mesh.distinct_groups:
        counter = getattr(g.comm, "counter", None)
        if g.size > 1 and counter is not None:
            out.update({(g.name, op): nbytes for op, nbytes in counter.by_op.items()})
    return out


def recorded(report) -> Dict[Tuple[str, str], float]:
    """{(group, op): bus bytes} of the dry run's records (receives and barriers carry none)."""
    out: Dict[Tuple[str, str], float] = {}
    for r in report.records:
        if r.nbytes:
            out[(r.group, r.op)] = out.get((r.group, r.op), 0.0) + r.nbytes
    return out


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_run_records_what_the_real_step_counts(world, pm, name):
    if world.Get_size() != 8:
        pytest.skip("the layouts are for 8 ranks")
    trainer = world_trainer(pm, *BASE, *LAYOUTS[name])
    trainer.train_step()
    real = counted(trainer.mesh)
    report = play_rank(dry_config(trainer.cfg, pm), 8, world.Get_rank(), pm)
    dry = recorded(report)
    axes = {axis for group, _ in real for axis in group.split("+")}
    assert {"tp", "pp", "dp"} <= axes or {"cp", "ep", "dp"} <= axes, f"{name}: the layout moves too little: {real}"
    assert dry == real, f"rank {world.Get_rank()}, {name}: dry run {dry} != real step {real}"
