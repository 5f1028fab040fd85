"""Run one pytest session per MPI rank, the way scripts/test.sh needs it.

``mpiexec -n N python scripts/mpi_pytest.py LOGDIR [pytest args]``: rank 0
prints to the terminal as usual; every other rank writes its output to
``LOGDIR/np{N}-rank{r}.log`` (N interleaved copies of a pytest report are
unreadable). Each rank writes its own JUnit XML, so a test that fails on
any rank counts as failed in the summary. Exit code 5 (nothing collected
at this size) is passed through for the caller to judge.
"""
from __future__ import annotations

import os
import sys


def main() -> int:
    from mpi4py import MPI

    logdir, args = sys.argv[1], sys.argv[2:]
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    os.makedirs(logdir, exist_ok=True)
    if rank != 0:
        fd = os.open(os.path.join(logdir, f"np{size}-rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        args = ["-p", "no:cacheprovider"] + args
    import pytest

    junit = os.path.join(logdir, f"np{size}-rank{rank}.xml")
    return int(pytest.main(["--with-mpi", f"--junitxml={junit}", "-o", "junit_suite_name=np%d" % size] + args))


if __name__ == "__main__":
    sys.exit(main())
