"""The node-local tier under the layouts real runs use (issue 59, item 1), at
8 ranks on 4 emulated nodes of 2 ranks (``checkpoint.local.replicas=1``:
node n's files are copied to node n+1). Each layout trains 4 steps with a
local save every 2 (DiLoCo: 5 steps, saves every 3, outer step every 2),
then loses what a crash after the save would have lost: the newer step's
files on every node, and node 1's whole directory (its ranks' own files and
the copies it held of node 0's). A fresh trainer of the same layout resumes
with ``checkpoint.resume=auto`` from the saved step, ranks 2 and 3 fetching
their state from node 2, and its losses equal the uninterrupted run's
later losses bit for bit (``==`` on the per-step float lists, the same as
``torch.equal`` on them): every parameter and optimizer state shard came
back exactly.

- ZeRO-3, dp 4 x tp 2: the parameters are the ranks' flat shards, AdamW's
  moments too;
- pp 2 x dp 2 x tp 2, ZeRO-1, uneven stages (``parallel.pipeline.layers=[1,2]``);
- ep 2 x dp 2 x tp 2, MoE (tiny-moe: 4 experts, 2 per ep rank);
- DiLoCo dp 4 x tp 2 (``optim.outer.every=2``): the save at step 3 holds
  the anchor after the outer step at 2, its Nesterov momentum, the inner
  step counter, and replicas that differ (step 3 was an inner step); step 4
  is the next outer step.

Shrink (``trainer.elastic=true``): ZeRO-2 dp 4 x tp 2 on 8 ranks saves step
2; node 1 and node 3 are gone (no spare left), and 4 ranks on nodes 0 and 2
(a sub-communicator of this job: the other 4 ranks wait) continue at dp 2
with the same global batch and sample stream, each assembling its new
optimizer shards from the old dp ranks' recorded pieces (node 0 holds node
3's copies, node 2 node 1's). The reference is a dp 2 x tp 2 ZeRO-2 run on
the same 4 ranks resumed from the 8-rank run's persistent checkpoint of step
2 (layout independent): the same layout from the same state, so the
losses are expected bit-identical, and are checked so. Against the 8-rank
run's own steps 3 and 4 they differ in the last bits only (dp 4 and dp 2
sum the gradients in another order: fp32 rounding), so that comparison is
at the dp parity tests' tolerance (rtol 1e-5), and the consumed samples are
the same.

Cost: one block (pp: three), width 32, 16 tokens; about 35 s of calls at 8
ranks on 2 cores in a session of its own, most of it the first test's
warm-up, which the suite's 8-rank session shares.

The nodes are emulated by the runtime every part of hpctrain asks
(``bootstrap._runtime``, as ``HPCTRAIN_RANKS_PER_NODE=2`` makes at launch);
the files, the partner exchange (MPI point-to-point) and the agreement are
real. The MPI backend (its groups split from the runtime's communicator)
lets the 4-rank trainer run inside this 8-rank job.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpctrain import bootstrap

pytestmark = pytest.mark.mpi(min_size=8)

RUN = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=16", "trainer.progress=off",
       "trainer.log_every=1", "model.d_model=32", "model.n_layers=1", "comm.backend=mpi",
       "reliability.straggler_every=0", "reliability.weight_check_every=0")

LAYOUTS = {
    "zero3-dp4-tp2": ("parallel.tp=2", "parallel.dp=4", "parallel.zero.stage=3"),
    "pp2-dp2-tp2-zero1-uneven": ("parallel.tp=2", "parallel.dp=2", "parallel.pp=2", "parallel.zero.stage=1",
                                 "model.n_layers=3", "parallel.pipeline.layers=[1,2]"),
    "ep2-dp2-tp2-moe": ("model=tiny-moe", "model.d_model=32", "model.ffn_hidden=32", "parallel.tp=2",
                        "parallel.ep=2", "parallel.dp=2"),
}
DILOCO = ("parallel.tp=2", "parallel.dp=4", "optim.outer=diloco", "optim.outer.every=2")


def _emulated(rank_nodes, rank: int, comm) -> bootstrap.Runtime:
    rt = bootstrap.get_runtime()
    nodes = sorted(set(rank_nodes))
    per_node = rank_nodes.count(rank_nodes[rank])
    return dataclasses.replace(rt, world_rank=comm.Get_rank(), world_size=comm.Get_size(), mpi_comm=comm,
                               rank_nodes=tuple(rank_nodes), node_rank=rank_nodes[rank], num_nodes=len(nodes),
                               local_rank=rank_nodes[:rank].count(rank_nodes[rank]), local_size=per_node,
                               emulated_nodes=True)


@pytest.fixture(scope="module")
def four_nodes():
    """8 ranks on nodes 0-3, two each; a directory shared by all ranks."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 8:
        pytest.skip("written for 8 ranks")
    rank = comm.Get_rank()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bootstrap, "_runtime", _emulated([r // 2 for r in range(8)], rank, comm))
        path = comm.bcast(tempfile.mkdtemp(prefix="hpctrain-local-layouts-") if rank == 0 else None, root=0)
        yield Path(path)
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _train(steps: int, *extra: str, comm=None):
    """A trainer set up as the command's (validation, ``trainer.elastic``'s changes), and its losses."""
    from hpctrain.config import compose_agreed
    from hpctrain.plugins import get_manager
    from hpctrain.run import prepare_run

    pm = get_manager()
    cfg = compose_agreed((*RUN, f"trainer.steps={steps}", *extra), pm, comm or MPI.COMM_WORLD)
    trainer = prepare_run(cfg, pm=pm, loggers=False)
    return trainer, [m["loss"] for m in trainer.fit()]


def _tier(where: Path, name: str, every: int = 2):
    return (f"checkpoint.local.dir={where / name / 'local'}", f"checkpoint.local.every={every}",
            "checkpoint.local.replicas=1", f"checkpoint.dir={where / name / 'ck'}", "checkpoint.resume=auto")


def _lose(local: Path, after: int, nodes=("node_1",)) -> None:
    """What a crash after the save of step ``after`` leaves: no newer step on any node; ``nodes`` gone."""
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.Get_rank() == 0:
        for node in nodes:
            assert (local / node / f"step_{after:08d}").is_dir()
            shutil.rmtree(local / node)
        for step in local.glob("node_*/step_*"):
            if int(step.name.split("_")[1]) > after:
                shutil.rmtree(step)
    comm.Barrier()


def _node_loss(where: Path, name: str, layout, caplog, steps: int = 4, every: int = 2):
    want = _train(steps, *layout, *_tier(where, name, every))[1]
    resume = (steps - 1) // every * every
    _lose(where / name / "local", resume)
    with caplog.at_level(logging.INFO):
        trainer, got = _train(steps, *layout, *_tier(where, name, every))
    assert got == want[resume:], (name, got, want)
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert (f"at step {resume} ({resume * 8} samples consumed); 2 rank(s)' state fetched from partner nodes"
                in caplog.text), caplog.text
    return trainer


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_node_loss_resumes_bit_identically_from_partner_copies(four_nodes, name, caplog):
    _node_loss(four_nodes, name, LAYOUTS[name], caplog)


def test_diloco_resumes_its_replicas_anchor_momentum_and_inner_steps_from_partner_copies(four_nodes, caplog):
    trainer = _node_loss(four_nodes, "diloco-dp4-tp2", DILOCO, caplog, steps=5, every=3)
    opt = trainer.optimizer
    assert opt.inner_steps == 5 and opt.outer_steps == 1  # the counter came back as 3: one outer step (at 4) here
    assert opt.outer.state[opt.anchors[0]]["momentum_buffer"] is not None


def test_shrinking_8_to_4_ranks_under_zero2_reshards_the_optimizer_state(four_nodes, caplog):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    zero2 = ("parallel.tp=2", "parallel.zero.stage=2")
    where = four_nodes / "shrink"
    tier = (*_tier(four_nodes, "shrink"), "checkpoint.every=2")
    big, want = _train(4, *zero2, "parallel.dp=4", *tier)
    _lose(where / "local", 2, nodes=("node_1", "node_3"))
    comm.Barrier()
    if rank == 0:  # the persistent step 2 goes aside: the shrunk run can only resume from the local tier
        shutil.move(where / "ck", where / "saved-ck")
    comm.Barrier()
    # the ranks that remain: 0, 1 on node 0 and 4, 5 on node 2
    stay = rank in (0, 1, 4, 5)
    sub = comm.Split(0 if stay else MPI.UNDEFINED, key=rank)
    failure = None
    if stay:
        try:
            _shrunk(where, zero2, tier, sub, big, want, caplog)
        except Exception as e:  # noqa: BLE001 - every rank of the 8 fails alike (none waits in the barrier)
            traceback.print_exc()
            failure = f"rank {rank}: {type(e).__name__}: {e}"
    failures = [f for f in comm.allgather(failure) if f]
    assert not failures, failures


def _shrunk(where: Path, zero2, tier, sub, big, want, caplog) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bootstrap, "_runtime", _emulated([0, 0, 2, 2], sub.Get_rank(), sub))
        with caplog.at_level(logging.INFO):
            small, got = _train(4, *zero2, *tier, "trainer.elastic=true", comm=sub)
        _, ref = _train(4, *zero2, "parallel.dp=2", f"checkpoint.dir={where / 'saved-ck'}",
                        f"checkpoint.resume={where / 'saved-ck' / 'step_00000002.h5'}", comm=sub)
    assert small.mesh.size("dp") == 2 and small.cursor.consumed_samples == big.cursor.consumed_samples == 32
    assert got == ref, (got, ref)  # the same layout from the same state
    # another dp size sums the gradients in another order: the 8-rank run's steps agree to fp32 rounding
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[2:]), rtol=1e-5, atol=0)
    if sub.Get_rank() == 0:
        text = caplog.text
        assert "written at dp(4) on 8 ranks, resharded to dp(2) on 4" in text, text
        assert "resumed from the local tier" in text and "at step 2 (16 samples consumed)" in text, text
