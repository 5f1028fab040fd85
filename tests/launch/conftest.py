"""Jobs more than one launcher test looks at, run once per session."""
import subprocess
import sys
from pathlib import Path

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env


@pytest.fixture(scope="session")
def readme_3d_run(tmp_path_factory):
    """(finished process, run directory) of the README's 3D command,
    ``mpirun -n 8 hpctrain-train parallel=3d``, for 3 steps, with what its
    report shows on a CPU: a cluster peak (so MFU is drawn) and a straggler
    check every step. tests/launch/test_layout_commands.py holds it to the
    README, tests/launch/test_report.py renders its report."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec")
    run = tmp_path_factory.mktemp("readme-3d")
    cmd = [MPIEXEC, "-n", "8", str(Path(sys.executable).parent / "hpctrain-train"), "parallel=3d", "trainer.steps=3",
           "trainer.progress=off", "trainer.log_every=1", "reliability.straggler_every=1", "cluster.peak_tflops=0.1",
           f"hydra.run.dir={run}"]
    return subprocess.run(cmd, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=TIMEOUT * 2,
                          cwd=run), run
