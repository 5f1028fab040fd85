"""A logger backend that cannot start is one ``hpctrain: error:`` line before
step 1 on a real 2-rank job (rank 0 opens the loggers; every rank stops with
status 2), not a crash later; a backend nothing provides is refused by validation."""
import pytest

from test_launchers import MPIEXEC, _metrics
from test_messages import _errors, _launch

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def test_an_unwritable_tensorboard_directory_stops_every_rank_before_step_1(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("a file where the event directory goes")
    code, out = _launch(["logging.backends=[jsonl,tensorboard]", "trainer.steps=2"], run)
    assert code == 2, out
    (line,) = _errors(out)
    assert line.startswith("logging.backends: the 'tensorboard' logger could not start: "), out
    assert line.endswith("fix it or remove tensorboard from logging.backends"), out
    assert "Traceback" not in out and "step 1/2" not in out, out
    assert _metrics(run) == []  # opened (jsonl comes first), closed, never written


def test_a_backend_no_plugin_provides_is_refused(tmp_path):
    code, out = _launch(["logging.backends=[jsonl,neptune]"], tmp_path)
    assert code == 2 and _errors(out) == ["logging.backends: 'neptune' is not provided by any installed plugin; "
                                          "choose from jsonl, mlflow, tensorboard, wandb, or install the logger "
                                          "plugin that provides it"], out


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
