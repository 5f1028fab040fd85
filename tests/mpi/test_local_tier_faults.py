"""The node-local tier's damaged copies at 2 ranks on 2 emulated nodes, each
holding its partner's copy (issue 61, item 2): a flipped byte in rank 0's own
file of the newest step is found by its checksum before anything is
restored, every rank agrees, and the resume takes the partner node's copy of
the same step, says so in one line, and continues bit-identically; with both
copies damaged it takes the older step. The failed save of a full disk is
agreed over the ranks too (the save runs in a background thread here).

The nodes are emulated by handing the checkpointing a runtime whose ranks
sit on nodes 0 and 1 (as ``HPCTRAIN_RANKS_PER_NODE=1`` does at launch); the
files, the partner exchange (MPI point-to-point) and the agreement are real.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain.bootstrap import get_runtime
from hpctrain.train import checkpointing

pytestmark = pytest.mark.mpi(min_size=2)

RUN = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.progress=off",
       "trainer.log_every=1", "model.d_model=32", "model.n_layers=1", "parallel.dp=2",
       "reliability.straggler_every=0", "reliability.weight_check_every=0")


@pytest.fixture
def two_nodes(monkeypatch):
    """Ranks 0 and 1 on nodes 0 and 1 (a job of 2 ranks: the others sit this test out)."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        pytest.skip("written for 2 ranks (same at every size)")
    rt = get_runtime()
    rank = comm.Get_rank()
    emulated = dataclasses.replace(rt, rank_nodes=(0, 1), node_rank=rank, num_nodes=2, local_rank=0, local_size=1,
                                   emulated_nodes=True)
    monkeypatch.setattr(checkpointing, "get_runtime", lambda: emulated)
    path = comm.bcast(tempfile.mkdtemp(prefix="hpctrain-local-faults-") if rank == 0 else None, root=0)
    yield Path(path)
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _train(steps: int, *extra: str):
    from hpctrain.bootstrap import with_device
    from hpctrain.config import compose_agreed
    from hpctrain.plugins import get_manager
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    pm = get_manager()
    cfg = compose_agreed((*RUN, f"trainer.steps={steps}", *extra), pm, MPI.COMM_WORLD)
    rt = with_device(cfg.trainer.device)
    configure_torch(cfg, rt)
    return [m["loss"] for m in Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device).fit()]


def _tier(where: Path, name: str):
    return (f"checkpoint.local.dir={where / name / 'local'}", "checkpoint.local.every=2", "checkpoint.local.replicas=1",
            f"checkpoint.dir={where / name / 'ck'}", "checkpoint.resume=auto")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_own_copy_is_replaced_by_the_partners_and_the_run_continues_bit_identically(two_nodes, caplog):
    comm = MPI.COMM_WORLD
    want = _train(6, *_tier(two_nodes, "whole"))
    first = _train(4, *_tier(two_nodes, "job"))
    assert first == want[:4]
    local = two_nodes / "job" / "local"
    own = local / "node_0" / "step_00000004" / "rank_00000.bin"
    partner = local / "node_1" / "step_00000004" / "rank_00000.bin"
    comm.Barrier()
    if comm.Get_rank() == 0:
        assert own.is_file() and partner.is_file()  # rank 1's node holds rank 0's copy
        _flip(own)
    comm.Barrier()
    with caplog.at_level(logging.INFO):
        rest = _train(6, *_tier(two_nodes, "job"))
    assert rest == want[4:]  # bit for bit, from the partner's copy of step 4
    if comm.Get_rank() == 0:
        lines = [r.getMessage() for r in caplog.records if "damaged copy" in r.getMessage()]
        assert len(lines) == 1 and "rank 0's state of step 4 on node 0: checksum mismatch" in lines[0], caplog.text
        assert "using the partner node's copy" in lines[0]
        assert "resumed from the local tier" in caplog.text and "at step 4" in caplog.text


def test_both_copies_damaged_take_the_older_step(two_nodes, caplog):
    comm = MPI.COMM_WORLD
    want = _train(6, *_tier(two_nodes, "whole"))
    _train(4, *_tier(two_nodes, "job"))
    comm.Barrier()
    if comm.Get_rank() == 0:
        for node in ("node_0", "node_1"):
            _flip(two_nodes / "job" / "local" / node / "step_00000004" / "rank_00000.bin")
    comm.Barrier()
    with caplog.at_level(logging.INFO):
        rest = _train(6, *_tier(two_nodes, "job"))
    assert rest == want[2:]
    if comm.Get_rank() == 0:
        lines = [r.getMessage() for r in caplog.records if "damaged copy" in r.getMessage()]
        assert len(lines) == 2, caplog.text
        assert "using the partner node's copy" in lines[0] and "using the local tier's step 2" in lines[1]


