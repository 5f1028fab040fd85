"""hpctrain under a real Slurm: srun --mpi=pmix, the sbatch template, and a
bad layout failing fast. Fixtures and skip rules: tests/slurm/conftest.py."""
from __future__ import annotations

import json
import math
import re
import subprocess
import time
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


def test_srun_and_the_sbatch_template_train_and_usr1_requeues_and_resumes_bit_for_bit(slurm, job_name, tmp_path):
    """The uninterrupted run is ``srun --mpi=pmix -n 4 hpctrain-train`` (its 4
    ranks find each other through PMIx: dp=4). ``scancel --signal=USR1``
    (what ``--signal=USR1@120`` sends) mid-run to the sbatch template's 4-rank
    job: it commits a checkpoint, requeues itself, resumes from it and
    completes in the template's run directory with the per-step losses of the
    uninterrupted run."""
    common = ["trainer.steps=12", "trainer.log_every=1", "trainer.progress=off"]
    ref = slurm.run(["srun", "--mpi=pmix", "-n", "4", "--time=5", f"--job-name={job_name}", "--kill-on-bad-exit=1",
                     "hpctrain-train", *common, f"hydra.run.dir={tmp_path}/ref"], job_name, cwd=tmp_path)
    assert ref.returncode == 0, _show(ref)
    _check_training(tmp_path / "ref", steps=12, world=4)
    # small resources; everything else comes from the template's #SBATCH lines (--chdir keeps the job's
    # runs/ and log out of the repository)
    proc = slurm.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=5",
         f"--job-name={job_name}", f"--chdir={tmp_path}", str(SBATCH), *common,
         "debug.fault=slow", "debug.slow_s=0.5"],  # slow steps, so the signal lands mid-run
        job_name, timeout=60, cwd=tmp_path)
    job_id = proc.stdout.strip().split(";")[0]
    assert proc.returncode == 0 and job_id.isdigit(), _show(proc)
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    signalled = slurm.run(["scancel", "--signal=USR1", job_id], job_name, timeout=30)
    assert signalled.returncode == 0, _show(signalled)
    # Slurm holds a requeued job back for a while (its BeginTime, about 2
    # minutes here); the test lets it start at once, as a busy queue would later
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        shown = slurm.run(["scontrol", "-o", "show", "job", job_id], job_name, timeout=30).stdout
        if "Restarts=1" in shown and "JobState=PENDING" in shown and "Reason=BeginTime" in shown:
            # once nothing is completing on the node (started earlier, the job fails at once)
            completing = slurm.run(["squeue", "-h", "-t", "CG", "-o", "%i"], job_name, timeout=30).stdout.strip()
            if not completing:
                time.sleep(3)
                slurm.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], job_name, timeout=30)
                break
        if "Restarts=1" in shown and re.search(r"JobState=(RUNNING|COMPLETED)", shown):
            break
        time.sleep(0.5)
    info = slurm.wait_job(job_id, job_name, timeout=240)
    out = (tmp_path / f"{job_name}-{job_id}.out").read_text()
    assert "JobState=COMPLETED" in info and "Restarts=1" in info, f"{info}\n{out}"
    assert re.search(r"step \d+: SIGUSR1: saving and stopping", out), out
    assert "committed" in out and "asking Slurm to requeue job" in out and "restarted (requeue number 1)" in out, out
    assert "resumed from" in out, out
    assert f"run dir {run_dir}" in out, out
    _check_training(run_dir, steps=12, world=4)
    got, want = _metrics(run_dir), _metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, 13)), got
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_a_multirun_sweep_goes_to_slurm_one_job_per_point(slurm, job_name, tmp_path):
    """``hpctrain-train --multirun hydra/launcher=slurm``: each point its own
    2-rank Slurm job (srun through PMIx), its own directory, one summary."""
    sweep = tmp_path / "sweep"
    proc = slurm.run(
        ["hpctrain-train", "--multirun", "hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2",
         "hydra.launcher.timeout_min=5", f"hydra.launcher.name={job_name}", "optim.lr=1e-3,3e-3",
         "trainer.steps=4", "trainer.progress=off", f"hydra.sweep.dir={sweep}"],
        job_name, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, _show(proc)
    for point in ("0", "1"):
        _check_training(sweep / point, steps=4, world=2)
    summary = [json.loads(line) for line in (sweep / "summary.jsonl").read_text().splitlines()]
    assert sorted((p["dir"], p["exit_code"], p["last"]["step"]) for p in summary) == [("0", 0, 4), ("1", 0, 4)]
    jobs = {p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)}
    assert len(jobs) == 2, jobs  # two Slurm jobs (an array of two)


def test_the_jobs_time_limit_stops_the_run_with_a_checkpoint(slurm, job_name, tmp_path):
    """srun --time=1: a minute; with a margin of the whole minute the first
    step already leaves too little, so the run saves and stops (exit status
    75) however fast the job starts (with a smaller margin a fast start can
    train all 50 steps before the deadline comes near). The end
    time comes from Slurm (SLURM_JOB_END_TIME or squeue), not from the config:
    no trainer.max_time is set. No checkpoint.every either: the stop saves."""
    ckpt = tmp_path / "ckpt"
    proc = slurm.run(
        ["srun", "--mpi=pmix", "-n", "2", "--time=1", f"--job-name={job_name}", "--kill-on-bad-exit=1",
         "hpctrain-train", "trainer.steps=50", "trainer.end_margin_s=60", f"checkpoint.dir={ckpt}",
         f"hydra.run.dir={tmp_path}/run"],
        job_name, cwd=tmp_path)
    assert proc.returncode == 75, _show(proc)
    assert "stopped on the SLURM job's time limit" in proc.stderr, _show(proc)
    assert len(list(ckpt.glob("step_*.h5"))) == 1


def test_the_planners_command_for_eight_cpu_ranks_runs_as_printed(slurm, job_name, tmp_path):
    """hpctrain-plan for the cpu-8 cluster preset prints an srun line; that
    line, split as a shell would and run unchanged, trains on 8 ranks with
    the planned layout. (The job name, time limit and run directory come
    from srun's and hpctrain's environment variables, not from the line.)"""
    plan = subprocess.run(["hpctrain-plan", "cluster=cpu-8", "model=tiny", "trainer.steps=3", "trainer.log_every=1"],
                          env=slurm.env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, _show(plan)
    lines = plan.stdout.splitlines()
    command = lines[lines.index("run it with:") + 1].strip()
    assert command.startswith("srun --nodes=1 --ntasks-per-node=8 --mpi=pmix hpctrain-train "), command
    layout = {k: int(v) for k, v in re.findall(r"\bparallel\.(tp|cp|ep|dp|pp)=(\d+)", command)}
    assert math.prod(layout.values()) == 8, command

    run_dir = tmp_path / "run"
    proc = slurm.run_printed(command, job_name, run_dir, tmp_path)
    assert proc.returncode == 0, _show(proc)
    _check_training(run_dir, steps=3, world=layout["dp"])
    log = (run_dir / "train.log").read_text()
    for axis, n in layout.items():
        assert re.search(rf"layout .*\b{axis}={n}\b", log), (axis, n, log)
