"""Fixtures of the checkpoint tests (helpers live in ``ckpt_helpers``)."""
from __future__ import annotations

import shutil
import tempfile

import pytest
from mpi4py import MPI


@pytest.fixture(scope="module")
def module_dir():
    """A directory shared by all ranks for one test module."""
    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="hpctrain-ckpt-") if comm.Get_rank() == 0 else None, root=0)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
