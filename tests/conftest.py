"""Shared fixtures.

Unit tests (tests/unit) run in one process. Multi-rank tests (tests/mpi) run
under ``mpiexec -n N python -m pytest --with-mpi tests/mpi`` and are marked
``@pytest.mark.mpi(min_size=N)``; scripts/test.sh runs them at 2, 4 and 8
ranks. Every rank runs the whole session, so fixtures that touch the
filesystem agree on one path through MPI.

A test runs at the world size it is written for (its ``min_size``) and at
larger sizes only when marked ``every_size``: what it checks changes with the
world size (collectives over the world, a dp or ep of the world's size, shard
padding, emulated nodes, tp = the world). A test with a fixed layout written
for 2 ranks gets only an extra dp at 4 or 8, which the tests written for 4
and 8 (tp x dp, pp x dp, 3D) check on their own; 8 oversubscribed ranks
cost several times what 4 do on a small CI machine. ``HPCTRAIN_TEST_EVERY_SIZE=1``
runs every test at every size.
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import tempfile

import pytest

# One compute thread per test process. The unit tests run two pytest workers on two cores and the
# multi-rank sessions up to 8 ranks on them; with torch's default of a thread per core every tiny
# op waits for a second thread whose core another process holds (the one-process references built
# before a layout's configure_torch ran 10-25x slower in CPU time). Jobs the tests launch inherit
# it; hpctrain's configure_torch leaves a set OMP_NUM_THREADS alone.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "every_size: the world size changes what this test checks: it runs at every world size from its "
                   "min_size up, not only at its min_size (see tests/conftest.py)")


def _runs_every_size(config) -> bool:
    return not config.getoption("--with-mpi", default=False) or os.environ.get("HPCTRAIN_TEST_EVERY_SIZE") == "1"


def pytest_ignore_collect(collection_path, config):
    """Above 2 ranks, a test module with nothing written for this size and nothing marked
    ``every_size`` is not even imported: collecting it costs every rank seconds of imports."""
    if _runs_every_size(config) or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    size = _world().Get_size()
    if size <= 2:
        return None
    text = collection_path.read_text()
    return None if "every_size" in text or re.search(rf"min_size={size}\b", text) else True


def pytest_collection_finish(session):
    """Everything imported while collecting (torch, transformers, the test modules) lives to the
    end of the session: frozen out of the garbage collector, so that each collection in a test
    (its own ``gc.collect()`` or one the allocator triggers) scans only what the tests made."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if _runs_every_size(config):
        return
    size = _world().Get_size()
    for item in items:
        mpi = item.get_closest_marker("mpi")
        written_for = mpi.kwargs.get("min_size", 1) if mpi is not None else None
        if written_for is not None and size > written_for and item.get_closest_marker("every_size") is None:
            item.add_marker(pytest.mark.skip(reason=f"written for {written_for} ranks: runs at {size} only if marked "
                                                    "every_size"))
