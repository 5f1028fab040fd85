"""A Slurm job with a 2-minute limit stops itself before the limit with a
committed checkpoint and is requeued (issue 59's wall-clock aware stop,
hpctrain/train/deadline.py). Fixtures and skip rules: tests/slurm/conftest.py."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SBATCH = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"


def test_a_two_minute_job_stops_itself_with_a_measured_save_and_is_requeued(slurm, job_name, tmp_path):
    """sbatch --time=2 of the template, 2 ranks, a save every step: the end
    time comes from Slurm (SLURM_JOB_END_TIME or squeue; no trainer.max_time),
    and with trainer.end_margin_s=95 the run stops once less than the next
    step + the measured save + 95 s is left, about 25 s into the job, on its
    own (the template's USR1 warning is moved to 5 s before the end, which the
    job never reaches). The stop line shows the save time measured; rank 0
    requeues the job once the checkpoint is committed (Restarts=1, back in the
    queue), which the test then cancels instead of letting it run again. About
    30 s."""
    ckpt = tmp_path / "ckpt"
    proc = slurm.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=2",
         "--signal=USR1@5", f"--job-name={job_name}", f"--chdir={tmp_path}", str(SBATCH),
         "trainer.steps=500", "checkpoint.every=1", "checkpoint.keep=2", "trainer.end_margin_s=95",
         "trainer.log_every=1", "trainer.progress=off", f"checkpoint.dir={ckpt}"],
        job_name, timeout=60, cwd=tmp_path)
    job_id = proc.stdout.strip().split(";")[0]
    assert proc.returncode == 0 and job_id.isdigit(), f"{proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    try:
        deadline, shown = time.monotonic() + 150, ""
        while time.monotonic() < deadline:
            shown = slurm.run(["scontrol", "-o", "show", "job", job_id], job_name, timeout=30).stdout
            if "Restarts=1" in shown:
                break
            assert not re.search(r"JobState=(COMPLETED|FAILED|TIMEOUT|CANCELLED)", shown), shown
            time.sleep(1.0)
        out = (tmp_path / f"{job_name}-{job_id}.out").read_text()
        assert "Restarts=1" in shown, f"not requeued:\n{shown}\n{out}"
        stop = re.search(r"step (\d+): the SLURM job's time limit \(([\d.]+) s left < next step ([\d.]+) s \+ save "
                         r"([\d.]+) s \(measured\) \+ trainer.end_margin_s 95 s\): saving and stopping", out)
        assert stop, out
        step, (left, save_s) = int(stop.group(1)), (float(stop.group(i)) for i in (2, 4))
        assert 0 < save_s < left, out  # stopped before the limit, with room for the save
        # that step's periodic save is the stop's checkpoint, committed before the requeue (Slurm ends the
        # job's processes as soon as it accepts the requeue, so the stop's last line may never be printed)
        assert f"checkpoint step {step} committed" in out and (ckpt / f"step_{step:08d}.h5").is_file(), out
        assert out.index(f"checkpoint step {step} committed") < out.index(f"asking Slurm to requeue job {job_id}"), out
    finally:
        slurm.cancel(job_name)
    slurm.wait_job(job_id, job_name, timeout=60)  # nothing of it left running
