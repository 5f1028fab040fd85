"""Shared fixtures.

Unit tests (tests/unit) run in one process. Multi-rank tests (tests/mpi) run
under ``mpiexec -n N python -m pytest --with-mpi tests/mpi`` and are marked
``@pytest.mark.mpi(min_size=N)``; scripts/test.sh runs them at 2, 4 and 8
ranks. Every rank runs the whole session, so fixtures that touch the
filesystem agree on one path through MPI.

At 8 ranks (and more) only the tests written for 8 ranks and those marked
``every_size`` run: 8 oversubscribed ranks cost several times what 4 do on
a small CI machine, and a test written for 2 or 4 ranks has already run at
2 and 4 (at 8 the same code gets only a larger dp). Mark ``every_size`` what
the world size changes (collectives, resharding, shard padding, emulated
nodes, tp = the world). ``HPCTRAIN_TEST_EVERY_SIZE=1`` runs every test at
every size.

Below 8, a test written for 2 ranks runs at 4 too, unless it is marked
``same_at_every_size``: what it checks does not depend on the world size
(a fixed layout, a file format, a message), so it runs at its ``min_size``
only. Mark that only where a larger world changes nothing the test looks at.
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
# one inductor cache for every test process and session (trainer.compile): compiled kernels are
# reused across ranks, sessions and runs of the suite instead of compiled again (build/ is not tracked)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "build", "inductor-cache"))

#: from this world size on, tests written for fewer ranks run only when marked ``every_size``
LARGE_WORLD = 8


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "every_size: a test written for fewer ranks that also runs at 8 and more (see tests/conftest.py)")
    config.addinivalue_line(
        "markers", "same_at_every_size: the world size changes nothing this test checks: it runs at its min_size "
                   "only (see tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--with-mpi", default=False) or os.environ.get("HPCTRAIN_TEST_EVERY_SIZE") == "1":
        return
    size = _world().Get_size()
    for item in items:
        mpi = item.get_closest_marker("mpi")
        written_for = mpi.kwargs.get("min_size", 1) if mpi is not None else None
        if written_for is not None and size > written_for and item.get_closest_marker("same_at_every_size"):
            item.add_marker(pytest.mark.skip(reason=f"same at every size: runs at {written_for} ranks only"))
    if size < LARGE_WORLD:
        return
    for item in items:
        mpi = item.get_closest_marker("mpi")
        written_for = mpi.kwargs.get("min_size", 1) if mpi is not None else None
        if written_for is not None and written_for < LARGE_WORLD and item.get_closest_marker("every_size") is None:
            skip = pytest.mark.skip(reason=f"written for {written_for} ranks: runs below {LARGE_WORLD}, "
                                           f"at {size} only if marked every_size")
            item.add_marker(skip)
