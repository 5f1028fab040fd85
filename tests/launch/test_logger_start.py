"""Out of memory on one rank of a real 2-rank job: its error line names the
rank, the step and the snapshot. (A rank's unexpected exception aborts the
MPI job, so this needs a job of its own; the logger-start and unknown-backend
cases run in the 2-rank session: tests/mpi/test_cli_messages.py.)"""
import pytest

from test_launchers import MPIEXEC
from test_messages import _launch

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def test_out_of_memory_names_the_rank_the_step_and_the_snapshot(tmp_path):
    """debug.fault=oom raises CUDA's out-of-memory error in rank 1's step 2: its error
    line names the rank, the step and the snapshot (on this CPU-only torch: why there is none)."""
    code, out = _launch(["debug.fault=oom", "debug.fault_rank=1", "debug.fault_step=2", "trainer.steps=3"],
                        tmp_path)
    assert code != 0, out
    lines = [ln for ln in out.splitlines() if "CUDA out of memory in step 2" in ln]
    assert lines and lines[0].startswith("[rank 1] error: rank 1: CUDA out of memory in step 2: "), out
    import torch

    if torch.cuda.is_available():
        assert f"memory snapshot in {tmp_path}/oom_snapshot.rank1.pickle" in lines[0], out
    else:
        assert "; no memory snapshot (" in lines[0], out
    assert lines[0].endswith("set model.recompute=selective or full, or a higher parallel.zero.stage"), out
