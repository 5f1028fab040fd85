"""Bucketed, overlapped data parallelism trains the same model as one process.

The one-process reference cannot run inside an MPI rank (the world size is
the MPI world), so rank 0 runs ``python -m hpctrain`` in a subprocess with
the MPI launcher's variables removed (a singleton MPI world), reads its
metrics.jsonl, and broadcasts the per-step losses and gradient norms. Nothing
is stored. The DP runs use the same model, data, seed and global batch; only
the layout, micro-batch size and bucket size differ.

Tolerances. fp32: relative 1e-5 on each step's loss *and* gradient norm.
Averaging n rank gradients instead of accumulating all micro-batches in one
process only reassociates fp32 sums (relative ~1e-7 per step; 8 steps of
AdamW amplify it to ~1e-7..1e-6 measured), while any real error (a missed
bucket, a stale gradient, SUM instead of AVG) moves the gradient norm by far
more than 1e-5; the norm is compared because AdamW and clipping would hide a
scale error from the loss. Final weights must be bit-identical across
replicas (every rank applies the same averaged bytes).
bf16 on the wire: each gradient element is off by at most 2 bf16 roundings,
2 x 2^-8 = 0.8% relative (see test_dp_compress), so the gradient norm gets
1e-2 and the loss, which AdamW's normalised updates make much less
sensitive (measured ~5e-6 after 8 steps), 1e-3; a real error such as a
factor n in the gradients still fails the norm check.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.bootstrap import idle_wait

BASE = ("trainer.steps=8", "trainer.global_batch_size=16", "trainer.seq_len=32", "trainer.progress=off",
        "trainer.device=cpu", "trainer.log_every=8")
CASES = {
    # name: (overrides, loss rtol, grad-norm rtol)
    "buckets": (("trainer.micro_batch_size=2", "comm.bucket_mb=0.05"), 1e-5, 1e-5),
    # 0.01 MiB < the largest parameter (256 x 64 fp32 = 0.0625 MiB); micro-batches of 1
    # mean >1 micro-batch per rank (accumulation without sync) at dp <= 8
    "tiny_buckets_accumulation": (("trainer.micro_batch_size=1", "comm.bucket_mb=0.01"), 1e-5, 1e-5),
    "bf16_wire": (("trainer.micro_batch_size=2", "comm.bucket_mb=0.05", "comm.dp.compress=bf16"), 1e-3, 1e-2),
    # the same reducer over the other backends (only the Communicator protocol is used)
    "mpi_backend": (("comm.backend=mpi", "trainer.micro_batch_size=1", "comm.bucket_mb=0.01"), 1e-5, 1e-5),
    "hier_backend": (("comm.backend=hier", "trainer.micro_batch_size=2", "comm.bucket_mb=0.05"), 1e-5, 1e-5),
}


def _clean_env():
    drop = ("OMPI_", "PMIX_", "PMI_", "HPCTRAIN_RANKS_PER_NODE", "HPCTRAIN_RUN_DIR")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _reference(world, tmp: str):
    """Per-step (loss, grad_norm) of the one-process run, on every rank."""
    result = None
    if world.Get_rank() == 0:
        run_dir = Path(tmp) / "reference"
        cmd = [sys.executable, "-m", "hpctrain", *BASE, "trainer.micro_batch_size=4", f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(cmd, env=_clean_env(), cwd=tmp, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            result = [(r["loss"], r["grad_norm"]) for r in rows]
        else:
            result = f"reference run failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    idle_wait(world)  # the others sleep while rank 0's run has the cores
    result = world.bcast(result, root=0)
    if isinstance(result, str):
        pytest.fail(result)
    return result


@pytest.fixture(scope="module")
def reference():
    import shutil
    import tempfile

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    tmp = tempfile.mkdtemp(prefix="hpctrain-dpref-") if world.Get_rank() == 0 else None
    tmp = world.bcast(tmp, root=0)
    try:
        yield _reference(world, tmp)
    finally:
        world.Barrier()
        if world.Get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _train(cfg, pm):
    from hpctrain.bootstrap import with_device
    from hpctrain.config.validate import validate
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    rt = with_device("cpu")
    assert validate(cfg, rt.world_size, pm) == []
    configure_torch(cfg, rt)
    trainer = Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)
    return trainer, trainer.fit()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", [
    # dp 8 accumulating through tiny buckets, and 4 emulated nodes for hier, also at 8 ranks
    pytest.param(c, marks=pytest.mark.every_size) if c in ("tiny_buckets_accumulation", "hier_backend") else c
    for c in CASES])
def test_dp_trains_like_one_process(case, reference, world, make_config, pm):
    from hpctrain.plugins import capabilities

    overrides, loss_rtol, norm_rtol = CASES[case]
    backend = next((o.split("=")[1] for o in overrides if o.startswith("comm.backend=")), "torch")
    if backend not in capabilities(pm).get("comm.backend", []):
        pytest.skip(f"no installed plugin serves comm.backend={backend}")
    cfg = make_config(*BASE, *overrides)
    trainer, history = _train(cfg, pm)
    assert len(history) == len(reference) == 8
    for m, (ref_loss, ref_norm) in zip(history, reference):
        assert m["loss"] == pytest.approx(ref_loss, rel=loss_rtol), f"step {m['step']} loss"
        assert m["grad_norm"] == pytest.approx(ref_norm, rel=norm_rtol), f"step {m['step']} grad_norm"


    trace = trainer.data_handle.engine.trace
    n_buckets = len(trainer.data_handle.engine.buckets)
    assert [x.bucket for x in trace.launches] == list(range(n_buckets))  # once each, in order
    if case in ("tiny_buckets_accumulation", "mpi_backend"):
        assert trace.num_microbatches > 1
        largest = max(p.numel() * p.element_size() for p in trainer.params)
        assert largest > cfg.comm.bucket_mb * 2**20 and n_buckets >= 5

    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).numpy().tobytes()
    everyone = world.allgather(flat)
    assert all(b == everyone[0] for b in everyone), "replicas' final weights differ"
