"""Run a command's ``main(argv)`` on every rank of this MPI session, as
``mpiexec -n N <command> ...`` runs it, and see what the user would see.

The launcher tests (tests/launch) start a fresh ``mpiexec`` job for each
case; what a case checks that does not need a fresh job (a message, an exit
status on every rank, the files a run leaves) is checked here instead, in
the ranks this session already has: each rank calls the same ``main`` the
console script calls, and the output of every rank is gathered to every
rank (one job's combined output, as ``mpiexec`` shows it).

The commands end with ``hpctrain.bootstrap.shutdown()`` (torch's process
group torn down, as at the end of a process); here the session goes on, so
it is left in place while a command runs."""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable, List, Sequence

QUIET = ["trainer.progress=off", "trainer.log_every=100"]


class Job:
    """What one in-session command left: each rank's exit status and the ranks' output together."""

    def __init__(self, codes: List[int], outputs: List[str]):
        self.codes = codes
        self.outputs = outputs
        self.out = "".join(outputs)

    @property
    def code(self) -> int:
        """The job's status, as mpiexec reports it: the first non-zero rank's, else 0."""
        return next((c for c in self.codes if c), 0)

    def errors(self, prefix: str = "hpctrain: error: ") -> List[str]:
        return [line[len(prefix):] for line in self.out.splitlines() if line.startswith(prefix)]


def run_main(world, capfd, main: Callable[[], int]) -> Job:
    """``main()`` on every rank of ``world``; the ranks' statuses and output (gathered;
    empty without ``capfd``: a module fixture's job, checked by its status and files)."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("hpctrain.bootstrap.shutdown", lambda: None)
        if capfd is not None:
            capfd.readouterr()  # what came before is not this command's
        world.Barrier()
        try:
            code = main()
        except SystemExit as e:  # argparse's exits
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out, err = capfd.readouterr() if capfd is not None else ("", "")
    codes = world.allgather(int(code))
    outputs = world.allgather(out + err)
    return Job(codes, outputs)


def command(name: str) -> Callable[..., int]:
    """A console script's ``main`` by its name (pyproject.toml's [project.scripts])."""
    module, func = {
        "hpctrain-train": ("hpctrain.cli", "main"),
        "hpctrain-prepare": ("hpctrain.data.prepare", "main"),
        "hpctrain-parity": ("hpctrain.parity_cli", "main"),
        "hpctrain-tune": ("hpctrain.tune.cli", "main"),
        "hpctrain-ckpt": ("hpctrain_h5ckpt.cli", "main"),
    }[name]
    return getattr(importlib.import_module(module), func)


def train(world, capfd, args: Sequence[str], run_dir, quiet: Sequence[str] = QUIET,
          evaluate: bool = False) -> Job:
    """``mpiexec -n <world> hpctrain-train <quiet> <args> hydra.run.dir=<run_dir>`` (or hpctrain-eval)."""
    from hpctrain.cli import main

    argv = [*quiet, *map(str, args), f"hydra.run.dir={run_dir}"]
    return run_main(world, capfd, lambda: main(argv, evaluate=evaluate))


def metrics(run_dir) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def module_dir(world, prefix: str) -> str:
    """A fresh directory, the same path on every rank (for module-scoped jobs; removed by the caller)."""
    import tempfile

    path = tempfile.mkdtemp(prefix=prefix) if world.Get_rank() == 0 else None
    return world.bcast(path, root=0)


def remove_dir(world, path: str) -> None:
    import shutil

    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
