"""A token file cut under a real 2-rank ``mpiexec`` job while it reads it stops
every rank at the step that reads past the new end, with exit status 2, one
``hpctrain: error:`` line, no traceback, no SIGBUS (``hpctrain.data.tokenfile``).
(A file truncated or odd-sized before the start: tests/mpi/test_cli_data.py.)"""
import os
import re
import subprocess
import sys

import pytest

from hpctrain.data import DataCursor, SampleOrder
from hpctrain.data.embedded import generate_corpus
from hpctrain.data.prepare import prepare
from hpctrain.data.sources import token_file_source

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

SEED = 66  # the sample order the shrinking test's cut is computed for (its asserts say what it gives)
BATCH = ["trainer.global_batch_size=16", "trainer.micro_batch_size=4", "trainer.seq_len=64", f"data.seed={SEED}"]


def _prepared(tmp_path, num_bytes):
    src = tmp_path / "in.txt"
    src.write_bytes(generate_corpus(num_bytes, seed=7))
    out = tmp_path / "t.bin"
    prepare(str(src), str(out))
    return out


def _errors(out):
    return [line for line in out.splitlines() if line.startswith("hpctrain: error:")]


@pytest.mark.alone  # cuts the file while the job trains
def test_a_token_file_cut_under_a_running_job_stops_every_rank_at_that_step(tmp_path):
    """Rank 0's steps are slowed so the file can be cut during the run (after
    step 2). It is cut just past the last window rank 0 reads up to step
    ``FAIL``, so only rank 1 reads short, at ``FAIL``, a whole page past the
    new end (where a memory map raises SIGBUS): rank 0 learns of it through
    the step's all-reduce and writes the line; the failing step's update and
    metrics never happen."""
    steps, fail, page = 12, 5, 4096
    out = _prepared(tmp_path, 120000)
    order = SampleOrder(token_file_source(str(out)), 64, SEED)
    cursors = [DataCursor(order, 16, 4, r, 2) for r in range(2)]
    starts = {0: [], 1: []}  # per rank and step, the byte offsets of the windows it reads
    for _ in range(steps):
        for r, c in enumerate(cursors):
            starts[r].append([2 * order.window_start(i) for i in c.local_indices()])
            c.consumed_samples += 16
    window = 2 * 65
    cut = max(b + window for step in starts[0][:fail] for b in step)
    # what SEED gives: rank 1 reads nothing past the cut in steps 3 .. FAIL-1, then a page wholly past it
    assert all(b + window <= cut for step in starts[1][2:fail - 1] for b in step)
    assert any(b >= -(-cut // page) * page for b in starts[1][fail - 1])

    cmd = ["timeout", str(TIMEOUT), MPIEXEC, "-n", "2", sys.executable, "-m", "hpctrain", "data=tokens",
           f"data.path={out}", f"trainer.steps={steps}", *BATCH, "trainer.progress=off", "trainer.log_every=1",
           "debug.fault=slow", "debug.fault_rank=0", "debug.fault_step=1", "debug.slow_s=0.2",
           f"hydra.run.dir={tmp_path}/run"]
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if re.search(rf"step +2/{steps} ", line):
            os.truncate(out, cut)
    code = job.wait()
    text = "".join(lines)
    assert code == 2, (code, text)
    [line] = _errors(text)
    assert (f"data.path={out} changed under the running job: step {fail} reads past its end on 1 rank; "
            f"it held 240000 bytes (120000 uint16 tokens) when the job started and holds {cut} now") in line, line
    assert "resume from the last checkpoint" in line, line
    assert [m["step"] for m in _metrics(tmp_path / "run")] == list(range(1, fail))
    assert "Traceback" not in text and "Bus error" not in text and "SIGBUS" not in text
