"""A background (async) save that fails: the warning says what failed in words and the fix, not
HDF5's nesting of a raw MPI error string (``Unable to create file (MPI_File_open failed: MPI error
string is 'MPI_ERR_NO_SUCH_FILE: ...')``) with none; the error raised at the next wait is the same
line. In a training run the failure is reported at the next step boundary (hpctrain.train.save_failures): the
run goes on when the local tier holds a recent state, else stops after a save attempt. The file cannot be
created because its temporary path leads to a directory that is gone, as when checkpoint.dir is not on a file
system this rank sees. One rank (MPI's world of this process)."""
from __future__ import annotations

import logging
import os
import re
import time

import pytest

from hpctrain import hookimpl

from hpctrain_h5ckpt import writer
from hpctrain_h5ckpt.errors import CheckpointSaveFailed


def test_a_failed_async_save_says_what_failed_and_the_fix(tmp_path):
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import create_manager
    from hpctrain.run import reference_trainer

    pm = create_manager()
    d = str(tmp_path / "ck")
    t = reference_trainer(compose_resolved([
        "trainer.steps=4", "checkpoint.every=1", "checkpoint.keep=0", f"checkpoint.dir={d}",
        "checkpoint.async_save=true", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.seq_len=32", "trainer.progress=off"], pm), pm)
    t.train_step()
    t.save_checkpoint()
    t.checkpointer.wait()
    os.symlink(str(tmp_path / "gone" / "x"), os.path.join(d, "step_00000002.h5.tmp"))
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hpctrain").addHandler(handler)
    try:
        t.train_step()
        t.save_checkpoint()
        with pytest.raises(CheckpointSaveFailed) as failed:
            t.checkpointer.wait()
    finally:
        logging.getLogger("hpctrain").removeHandler(handler)
    message = str(failed.value)
    fix = "checkpoint.dir must be on a file system every rank sees"
    assert message.startswith("checkpoint step 2 not saved: ") and len(message.splitlines()) == 1, message
    assert "failed: rank 0: " in message and fix in message, message
    assert "MPI error string" not in message, message
    # an agreed failure is the trainer's to report, at the next step boundary (below): nothing said here
    assert not [s for s in said if "checkpoint step 2 not saved" in s], said


RUN = ["trainer.steps=6", "checkpoint.every=2", "checkpoint.keep=0", "checkpoint.async_save=true",
       "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.progress=off",
       "trainer.log_every=1"]


def _failing_run(tmp_path, *extra):
    """A run whose background save of step 2 fails (its temporary path leads nowhere, as above), the lines
    it logged and what ended it."""
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import create_manager
    from hpctrain.run import reference_trainer

    pm = create_manager()
    d = str(tmp_path / "ck")
    t = reference_trainer(compose_resolved(RUN + [f"checkpoint.dir={d}", *extra], pm), pm)
    os.symlink(str(tmp_path / "gone" / "x"), os.path.join(d, "step_00000002.h5.tmp"))  # (after the lock's sweep)

    class SaveDoneBeforeBoundary3:
        """Step 2's background write has ended (failed) by step 3's boundary, so the test knows which
        boundary reports it (a real run reports it at the first boundary after the failure)."""

        @hookimpl
        def hpctrain_on_step_end(self, state, step, metrics):
            while step == 3 and t.checkpointer.busy:
                time.sleep(0.01)

    pm.register(SaveDoneBeforeBoundary3())
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hpctrain").addHandler(handler)
    ended = None
    try:
        t.fit()
    except Exception as e:  # noqa: BLE001 - what ended the run is the test's subject
        ended = e
    finally:
        logging.getLogger("hpctrain").removeHandler(handler)
    return d, said, ended


def test_a_failed_background_save_without_another_tier_stops_after_a_save_attempt(tmp_path):
    """No local tier: the failure is reported at the next step boundary (step 3), then the run saves that
    step, waits for its commit and stops with exit status 6, the attempt's checkpoint named."""
    from hpctrain.train.save_failures import SaveFailedStop

    d, said, ended = _failing_run(tmp_path)
    assert isinstance(ended, SaveFailedStop) and ended.exit_code == 6, (ended, said)
    message = str(ended)
    m = re.fullmatch(r"a background checkpoint save failed: checkpoint step 2 not saved: "
                     r".*; no other checkpoint tier is configured \(checkpoint.local.every=0\): stopping after a save "
                     r"attempt: checkpoint (\S+/step_0000000(3).h5) committed; relaunch with checkpoint.resume=auto "
                     r"to go on", message)
    assert m, message
    assert os.path.isfile(m.group(1)) and len(message.splitlines()) == 1
    steps = [s for s in said if re.match(r"step +\d+/6", s.strip())]
    assert len(steps) == int(m.group(2)), said  # stopped at that boundary: no step after it


def test_a_failed_background_save_is_one_line_and_the_local_tier_carries_the_run(tmp_path):
    """With the local tier saving every step, the failure is reported once and training goes on to the end;
    the next persistent saves commit."""
    d, said, ended = _failing_run(tmp_path, "checkpoint.local.every=1", "checkpoint.local.replicas=0",
                                  f"checkpoint.local.dir={tmp_path / 'local'}")
    assert ended is None, ended
    lines = [s for s in said if "a background checkpoint save failed" in s]
    assert len(lines) == 1, said
    assert re.search(r"checkpoint step 2 not saved: .*; training goes on: the local tier holds step 3 on every "
                     r"rank \(checkpoint.local.every=1\) and the next persistent save tries again$", lines[0]), lines
    assert sorted(f for f in os.listdir(d) if f.endswith(".h5")) == ["step_00000004.h5", "step_00000006.h5"]


@pytest.mark.parametrize("raw,described", [
    (OSError("Unable to create file (MPI_File_open failed: MPI error string is 'MPI_ERR_NO_SUCH_FILE: no such file "
             "or directory')"),
     "Unable to create file: no such file or directory (MPI_File_open: MPI_ERR_NO_SUCH_FILE)"),
    (OSError("Can't write data (MPI_File_write_at_all failed: MPI error string is 'MPI_ERR_IO: input/output error')"),
     "Can't write data: input/output error (MPI_File_write_at_all: MPI_ERR_IO)"),
    (OSError(13, "Permission denied"), "PermissionError: [Errno 13] Permission denied"),
])
def test_each_failure_is_described_with_its_fix(raw, described):
    text = writer._describe(raw)
    assert text == described
    assert writer.fix_for(text)
