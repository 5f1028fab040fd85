"""Fixtures for tests that launch hpctrain through a real Slurm controller.

They need a running controller with a node of at least 4 CPUs. On a machine
without one, start the throwaway local cluster first (as root)::

    bash slurm/local/start.sh && python -m pytest -q tests/slurm

Which controller: ``$SLURM_CONF`` if set, else the local cluster's config
when ``slurm/local/start.sh`` has written ``$HPCTRAIN_SLURM_DIR/env``
(default ``/tmp/hpctrain-slurm/env``), else the system's Slurm. Without a
reachable controller every test is skipped with the reason; set
``HPCTRAIN_REQUIRE_SLURM=1`` (as CI should) to make that a failure instead,
so a cluster that failed to start cannot pass as green.

Every command and every wait for a batch job has a timeout
(``HPCTRAIN_SLURM_TEST_TIMEOUT`` seconds, default 180) and every job a unique
name; on a timeout the job is cancelled, so a broken Slurm cannot hang or
litter CI.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

TIMEOUT_S = float(os.environ.get("HPCTRAIN_SLURM_TEST_TIMEOUT", "180"))
NEED_CPUS = 4


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs a running Slurm controller (tests/slurm)")


def _local_conf() -> Optional[str]:
    """SLURM_CONF from the env file slurm/local/start.sh writes, if any."""
    env_file = Path(os.environ.get("HPCTRAIN_SLURM_DIR", "/tmp/hpctrain-slurm")) / "env"
    try:
        text = env_file.read_text()
    except OSError:
        return None
    m = re.search(r"^export SLURM_CONF=(\S+)$", text, re.M)
    return m.group(1) if m and Path(m.group(1)).is_file() else None


def _child_env() -> Dict[str, str]:
    """The environment for srun/sbatch: ours, minus what would tie the child
    to an enclosing launch (an outer Slurm job or mpiexec), plus the venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_")) or k == "HPCTRAIN_RUN_DIR")
    }
    conf = os.environ.get("SLURM_CONF") or _local_conf()
    if conf:
        env["SLURM_CONF"] = conf
    # hpctrain-train lives next to this interpreter even when the venv is not
    # activated (python -m pytest with the venv's python).
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if sys.prefix != sys.base_prefix:
        env["HPCTRAIN_VENV"] = sys.prefix  # train.sbatch activates it
    # 4 ranks may share fewer cores: one thread each, and waiting Open MPI
    # ranks yield the CPU instead of spinning.
    env["OMP_NUM_THREADS"] = "1"
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
          "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


@dataclass
class Slurm:
    """A reachable Slurm controller and how to run commands against it."""

    env: Dict[str, str]
    timeout: float = TIMEOUT_S

    def run(self, args: List[str], job_name: str, timeout: Optional[float] = None,
            cwd=None) -> subprocess.CompletedProcess:
        """Run a Slurm client command; on timeout cancel job ``job_name`` and fail."""
        timeout = timeout or self.timeout
        try:
            return subprocess.run(args, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.cancel(job_name)
            pytest.fail(
                f"{' '.join(args)} did not finish in {timeout:.0f} s (job {job_name} cancelled)\n"
                f"stdout:\n{e.stdout or ''}\nstderr:\n{e.stderr or ''}"
            )

    def wait_job(self, job_id: str, job_name: str, timeout: Optional[float] = None) -> str:
        """Poll until job ``job_id`` ends; its ``scontrol -o show job`` line.

        Polling every second rather than ``sbatch --wait``, whose back-off
        can notice a job's end tens of seconds late; and a job stuck pending
        fails here with Slurm's reason instead of a bare timeout."""
        deadline = time.monotonic() + (timeout or self.timeout)
        info = ""
        while time.monotonic() < deadline:
            proc = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env,
                                  capture_output=True, text=True, timeout=30)
            info = (proc.stdout or proc.stderr).strip()
            m = re.search(r"\bJobState=(\w+)", info)
            if m and m.group(1) in _ENDED:
                return info
            time.sleep(1.0)
        self.cancel(job_name)
        pytest.fail(f"job {job_id} did not end in {timeout or self.timeout:.0f} s (cancelled); last seen:\n{info}")

    def run_printed(self, command: str, job_name: str, run_dir, cwd) -> subprocess.CompletedProcess:
        """Run a command line a tool printed (``srun ... hpctrain-train ...``) exactly as printed, with
        ``run_dir`` as its run directory; on timeout cancel ``job_name`` and fail."""
        env = dict(self.env, SLURM_JOB_NAME=job_name, SLURM_TIMELIMIT="5", HPCTRAIN_RUN_DIR=str(run_dir))
        try:
            return subprocess.run(shlex.split(command), env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            self.cancel(job_name)
            pytest.fail(f"{command} did not finish in {self.timeout:.0f} s:\n{e.stdout or ''}\n{e.stderr or ''}")

    def cancel(self, job_name: str) -> None:
        subprocess.run(["scancel", f"--name={job_name}"], env=self.env, capture_output=True, timeout=30)


def _unavailable(reason: str):
    if os.environ.get("HPCTRAIN_REQUIRE_SLURM") == "1":
        pytest.fail(f"HPCTRAIN_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm() -> Slurm:
    """A reachable controller with a node of >= 4 CPUs, or skip (fail in CI)."""
    env = _child_env()
    start = "start one with `bash slurm/local/start.sh` (as root)"
    if not shutil.which("sinfo", path=env["PATH"]) or not shutil.which("srun", path=env["PATH"]):
        _unavailable(f"Slurm client commands (sinfo, srun) are not installed; {start}")
    if not shutil.which("hpctrain-train", path=env["PATH"]):
        _unavailable("hpctrain-train is not installed next to this Python; pip install -e . first")
    where = f"SLURM_CONF={env.get('SLURM_CONF', '(system default)')}"
    try:
        ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        ping = None
    if ping is None or "UP" not in ping.stdout:
        lines = [] if ping is None else (ping.stdout + ping.stderr).strip().splitlines()
        detail = "timed out" if ping is None else (lines[-1] if lines else f"exit status {ping.returncode}")
        _unavailable(f"no Slurm controller answers ({where}: scontrol ping: {detail}); {start}")
    nodes = subprocess.run(
        ["sinfo", "-h", "-N", "-t", "idle,mixed", "-o", "%c"], env=env, capture_output=True, text=True, timeout=20
    ).stdout.split()
    if not any(n.isdigit() and int(n) >= NEED_CPUS for n in nodes):
        _unavailable(f"no idle Slurm node with >= {NEED_CPUS} CPUs ({where}); see `sinfo -N -l`")
    return Slurm(env)


@pytest.fixture
def job_name() -> str:
    """A unique job name, so a timed-out job can be found and cancelled."""
    return f"hpctrain-test-{uuid.uuid4().hex[:8]}"