def test_a_full_disk_on_one_node_is_agreed_and_training_goes_on(two_nodes, caplog):
    """Node 1's local directory is a 32 KiB tmpfs (rank 1's save fails in its background thread); node 0's has
    room. Every rank hears of it at the next step boundary (the stop agreement carries the flag), and the
    run continues on the persistent tier."""
    comm = MPI.COMM_WORLD
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root (CI and the project's machines run as root)")
    want = _train(4, *_tier(two_nodes, "whole"))
    base = two_nodes / "job" / "local"
    small = base / "node_1"
    if comm.Get_rank() == 1:
        small.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(small)], check=True)
    comm.Barrier()
    try:
        with caplog.at_level(logging.INFO):
            got = _train(4, *_tier(two_nodes, "job"), "checkpoint.every=2")
        assert got == want
        failed = [r.getMessage() for r in caplog.records if "local checkpoint save failed" in r.getMessage()]
        if comm.Get_rank() == 0:
            assert len(failed) == 2 and "rank(s) 1 (node 1): OSError: No space left on device" in failed[0], caplog.text
        if comm.Get_rank() == 1:
            assert not [p for p in small.rglob("*") if p.name.endswith(".tmp")]
    finally:
        comm.Barrier()
        if comm.Get_rank() == 1:
            subprocess.run(["umount", "-l", str(small)], check=False)



def test_a_background_save_failing_on_one_rank_is_agreed_at_the_boundary_by_debug_fault(two_nodes, caplog):
    """debug.fault=save_error on rank 1: its part of step 2's background persistent save fails; both ranks
    agree at a later step boundary, one line names rank 1, and the run goes on (the local tier, saving every
    step, holds a complete step) and commits step 4."""
    import re

    where = two_nodes / "persistent"
    with caplog.at_level(logging.INFO):
        losses = _train(4, f"checkpoint.local.dir={where / 'local'}", "checkpoint.local.every=1",
                        "checkpoint.local.replicas=1", f"checkpoint.dir={where / 'ck'}", "checkpoint.every=2",
                        "checkpoint.async_save=true", "debug.fault=save_error", "debug.fault_rank=1",
                        "debug.fault_step=2")
    assert len(losses) == 4
    if MPI.COMM_WORLD.Get_rank() == 0:
        lines = [r.getMessage() for r in caplog.records if "background checkpoint save failed" in r.getMessage()]
        assert len(lines) == 1, caplog.text
        assert re.fullmatch(r"a background checkpoint save failed: checkpoint step 2 not saved: copying to host "
                            r"memory failed: rank 1: OSError: \[Errno 5\] debug.fault=save_error: injected I/O error; "
                            r"training goes on: the local tier holds step \d on every rank "
                            r"\(checkpoint.local.every=1\) and the next persistent save tries again",
                            lines[0]), lines[0]
        assert sorted(p.name for p in (where / "ck").glob("*.h5")) == ["step_00000004.h5"]


def test_a_local_save_failing_on_one_rank_stops_both_after_a_save_attempt_by_debug_fault(two_nodes):
    """debug.fault=local_save_error on rank 1 without checkpoint.every: the failed local save of step 2 stops
    both ranks after a persistent save attempt (exit status 6), the checkpoint named."""
    import re

    from hpctrain.train.checkpointing import LocalSaveFailed

    where = two_nodes / "local"
    with pytest.raises(LocalSaveFailed) as stopped:
        _train(6, f"checkpoint.local.dir={where / 'local'}", "checkpoint.local.every=2", "checkpoint.local.replicas=1",
               f"checkpoint.dir={where / 'ck'}", "debug.fault=local_save_error", "debug.fault_rank=1",
               "debug.fault_step=2")
    message = str(stopped.value)
    m = re.search(r"a local checkpoint save failed on rank\(s\) 1 \(node 1\): OSError: debug.fault=local_save_error: "
                  r"injected I/O error .*stopping after a save attempt.*: checkpoint (\S+) committed", message)
    assert m and os.path.isfile(m.group(1)), message
