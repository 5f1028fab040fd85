"""A benchmark started wrongly ends with one ``hpctrain: error:`` line and status 2."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))}
    return subprocess.run([sys.executable, "-m", "hpctrain.bench", *args], env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("name", ["dp", "comm", "cp", "moe"])
def test_one_process_is_refused_with_the_command_to_run(name):
    done = _bench(name)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [f"hpctrain: error: hpctrain-bench {name} needs at least 2 ranks; "
                     f"run it as mpiexec -n 2 hpctrain-bench {name}"], done.stderr
