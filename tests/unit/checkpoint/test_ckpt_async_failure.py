"""A background (async) save that fails: the warning says what failed in words and the fix, not
HDF5's nesting of a raw MPI error string (``Unable to create file (MPI_File_open failed: MPI error
string is 'MPI_ERR_NO_SUCH_FILE: ...')``) with none; the error raised at the next wait is the same
line. The file cannot be created because its temporary path leads to a directory that is gone, as
when checkpoint.dir is not on a file system this rank sees. One rank (MPI's world of this process)."""
from __future__ import annotations

import logging
import os

import pytest

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
    [warning] = [s for s in said if "checkpoint step 2 not saved" in s]
    assert warning.startswith(message) and "the run stops with this error (exit status 6)" in warning, warning


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
