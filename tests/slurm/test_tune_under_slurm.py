"""hpctrain-tune under a real Slurm: ``srun --mpi=pmix -n 4 hpctrain-tune ...`` measures, trains its
top 2 and prints the fastest layout's command; that command, split as a shell would and run
unchanged, trains the same steps with the losses the tuner measured for it. Fixtures and skip rules:
tests/slurm/conftest.py."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slurm

TINY = ["model=tiny", "trainer.global_batch_size=8", "trainer.seq_len=32", "parallel.zero.stage=0",
        "model.recompute=none", "parallel.pipeline.timeline=false", "trainer.steps=2"]
LOSS_RTOL = 1e-6
"""fp32, the same layout and the same data in both jobs: equal up to the last bits."""


def _show(proc) -> str:
    return f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_the_tuners_command_runs_as_printed(slurm, job_name, tmp_path):
    out = tmp_path / "tune.json"
    tune = slurm.run(["srun", "--mpi=pmix", "--nodes=1", "-n", "4", "--time=5", f"--job-name={job_name}",
                      "--kill-on-bad-exit=1", "hpctrain-tune", *TINY, "--top", "2", "--steps", "2",
                      "--measure-iters", "2", "--out", str(out)], job_name, cwd=tmp_path)
    assert tune.returncode == 0, _show(tune)
    lines = tune.stdout.splitlines()
    command = lines[lines.index("run it with:") + 1].strip()
    report = json.loads(out.read_text())
    assert command == report["best"]["command"]
    assert command.startswith("srun --nodes=1 --ntasks-per-node=4 --mpi=pmix hpctrain-train model=tiny "), command

    run_dir = tmp_path / "run"
    train = slurm.run_printed(command, job_name, run_dir, tmp_path)
    assert train.returncode == 0, _show(train)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [1, 2], rows
    measured = report["layouts"][report["best"]["index"]]
    assert measured["ok"] and len(measured["losses"]) == 2
    assert [r["loss"] for r in rows] == pytest.approx(measured["losses"], rel=LOSS_RTOL)
    sizes = measured["sizes"]
    layout = (run_dir / "layout.json").read_text()
    assert all(json.loads(layout)["sizes"][a] == n for a, n in sizes.items()), (sizes, layout)
    assert list(tmp_path.glob("tune.runs/*/metrics.jsonl"))  # every tried layout's own run directory
