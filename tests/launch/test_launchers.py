"""The app as users launch it: a plain process, ``python -m hpctrain``, and
real ``mpiexec`` jobs (started from this one-process pytest; the 4-rank job
sharing rank 0's run directory is the README demo's: test_messages.py). The bad-input
paths (one clear line, non-zero exit on every rank, no hang, no traceback
wall) run in the 2-rank session's ranks: tests/mpi/test_cli_messages.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec.openmpi") or shutil.which("mpiexec")
TIMEOUT = 240  # a hang fails the test instead of the suite


def _env(**extra):
    """This environment minus any MPI variables (we may run inside a launcher)
    and ``HYDRA_FULL_ERROR`` (a user's default: config errors in one line)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "OMPI_MCA_ess"))
           and k != "HYDRA_FULL_ERROR"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1")
    env.update(extra)
    return env


def _run(args, n=None, **kw):
    cmd = ([MPIEXEC, "-n", str(n)] if n else []) + [sys.executable, "-m", "hpctrain"] + list(args)
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, **kw)


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_console_script_one_process(tmp_path):
    exe = shutil.which("hpctrain-train", path=os.path.dirname(sys.executable))
    r = subprocess.run([exe, "trainer.steps=3", f"hydra.run.dir={tmp_path}"], env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in _metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / ".hydra" / "config.yaml").exists()


def test_python_m_and_plugins_listing():
    r = _run(["--plugins"])
    assert r.returncode == 0 and "comm_torch" in r.stdout and "dp" in r.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_the_progress_bar_follows_the_launchers_terminal(tmp_path):
    """``mpiexec ... > log`` from a terminal session (TERM set): no escape codes
    in the log; the same launch on a terminal draws the bar."""
    import pty

    env = _env(TERM="xterm")
    env.pop("CI", None)
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "hpctrain", "trainer.steps=3", f"hydra.run.dir={tmp_path}/a"]
    with open(tmp_path / "log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT)
    text = (tmp_path / "log").read_text()
    assert r.returncode == 0 and "step 3/3" in text and "\x1b[" not in text, text
    main, sub = pty.openpty()
    job = subprocess.Popen(cmd[:-1] + [f"hydra.run.dir={tmp_path}/b"], stdin=subprocess.DEVNULL, stdout=sub,
                           stderr=sub, env=env)
    os.close(sub)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert job.wait(timeout=TIMEOUT) == 0
    assert b"\x1b[" in seen and b"3/3" in seen, seen
