"""The README's five-axis commands, launched as users launch them: the 3D
preset trains under ``mpiexec -n 8 hpctrain-train parallel=3d`` (the run
test_report.py renders), and
``hpctrain-parity`` says it trains what one process trains (exit 0, an OK
line). (A layout the validator refuses: tests/mpi/test_cli_tools.py; the
broken-plugin case is tests/mpi/test_parity_command.py.)"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec.openmpi") or shutil.which("mpiexec")
TIMEOUT = 300
BIN = Path(sys.executable).parent
SMALL = ["trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32"]

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def _env():
    launcher_vars = ("OMPI_COMM_WORLD", "PMIX_", "PMI_", "OMPI_MCA_ess")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1")
    return env


def _launch(n, exe, *args, cwd=None):
    return subprocess.run([MPIEXEC, "-n", str(n), str(BIN / exe), *args], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=cwd)


@pytest.mark.alone  # with test_report.py, the one session that runs readme_3d_run (8 ranks)
def test_readme_3d_run_trains(readme_3d_run):
    r, run = readme_3d_run  # (tests/launch/conftest.py; its report is rendered in test_report.py)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    log = (run / "train.log").read_text()
    assert "layout tp=2 * cp=1 * ep=1 * dp=2 * pp=2" in log, log


def test_parity_command_passes_the_3d_preset():
    r = _launch(8, "hpctrain-parity", "--steps", "2", "parallel=3d", "model.n_layers=4", *SMALL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[-1].startswith("OK: every step within tolerance"), r.stdout
    assert [line.split()[0] for line in lines[-3:-1]] == ["1", "2"], r.stdout
    assert "tp 2 x dp 2 x pp 2 (8 ranks) against one process" in r.stderr, r.stderr
