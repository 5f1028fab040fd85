"""Shared fixtures.

Unit tests (tests/unit) run in one process. Multi-rank tests (tests/mpi) run
under ``mpiexec -n N python -m pytest --with-mpi tests/mpi`` and are marked
``@pytest.mark.mpi(min_size=N)``; scripts/test.sh runs them at 2, 4 and 8
ranks. Every rank runs the whole session, so fixtures that touch the
filesystem agree on one path through MPI.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture
def world():
    """mpi4py's COMM_WORLD."""
    return _world()


@pytest.fixture
def shared_tmp():
    """A fresh directory, the same path on every rank (rank 0 makes it)."""
    comm = _world()
    path = tempfile.mkdtemp(prefix="hpctrain-test-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pm():
    """The plugin manager with every installed plugin (built-ins included)."""
    from hpctrain.plugins import create_manager

    return create_manager()


def compose(*overrides: str, pm=None):
    """The run config for ``overrides`` (Hydra composition, as the CLI does)."""
    from hpctrain.config import compose_resolved

    return compose_resolved(overrides, pm)


@pytest.fixture
def make_config(pm):
    """``make_config("trainer.steps=3", ...)`` -> typed config."""
    return lambda *overrides: compose(*overrides, pm=pm)


os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
