"""Async and sync saves agree, saves are atomic and never lose older
checkpoints, corruption is detected and resume=auto falls back, keep-k,
collective and serial (no MPI h5py) paths write the same file. Any world size >= 2."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading

import h5py
import pytest
import torch
from mpi4py import MPI

from ckpt_helpers import assert_same_datasets, build_trainer
from hpctrain_h5ckpt import h5io, options, writer
from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.staging import Stager

pytestmark = pytest.mark.mpi(min_size=2)


def _ck(d: str, step: int) -> str:
    return os.path.join(d, f"step_{step:08d}.h5")


@contextlib.contextmanager
def warnings_logged():
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("hpctrain")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _train(d: str, *overrides: str):
    t = build_trainer(f"checkpoint.dir={d}", "checkpoint.keep=0", *overrides)
    t.fit()
    return t


def _meta(path: str) -> dict:
    with h5py.File(path, "r") as f:
        # (the provenance hashes the config, which names the save mode)
        return {k: v for k, v in f["meta"].attrs.items() if k not in ("created_unix", "provenance")}


def _on_rank0(fn) -> None:
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        fn()
    comm.Barrier()


@pytest.fixture(scope="module")
def baseline(module_dir):
    """A synchronous, independent-I/O MPI-IO run: checkpoints at steps 2 and 4."""
    d = f"{module_dir}/baseline"
    _train(d, "trainer.steps=4", "checkpoint.every=2")
    return d


def _copy(src: str, dst: str) -> str:
    _on_rank0(lambda: shutil.copytree(src, dst))
    return dst


@pytest.mark.parametrize("staging", ["overlap", "blocking"])
def test_async_save_writes_the_same_file_as_a_sync_save(baseline, shared_tmp, staging):
    d = f"{shared_tmp}/async-{staging}"
    asyn = _train(d, "trainer.steps=4", "checkpoint.every=2", "checkpoint.async_save=true",
                  f"checkpoint.hdf5.staging={staging}")
    assert [s.async_save for s in asyn.checkpointer.stats] == [True, True]
    assert all(s.committed and s.blocking_s >= 0 for s in asyn.checkpointer.stats)
    if MPI.COMM_WORLD.Get_rank() == 0:
        for step in (2, 4):
            assert_same_datasets(_ck(baseline, step), _ck(d, step))
            assert _meta(_ck(baseline, step)) == _meta(_ck(d, step))


def test_async_save_returns_before_the_write_and_training_goes_on(shared_tmp, monkeypatch):
    release, real = threading.Event(), writer.write_file

    def held_write(*args, **kwargs):
        assert release.wait(120), "the test never released the write"
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_file", held_write)
    d = f"{shared_tmp}/held"
    t = build_trainer(f"checkpoint.dir={d}", "trainer.steps=3", "checkpoint.every=1", "checkpoint.async_save=true")
    t.train_step()
    path = t.save_checkpoint()
    assert t.checkpointer._bg.busy and not os.path.exists(path)   # save() returned; nothing committed yet
    t.train_step()                                                # a collective step while the write waits
    assert not os.path.exists(path)
    release.set()
    t.checkpointer.wait()
    assert os.path.exists(path) and t.checkpointer.stats[-1].committed


def _hold_staging(monkeypatch) -> threading.Event:
    """Make every overlapped host copy wait for the returned event."""
    release, real = threading.Event(), Stager.copy

    def held_copy(self):
        assert release.wait(120), "the test never released the copy"
        return real(self)

    monkeypatch.setattr(Stager, "copy", held_copy)
    return release


def _async_saved_at_step_2(d: str):
    """A trainer two steps in whose async save of step 2 is still copying (held by ``_hold_staging``)."""
    t = build_trainer(f"checkpoint.dir={d}", "checkpoint.keep=0", "checkpoint.every=100", "trainer.steps=4",
                      "checkpoint.async_save=true")
    t.train_step()
    t.train_step()
    t.save_checkpoint()
    return t


def test_overlapped_copy_runs_during_the_next_step_and_the_optimizer_waits_for_it(baseline, shared_tmp, monkeypatch):
    release = _hold_staging(monkeypatch)
    d = f"{shared_tmp}/overlap"
    t = _async_saved_at_step_2(d)
    seen = {}
    bg = t.checkpointer._bg
    run, step, wait_staged = t.step_runner.run, t.optimizer.step, bg.wait_staged

    def forward_backward(*args, **kwargs):
        seen["copying during forward/backward"] = bg.staging
        return run(*args, **kwargs)

    def waiting_before_update():
        threading.Timer(0.2, release.set).start()  # the copy finishes while the trainer waits
        return wait_staged()

    def optimizer_step(*args, **kwargs):
        seen.setdefault("copying at the optimizer step", bg.staging)
        release.set()  # (if the trainer did not wait, fail at the assert below instead of hanging)
        return step(*args, **kwargs)

    t.step_runner.run, t.optimizer.step, bg.wait_staged = forward_backward, optimizer_step, waiting_before_update
    t.train_step()
    t.checkpointer.wait()
    stats = t.checkpointer.stats[-1]
    assert seen == {"copying during forward/backward": True, "copying at the optimizer step": False}
    assert stats.committed and stats.staging_wait_s >= 0.15 and stats.blocking_s >= stats.staging_wait_s
    if MPI.COMM_WORLD.Get_rank() == 0:  # the file holds step 2, not the state the next update made
        assert_same_datasets(_ck(baseline, 2), _ck(d, 2))


def test_the_optimizer_step_waits_for_the_copy_even_in_a_loop_without_before_update(baseline, shared_tmp,
                                                                                     monkeypatch):
    release = _hold_staging(monkeypatch)
    d = f"{shared_tmp}/own-loop"
    t = _async_saved_at_step_2(d)
    bg, seen = t.checkpointer._bg, []
    t.optimizer.register_step_pre_hook(lambda *_: seen.append(bg.staging))  # runs after the checkpointer's hook
    threading.Timer(0.2, release.set).start()
    t.optimizer.step()  # a custom loop's update, straight after the save
    t.checkpointer.wait()
    assert seen == [False] and t.checkpointer.stats[-1].staging_wait_s >= 0.15
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_same_datasets(_ck(baseline, 2), _ck(d, 2))


def test_an_in_place_write_before_the_copy_fails_the_save_on_every_rank(shared_tmp, monkeypatch):
    release = _hold_staging(monkeypatch)
    d = f"{shared_tmp}/raced"
    t = build_trainer(f"checkpoint.dir={d}", "trainer.steps=4", "checkpoint.every=1", "checkpoint.async_save=true")
    t.train_step()
    path = t.save_checkpoint()
    if MPI.COMM_WORLD.Get_rank() == 0:
        with torch.no_grad():  # e.g. a plugin rescaling weights in place without before_update()
            for p in t.model.parameters():  # all: each rank writes only the replicated ones it owns
                p.mul_(0.5)
    release.set()
    with pytest.raises(CheckpointError, match="copying to host memory failed") as err:
        t.checkpointer.wait()
    assert "rank 0: CheckpointError" in str(err.value) and "before_update" in str(err.value)
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")
    t.train_step()  # training and the next save go on
    t.save_checkpoint()
    t.checkpointer.wait()
    assert t.checkpointer.stats[-1].committed


def test_corrupt_newest_checkpoint_is_named_and_auto_falls_back(baseline, shared_tmp):
    d = _copy(baseline, f"{shared_tmp}/flip")
    bad = _ck(d, 4)

    def flip():
        with h5py.File(bad, "r") as f:
            off = f["/model/norm.weight"].id.get_offset() + 5
        with open(bad, "r+b") as f:
            f.seek(off)
            byte = f.read(1)[0]
            f.seek(off)
            f.write(bytes([byte ^ 0x40]))

    _on_rank0(flip)
    with pytest.raises(CheckpointError, match="checksum mismatch") as err:
        build_trainer(f"checkpoint.dir={d}", f"checkpoint.resume={bad}", "trainer.steps=6")
    assert bad in str(err.value) and "/model/norm.weight" in str(err.value)
    with warnings_logged() as logged:
        t = build_trainer(f"checkpoint.dir={d}", "checkpoint.resume=auto", "trainer.steps=6")
    assert t.step == 2 and t.cursor.consumed_samples == 16
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert any(bad in r.getMessage() and "skipping" in r.getMessage() for r in logged)


def test_truncated_newest_checkpoint_is_named_and_auto_falls_back(baseline, shared_tmp):
    d = _copy(baseline, f"{shared_tmp}/trunc")
    bad = _ck(d, 4)
    _on_rank0(lambda: os.truncate(bad, os.path.getsize(bad) // 3))
    with pytest.raises(CheckpointError, match="truncated") as err:
        build_trainer(f"checkpoint.dir={d}", f"checkpoint.resume={bad}", "trainer.steps=6")
    assert bad in str(err.value)
    assert build_trainer(f"checkpoint.dir={d}", "checkpoint.resume=auto", "trainer.steps=6").step == 2
    assert build_trainer(f"checkpoint.resume={d}", "trainer.steps=6").step == 2  # a directory falls back too


def test_a_failed_save_loses_nothing(baseline, shared_tmp, monkeypatch):
    d = _copy(baseline, f"{shared_tmp}/fail")
    t = build_trainer(f"checkpoint.dir={d}", "checkpoint.resume=auto", "trainer.steps=6", "checkpoint.every=1")
    before = sorted(os.listdir(d))

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(h5io, "write_box", disk_full)
    t.train_step()
    with pytest.raises(CheckpointError, match="simulated"):
        t.save_checkpoint()
    assert sorted(os.listdir(d)) == before  # no step 5, no .tmp left behind, nothing pruned
    monkeypatch.undo()
    with CheckpointReader(_ck(d, 4), MPI.COMM_WORLD, options.resolve(options.H5Config())) as r:
        r.read({})  # still complete and verified


def test_keep_last_k(shared_tmp):
    d = f"{shared_tmp}/keep"
    build_trainer(f"checkpoint.dir={d}", "checkpoint.keep=2", "trainer.steps=3", "checkpoint.every=1").fit()
    assert sorted(os.listdir(d)) == [".hpctrain.lock", "latest", "step_00000002.h5", "step_00000003.h5"]
    assert open(os.path.join(d, "latest")).read().strip() == "step_00000003.h5"


def test_collective_io_for_every_dataset_writes_the_same_file(baseline, shared_tmp):
    """The tiny model's tensors are below the collective threshold; force
    collective MPI-IO (with empty selections on ranks that own nothing)."""
    _train(f"{shared_tmp}/coll", "trainer.steps=2", "checkpoint.every=2", "checkpoint.hdf5.collective_min_mb=0")
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_same_datasets(_ck(baseline, 2), _ck(f"{shared_tmp}/coll", 2))
    t = build_trainer(f"checkpoint.dir={baseline}", f"checkpoint.resume={_ck(baseline, 2)}", "trainer.steps=4",
                      "checkpoint.hdf5.collective_min_mb=0")
    assert t.step == 2


def test_serial_fallback_without_mpi_h5py(baseline, shared_tmp, monkeypatch):
    monkeypatch.setattr(options, "h5py_has_mpi", lambda: False)  # as with PyPI's serial h5py
    monkeypatch.setitem(options._warned, "serial", False)
    with warnings_logged() as logged:
        t = _train(f"{shared_tmp}/serial", "trainer.steps=2", "checkpoint.every=2")
        options.resolve(options.H5Config(), MPI.COMM_WORLD.Get_rank())  # a second resolve does not warn again
    assert t.checkpointer.opts.parallel is False
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert sum("no MPI support" in r.getMessage() for r in logged) == 1
        assert_same_datasets(_ck(baseline, 2), _ck(f"{shared_tmp}/serial", 2))
    monkeypatch.undo()
    resumed = build_trainer(f"checkpoint.dir={shared_tmp}/serial", "checkpoint.resume=auto", "trainer.steps=4",
                            "checkpoint.hdf5.driver=serial")
    assert resumed.step == 2 and resumed.checkpointer.opts.parallel is False


HINTS = {"cb_nodes": "2", "cb_buffer_size": "1048576", "romio_cb_write": "enable", "striping_factor": "4",
         "striping_unit": "1048576"}


def test_file_system_hints_reach_every_files_access_property_list(baseline, shared_tmp, monkeypatch):
    """checkpoint.hdf5.{alignment, meta_block_size, sieve_buf_size, mpiio_hints} are read back from the
    access property list of every file a save and a resume open (h5py's low-level get_alignment,
    get_meta_block_size, get_sieve_buf_size, get_fapl_mpio), the tensors are the baseline's, and
    checkpoint.lustre runs lfs setstripe on the directory once, on rank 0 (a stand-in lfs records it)."""
    seen = []
    real_open = h5io.open_file

    def spy(path, mode, comm=None, access=None):
        f = real_open(path, mode, comm, access or h5io.FileAccess())
        fapl = f.id.get_access_plist()
        hints = {}
        if comm is not None:
            dup, info = fapl.get_fapl_mpio()
            hints = {k: info.Get(k) for k in HINTS}
            dup.Free()
            info.Free()
        seen.append((mode, fapl.get_alignment(), fapl.get_meta_block_size(), fapl.get_sieve_buf_size(), hints))
        return f

    monkeypatch.setattr(h5io, "open_file", spy)
    lfs_log = f"{shared_tmp}/lfs-args"
    bin_dir = f"{shared_tmp}/bin"
    _on_rank0(lambda: (os.makedirs(bin_dir), open(f"{bin_dir}/lfs", "w").write(f'#!/bin/sh\necho "$@" >> {lfs_log}\n'),
                       os.chmod(f"{bin_dir}/lfs", 0o755)))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    d = f"{shared_tmp}/hinted"
    settings = ["checkpoint.hdf5.alignment=4096", "checkpoint.hdf5.meta_block_size=65536",
                "checkpoint.hdf5.sieve_buf_size=262144", *(f"+checkpoint.hdf5.mpiio_hints.{k}={v}"
                                                             for k, v in HINTS.items())]
    _train(d, "trainer.steps=2", "checkpoint.every=2", "checkpoint.lustre.stripe_count=4",
           "checkpoint.lustre.stripe_size=1M", *settings)
    resumed = build_trainer(f"checkpoint.dir={d}", "checkpoint.resume=auto", "trainer.steps=4", *settings)
    assert resumed.step == 2
    parallel = resumed.checkpointer.opts.parallel
    assert [s[0] for s in seen] == ["w", "r"]
    for mode, alignment, meta_block, sieve, hints in seen:
        assert (alignment, meta_block, sieve) == ((4096, 4096) if mode == "w" else (1, 1), 65536, 262144)
        assert hints == (HINTS if parallel else {})
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_same_datasets(_ck(baseline, 2), _ck(d, 2))
        assert open(lfs_log).read().splitlines() == [f"setstripe -c 4 -S 1M {d}"]
