import io
import sys

from hpctrain.train import metrics
from hpctrain.train.metrics import Progress, format_step, interactive_launch


def test_interactive_launch_rules(monkeypatch):
    """Where no launcher process can be seen (tests/launch/test_launchers.py runs real ones)."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a tty
    monkeypatch.setattr(metrics, "launcher_stderr_is_terminal", lambda: None)
    for var in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "CI", "SLURM_JOB_ID", "SLURM_PTY_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert not interactive_launch()                     # a pipe, no launcher: a log file
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert interactive_launch()                         # mpirun from a terminal
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert not interactive_launch()                     # sbatch job
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("CI", "true")
    assert not interactive_launch()


def test_forced_progress_draws_and_closes(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    bar = Progress(True, 4, "on")
    m = {"loss": 1.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0}
    bar.update(4, m)
    bar.close()
    assert "4/4" in buf.getvalue() and "loss 1.5000" in buf.getvalue()
    assert Progress(False, 4, "on")._bar is None and Progress(True, 4, "off")._bar is None
    assert format_step(3, 40, m).startswith("step  3/40 | loss 1.5000")
