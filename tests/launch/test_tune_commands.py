"""``mpiexec -n 4 hpctrain-tune ...`` as users launch it: it ends with the fastest measured layout's
command, and that command, run as printed, trains (with srun when a Slurm controller answers; else the
same hpctrain-train argument list under mpiexec with the printed task count). A layout failing on one
rank only ends the job through the hang watchdog instead of hanging. (Bad arguments: one line, exit 2,
before any collective: tests/mpi/test_cli_tools.py.)"""
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec.openmpi") or shutil.which("mpiexec")
TIMEOUT = 600
BIN = Path(sys.executable).parent
TINY = ["model=tiny", "trainer.global_batch_size=8", "trainer.seq_len=32", "trainer.steps=2",
        "parallel.zero.stage=0", "model.recompute=none"]

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def _env():
    launcher_vars = ("OMPI_COMM_WORLD", "PMIX_", "PMI_", "OMPI_MCA_ess")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def _slurm_answers() -> bool:
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return False
    try:
        return subprocess.run([sinfo, "-h"], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def test_printed_command_runs_as_printed(tmp_path):
    out = tmp_path / "tune.json"
    r = subprocess.run([MPIEXEC, "-n", "4", str(BIN / "hpctrain-tune"), *TINY, "--top", "2", "--steps", "2",
                        "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    command = lines[lines.index("run it with:") + 1].strip()
    assert command == json.loads(out.read_text())["best"]["command"]
    argv = shlex.split(command)
    assert argv[:5] == ["srun", "--nodes=1", "--ntasks-per-node=4", "--mpi=pmix", "hpctrain-train"], command
    run_dir = tmp_path / "run"
    if _slurm_answers():
        launched = subprocess.run(f"{command} hydra.run.dir={run_dir}", shell=True, env=_env(), capture_output=True,
                                  text=True, timeout=TIMEOUT, cwd=tmp_path)
    else:  # the same argument list, under the launcher this machine has
        launched = subprocess.run([MPIEXEC, "-n", "4", str(BIN / "hpctrain-train"), *argv[5:],
                                   f"hydra.run.dir={run_dir}"], env=_env(), capture_output=True, text=True,
                                  timeout=TIMEOUT, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    best = json.loads(out.read_text())["best"]["index"]
    assert [row["loss"] for row in rows] == pytest.approx(json.loads(out.read_text())["layouts"][best]["losses"],
                                                          rel=1e-6)
    assert glob.glob(str(tmp_path / "tune.runs" / "*" / "metrics.jsonl"))


@pytest.mark.alone  # reliability.hang_timeout_s=2
def test_a_layout_failing_on_rank_0_only_ends_the_job_with_the_watchdogs_line(tmp_path):
    # rank 0 records the failure and waits to agree on it while rank 1 waits inside the step's collective
    r = subprocess.run([MPIEXEC, "-n", "2", str(BIN / "hpctrain-tune"), *TINY, "reliability.hang_timeout_s=2",
                        "--top", "0", "--measure-iters", "1", "--out", str(tmp_path / "tune.json"),
                        "--also", "parallel.tp=2 debug.fault=oom debug.fault_rank=0 debug.fault_step=1"],
                       env=_env(), capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert r.returncode == 5, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("hpctrain: error: hang watchdog:")]
    assert len(lines) == 1 and "rank 0 " in lines[0] and "left the job in step 1" in lines[0], r.stderr[-3000:]
