"""The node-local tier's faults in one process (issue 61, items 2 and 3):

- a damaged local file (a flipped byte, a truncated file) is found by its
  checksum before anything is restored; the resume then takes the next
  usable state (here, with one node, an older local step; else the
  persistent checkpoint; else step 0), says which in one line, and the
  losses after it are bit-identical to an uninterrupted run's;
- a full node-local disk (a real tmpfs, mounted here) fails the local save:
  no temporary file is left, one line says so, and training goes on with
  the persistent tier, or stops after a save attempt (exit status 6) when none is configured; the failure
  is reported at the step boundary after it (hpctrain.train.save_failures).

The partner copies of another node are exercised at 2 ranks in
tests/mpi/test_local_tier_faults.py.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from hpctrain.config import compose_resolved
from hpctrain.plugins import create_manager
from hpctrain.run import reference_trainer
from hpctrain.train.checkpointing import LocalSaveFailed

BASE = ("trainer.log_every=1", "trainer.progress=off", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.seq_len=32", "model.d_model=32", "model.n_layers=1", "reliability.straggler_every=0",
        "reliability.weight_check_every=0", "checkpoint.local.replicas=0")


def _losses(history):
    return [m["loss"] for m in history]


def _run(pm, steps, *extra):
    return reference_trainer(compose_resolved(BASE + (f"trainer.steps={steps}",) + extra, pm), pm).fit()


@pytest.fixture(scope="module")
def whole():
    """The uninterrupted run's six losses."""
    pm = create_manager()
    return _losses(_run(pm, 6))


def _local(tmp: Path, every: int = 2):
    return (f"checkpoint.local.dir={tmp / 'local'}", f"checkpoint.local.every={every}",
            f"checkpoint.dir={tmp / 'ck'}", "checkpoint.resume=auto")


def _rank0_file(tmp: Path, step: int) -> Path:
    (found,) = (tmp / "local").glob(f"*/step_{step:08d}/rank_00000.bin")  # the node directory is the host's name
    return found


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_newest_local_step_falls_back_to_an_older_one_bit_identically(pm, tmp_path, whole, caplog, damage):
    first = _run(pm, 4, *_local(tmp_path))
    assert _losses(first) == whole[:4]
    newest = _rank0_file(tmp_path, 4)
    if damage == "flip":
        _flip(newest)
    else:
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    with caplog.at_level(logging.INFO):
        rest = _run(pm, 6, *_local(tmp_path))
    lines = [r.getMessage() for r in caplog.records if "damaged copy" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    why = "checksum mismatch" if damage == "flip" else "checksum mismatch"
    assert f"rank 0's state of step 4 on node 0: {why}" in lines[0] and "using the local tier's step 2" in lines[0]
    assert "resumed from the local tier" in caplog.text and "at step 2" in caplog.text
    assert [m["step"] for m in rest] == [3, 4, 5, 6]
    assert _losses(rest) == whole[2:]  # bit for bit


def test_every_local_step_damaged_and_no_persistent_checkpoint_starts_afresh(pm, tmp_path, whole, caplog):
    _run(pm, 4, *_local(tmp_path))
    for step in (2, 4):
        _flip(_rank0_file(tmp_path, step))
    with caplog.at_level(logging.INFO):
        again = _run(pm, 6, *_local(tmp_path))
    lines = [r.getMessage() for r in caplog.records if "damaged copy" in r.getMessage()]
    assert len(lines) == 2 and "using the local tier's step 2" in lines[0], caplog.text
    assert "no other copy or step to use: starting from step 0" in lines[1]
    assert _losses(again) == whole


def test_a_damaged_local_step_falls_back_to_the_persistent_checkpoint(pm, tmp_path, whole, caplog):
    _run(pm, 4, *_local(tmp_path, every=4), "checkpoint.every=2")  # persistent at 2 and 4, local at 4
    _flip(_rank0_file(tmp_path, 4))
    for h5 in (tmp_path / "ck").glob("*4.h5"):
        h5.unlink()  # the persistent tier's newest is step 2
    with caplog.at_level(logging.INFO):
        rest = _run(pm, 6, *_local(tmp_path, every=4), "checkpoint.every=2")
    assert "using the persistent checkpoint (step 2)" in caplog.text, caplog.text
    assert _losses(rest) == whole[2:]


@pytest.fixture
def full_disk(tmp_path):
    """A 32 KiB tmpfs: too small for one local save of the test model (as root, as in CI)."""
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root (CI and the project's machines run as root)")
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _on_full_disk(full_disk: Path, tmp_path: Path, every_persistent: int):
    return (f"checkpoint.local.dir={full_disk}", "checkpoint.local.every=2", f"checkpoint.dir={tmp_path / 'ck'}",
            f"checkpoint.every={every_persistent}")


def test_a_full_local_disk_is_reported_and_training_goes_on_with_the_persistent_tier(pm, tmp_path, full_disk,
                                                                                      whole, caplog):
    with caplog.at_level(logging.INFO):
        history = _run(pm, 6, *_on_full_disk(full_disk, tmp_path, 3))
    assert _losses(history) == whole
    failed = [r.getMessage() for r in caplog.records if "local checkpoint save failed" in r.getMessage()]
    assert len(failed) == 3, caplog.text  # the saves at steps 2, 4 and 6: each reported once
    said = [r.getMessage().strip() for r in caplog.records]
    step3 = next(i for i, s in enumerate(said) if re.match(r"step +3/6", s))
    assert said.index(failed[0]) < step3, said  # step 2's failure at step 2's boundary, before step 3 runs
    assert "rank(s) 0 (node 0): OSError: No space left on device" in failed[0]
    assert "training goes on with the persistent checkpoints (checkpoint.every=3)" in failed[0]
    assert not [p for p in full_disk.rglob("*") if p.name.endswith(".tmp")]
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.h5")) == ["step_00000003.h5", "step_00000006.h5"]


def test_a_full_local_disk_without_a_persistent_tier_stops_with_status_6(pm, tmp_path, full_disk):
    """Reported at step 2's boundary; the run then saves step 2 to the persistent tier (a save attempt) and
    stops, its message naming the checkpoint."""
    with pytest.raises(LocalSaveFailed) as stopped:
        _run(pm, 6, *_on_full_disk(full_disk, tmp_path, 0))
    assert stopped.value.exit_code == 6
    assert "no persistent checkpoint is configured to fall back on (checkpoint.every=0)" in str(stopped.value)
    assert str(stopped.value).endswith(f"stopping after a save attempt; give checkpoint.local.dir a disk with room, "
                                       f"or set checkpoint.every: checkpoint {tmp_path / 'ck'}/step_00000002.h5 "
                                       "committed; relaunch with checkpoint.resume=auto to go on"), stopped.value
    assert [p.name for p in (tmp_path / "ck").glob("*.h5")] == ["step_00000002.h5"]
    assert not [p for p in full_disk.rglob("*") if p.name.endswith(".tmp")]
