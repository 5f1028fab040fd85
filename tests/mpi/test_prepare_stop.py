"""hpctrain-prepare's progress messages across ranks (``prepare._Progress``):
a rank that fails makes every other rank stop at its next poll, whichever
rank fails, instead of tokenising the rest of its files for nothing; the
counts of every rank reach rank 0. (The end-to-end run, one error line and
exit 2 on every rank, is tests/launch/test_prepare_under_mpiexec.py.)"""
from __future__ import annotations

import time

import pytest

from hpctrain.data.prepare import _Progress, _Stopped

LIMIT_S = 30.0


def _poll_until_stopped(progress):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < LIMIT_S:
        try:
            progress.update(1, 0, 0, 0)
        except _Stopped:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("failing", [0, 1])
def test_one_failing_rank_stops_the_others(world, failing):
    rank = world.Get_rank()
    progress = _Progress(world, total_bytes=100, total_files=1, quiet=True, workers=1)
    stopped = None
    try:
        if rank == failing:
            if rank != 0:
                progress.update(7, 1, 2, 3)
                time.sleep(1.1)  # past the send interval: these counts go out before the failure
                progress.update(7, 1, 2, 3)
        else:
            stopped = _poll_until_stopped(progress)
    finally:
        progress.finish(failed=rank == failing)
    assert stopped in (None, True), f"rank {rank} was not told to stop within {LIMIT_S} s"
    everyone = world.allgather(progress.stop_sent if rank == 0 else [])
    progress.settle(everyone[0])
    if rank == 0:
        assert progress.failed and len(progress.done) == world.Get_size() - 1
        if failing != 0:
            assert progress.counts[failing] == (7, 1, 2, 3)
