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
