"""A save that fails on some ranks, a real full disk or an injected I/O error
on one rank, is agreed by every rank: no deadlock and no crash, nothing
committed, the temporary file gone, older checkpoints untouched and
readable, one message naming the space. At 4 ranks; the full disk is a
small tmpfs mounted here (root only)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import tempfile
import time

import pytest
from mpi4py import MPI

from hpctrain.parity import on_rank0

from ckpt_helpers import build_trainer
from hpctrain_h5ckpt import h5io, space
from hpctrain_h5ckpt.checkpointer import H5Checkpointer
from hpctrain_h5ckpt.errors import CheckpointSaveFailed

pytestmark = pytest.mark.mpi(min_size=4)

FS_MB = 3
"""Room for one tiny checkpoint (about 1.6 MB here) and not for two."""


@pytest.fixture
def small_fs():
    """A ``FS_MB`` tmpfs shared by every rank (skipped, with the reason, unless root)."""
    comm = MPI.COMM_WORLD
    path, why = None, None
    if comm.Get_rank() == 0:
        if os.geteuid() != 0:
            why = "mounting a small tmpfs to fill needs root"
        else:
            path = tempfile.mkdtemp(prefix="hpctrain-full-")
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_MB}m", "tmpfs", path],
                                  capture_output=True, text=True)
            if done.returncode:
                why = f"mount -t tmpfs failed: {done.stderr.strip()}"
    path, why = comm.bcast((path, why), root=0)
    if why:
        pytest.skip(why)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        subprocess.run(["umount", "-l", path], check=False)
        os.rmdir(path)


def _files(d):
    return sorted(os.listdir(d))


def _readable(path):
    """``hpctrain-ckpt verify`` (its ``main``, on rank 0): every checksum and every value of the older
    checkpoint. The file is read serially, as the command reads it."""
    from hpctrain_h5ckpt.cli import main as ckpt_main

    def verify():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = ckpt_main(["verify", path])
        return code, out.getvalue()
    code, out = on_rank0(MPI.COMM_WORLD, verify)
    assert code == 0 and out.startswith("OK "), out


def _one_step_then_save(d, *overrides):
    t = build_trainer(f"checkpoint.dir={d}", "checkpoint.every=1", "checkpoint.keep=0", *overrides)
    t.train_step()
    first = t.save_checkpoint()
    t.train_step()
    return t, first


@pytest.mark.parametrize("collective_mb, reserve", [(0, True), (64, True), (64, False)],
                         ids=["collective", "independent", "independent-no-reservation"])
def test_a_disk_that_fills_after_the_check_fails_every_rank_cleanly(small_fs, monkeypatch, collective_mb, reserve):
    """The check before the save is bypassed (as when another job fills the
    disk between the check and the save): the reservation meets ENOSPC before
    any data is written; without a reservation (a file system that cannot
    reserve), the independent writes themselves meet it and the ranks agree."""
    d = f"{small_fs}/ck"
    t, first = _one_step_then_save(d, f"checkpoint.hdf5.collective_min_mb={collective_mb}")
    monkeypatch.setattr(H5Checkpointer, "_room_problem", staticmethod(lambda final, needed: None))
    if not reserve:
        monkeypatch.setattr(space, "_fallocate", None)
    t0 = time.monotonic()
    with pytest.raises(CheckpointSaveFailed) as failed:
        t.save_checkpoint()
    assert time.monotonic() - t0 < 30
    message = str(failed.value)
    assert message.startswith("checkpoint step 2 not saved: ") and len(message.splitlines()) == 1, message
    assert f"{d} has " in message and "no space left on device" in message and "MB free" in message, message
    assert "older checkpoints are untouched" in message
    MPI.COMM_WORLD.Barrier()
    assert _files(d) == [".hpctrain.lock", "latest", "step_00000001.h5"]
    _readable(first)


def test_a_full_disk_is_refused_before_the_file_is_opened(small_fs):
    d = f"{small_fs}/ck"
    t, first = _one_step_then_save(d)
    with pytest.raises(CheckpointSaveFailed, match=r"checkpoint step 2 not saved: .* MB free but the checkpoint "
                                                    r"needs .* MB \(no space left on device\)"):
        t.save_checkpoint()
    MPI.COMM_WORLD.Barrier()
    assert _files(d) == [".hpctrain.lock", "latest", "step_00000001.h5"]
    _readable(first)


def test_an_async_save_that_meets_a_full_disk_fails_at_the_next_wait(small_fs, monkeypatch):
    d = f"{small_fs}/ck"
    t, first = _one_step_then_save(d, "checkpoint.async_save=true")
    t.checkpointer.wait()
    monkeypatch.setattr(H5Checkpointer, "_room_problem", staticmethod(lambda final, needed: None))
    t.save_checkpoint()  # returns at once; the write fails in the background
    with pytest.raises(CheckpointSaveFailed, match="no space left on device"):
        t.checkpointer.wait()
    MPI.COMM_WORLD.Barrier()
    assert _files(d) == [".hpctrain.lock", "latest", "step_00000001.h5"]
    _readable(first)


@pytest.mark.parametrize("collective_mb", [0, 64], ids=["collective", "independent"])
def test_one_ranks_write_error_is_agreed_without_a_deadlock(shared_tmp, monkeypatch, collective_mb):
    """Rank 1 alone fails its first write (before HDF5 is called): the others,
    inside collective writes or on their way to the checksums' Allreduce,
    must not wait for it."""
    d = f"{shared_tmp}/inject-{collective_mb}"
    t, first = _one_step_then_save(d, f"checkpoint.hdf5.collective_min_mb={collective_mb}")
    if MPI.COMM_WORLD.Get_rank() == 1:
        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")
        monkeypatch.setattr(h5io, "_spaces", broken)
    with pytest.raises(CheckpointSaveFailed) as failed:
        t.save_checkpoint()
    message = str(failed.value)
    assert "checkpoint step 2 not saved: checkpoint " in message and "writing failed: rank 1: " in message, message
    assert "(injected)" in message and len(message.splitlines()) == 1
    MPI.COMM_WORLD.Barrier()
    assert _files(d) == [".hpctrain.lock", "latest", "step_00000001.h5"]
    _readable(first)
