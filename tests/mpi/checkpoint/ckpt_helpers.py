"""Helpers of the checkpoint tests: tiny runs in this MPI job, runs in new
processes launched from rank 0, and comparing checkpoint files. (A module of
its own: several test directories have a ``conftest``, so importing from one
by that name is ambiguous.)

A run in new processes is ``python -m hpctrain`` (one process) or
``mpiexec.openmpi -n N python -m hpctrain`` started by rank 0 with the outer
job's OMPI_*/PMIX_* variables removed, so it is an independent MPI job.
While rank 0 waits for it, the other ranks wait in a non-blocking barrier
polled with sleeps instead of spinning in a blocking collective, leaving the
two cores to the runs under test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

import h5py
import numpy as np

#: Tiny steps: 8 samples of 32 tokens, micro-batches of 1 (valid for dp 1, 2, 4 and 8).
BASE = ["trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32",
        "trainer.progress=off", "trainer.log_every=100"]


def clean_env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1")
    return env


def launch(nprocs: int, overrides: Sequence[str], run_dir: str) -> subprocess.Popen:
    """Start a training run in new processes (rank 0 only); see ``finish``."""
    cmd = [sys.executable, "-m", "hpctrain", *overrides, f"hydra.run.dir={run_dir}"]
    if nprocs > 1:
        cmd = ["mpiexec.openmpi", "-n", str(nprocs), *cmd]
    log = open(run_dir + ".log", "w")
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    proc.run_dir, proc.log = run_dir, log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen) -> List[Dict[str, Any]]:
    """Wait for a launched run; its per-step metrics."""
    rc = proc.wait(timeout=600)
    proc.log.close()  # type: ignore[attr-defined]
    if rc != 0:
        with open(proc.run_dir + ".log") as f:  # type: ignore[attr-defined]
            raise RuntimeError(f"{' '.join(proc.args)} exited with {rc}:\n{f.read()[-4000:]}")
    with open(os.path.join(proc.run_dir, "metrics.jsonl")) as f:  # type: ignore[attr-defined]
        return [json.loads(line) for line in f]


def config(*overrides: str, pm=None):
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import get_manager

    pm = pm or get_manager()
    return compose_resolved(overrides, pm)


def agreed_config(*overrides: str):
    """The config ``config`` composes, composed on rank 0 and received by the
    others as a job's ranks get it. Collective."""
    from mpi4py import MPI

    from hpctrain.config import compose_agreed
    from hpctrain.plugins import get_manager

    return compose_agreed(overrides, get_manager(), MPI.COMM_WORLD)


def run_here(overrides: Sequence[str], run_dir: Optional[str] = None) -> List[Dict[str, Any]]:
    """Train in this MPI job (dp = world size); per-step metrics on every rank."""
    from hpctrain.run import run

    return run(agreed_config(*BASE, *overrides), run_dir)


def build_trainer(*overrides: str):
    """A Trainer on this MPI job (for tests that need the checkpointer object)."""
    from hpctrain.bootstrap import with_device
    from hpctrain.plugins import get_manager
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    pm = get_manager()
    cfg = agreed_config(*BASE, *overrides)
    rt = with_device(cfg.trainer.device)
    configure_torch(cfg, rt)
    return Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)


def datasets(path: str, prefixes: Sequence[str] = ("/model/", "/optim/", "/meta/rng/")) -> Dict[str, np.ndarray]:
    """Every dataset under ``prefixes``, read whole (default driver, read-only)."""
    out: Dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset) and ("/" + name).startswith(tuple(prefixes)):
                out["/" + name] = obj[()]
        f.visititems(visit)
    return out


def assert_same_datasets(a: str, b: str, prefixes: Sequence[str] = ("/model/", "/optim/", "/meta/rng/")) -> None:
    da, db = datasets(a, prefixes), datasets(b, prefixes)
    assert sorted(da) == sorted(db)
    different = [k for k in da if not np.array_equal(da[k], db[k])]
    assert not different, f"{a} and {b} differ in {different[:5]}"


def losses(trainer: Any, steps: int) -> List[float]:
    """Train ``steps`` steps; their logged losses."""
    return [trainer.train_step()["loss"] for _ in range(steps)]


def alone_checkpointer() -> Any:
    """The HDF5 checkpointer of a one-process trainer inside this MPI job."""
    from mpi4py import MPI

    from hpctrain_h5ckpt import options
    from hpctrain_h5ckpt.checkpointer import H5Checkpointer

    return H5Checkpointer(MPI.COMM_SELF, options.resolve(options.H5Config()), None, 0, False)


def load_alone(trainer: Any, path: str) -> Any:
    """Load ``path`` into a one-process trainer inside this MPI job, as its checkpointing does: the
    checkpointer restores the trainer's state in place, and the step comes from what it restored."""
    restored = alone_checkpointer().load(trainer.state, path)
    trainer.step = restored.step
    return restored
