"""hpctrain under a real Slurm: srun --mpi=pmix, the sbatch template, and a
bad layout failing fast. Fixtures and skip rules: tests/slurm/conftest.py."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SBATCH = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"


def _metrics(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    assert path.is_file(), f"no {path}; run dir holds {sorted(p.name for p in run_dir.glob('*'))}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_training(run_dir: Path, steps: int, world: int) -> None:
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] > losses[-1], f"loss did not fall: {losses}"
    # dp=-1 (the default) takes the whole world, so dp=<world> in the layout
    # line proves the ranks found each other through PMIx; ranks that each
    # believed they were alone would log dp=1.
    log = (run_dir / "train.log").read_text()
    assert re.search(rf"layout .*\bdp={world}\b", log), f"no 'layout ... dp={world}' in train.log:\n{log}"


def _show(proc) -> str:
    return f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_srun_pmix_trains_with_four_ranks(slurm, job_name, tmp_path):
    run_dir = tmp_path / "run"
    proc = slurm.run(
        ["srun", "--mpi=pmix", "-n", "4", "--time=5", f"--job-name={job_name}", "--kill-on-bad-exit=1",
         "hpctrain-train", "trainer.steps=6", f"hydra.run.dir={run_dir}"],
        job_name,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, _show(proc)
    _check_training(run_dir, steps=6, world=4)


def test_sbatch_template_completes(slurm, job_name, tmp_path):
    # Small resources; everything else comes from the template's #SBATCH lines.
    # --chdir keeps the job's runs/ and log out of the repository.
    proc = slurm.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1",
         "--time=5", f"--job-name={job_name}", f"--chdir={tmp_path}", str(SBATCH), "trainer.steps=4"],
        job_name,
        timeout=60,
        cwd=tmp_path,
    )
    job_id = proc.stdout.strip().split(";")[0]
    assert proc.returncode == 0 and job_id.isdigit(), _show(proc)
    info = slurm.wait_job(job_id, job_name)
    out_file = tmp_path / f"{job_name}-{job_id}.out"
    out = out_file.read_text() if out_file.is_file() else f"(no {out_file.name})"
    assert "JobState=COMPLETED" in info, f"{info}\njob output:\n{out}"
    assert f"run dir {tmp_path}/runs/slurm-{job_id}" in out, out
    _check_training(tmp_path / "runs" / f"slurm-{job_id}", steps=4, world=4)


def test_bad_layout_fails_fast_with_one_line(slurm, job_name, tmp_path):
    run_dir = tmp_path / "run"
    proc = slurm.run(
        ["srun", "--mpi=pmix", "-n", "4", "--time=5", f"--job-name={job_name}", "--kill-on-bad-exit=1",
         "hpctrain-train", "parallel.dp=3", "trainer.steps=2", f"hydra.run.dir={run_dir}"],
        job_name,
        cwd=tmp_path,
    )
    assert proc.returncode != 0, _show(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpctrain: error:")]
    # Every rank finds the problem, only rank 0 reports it: one line, not four.
    size_errors = [line for line in errors if "!= world size 4" in line]
    assert len(size_errors) == 1, _show(proc)
    assert "dp(3)" in size_errors[0], size_errors
    assert "Traceback" not in proc.stderr, _show(proc)
    assert not (run_dir / "metrics.jsonl").exists()

