"""``mpiexec hpctrain-tune ...`` as users launch it: a layout failing on one rank only ends the job
through the hang watchdog instead of hanging. (The fastest layout's printed command, run as printed:
tests/slurm/test_tune_under_slurm.py, where the command's srun runs; the tuner's measurements against
one process: tests/mpi/test_tune.py; bad arguments: one line, exit 2, before any collective:
tests/mpi/test_cli_tools.py.)"""
import os
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
