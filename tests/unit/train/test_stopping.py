"""Stopping on a signal or the clock (hpctrain.train.stopping), in one
process: a real signal sent to this process mid-run ends it after that step
with a committed checkpoint, even with ``checkpoint.every=0`` (a stop always
saves), and a resumed run finishes with the same per-step losses, bit for
bit, as one that was never stopped. When a stop cannot save
(``checkpoint.save_on_stop=false``, no checkpoint format plugin), its
message says why and how to get a save. Multi-rank, launcher and SLURM
versions: tests/launch/test_stop_and_relaunch.py, tests/slurm."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from hpctrain import hookimpl
from hpctrain.config import compose_resolved
from hpctrain.run import reference_trainer
from hpctrain.train.checkpointing import Checkpointing
from hpctrain.train.stopping import EXIT_CODE, StopRequested, parse_duration

RUN = ("trainer.steps=6", "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32",
       "trainer.progress=off", "trainer.log_every=100")


def test_durations_in_seconds_and_slurm_forms():
    assert parse_duration(None) is None and parse_duration(90) == 90.0 and parse_duration("90") == 90.0
    assert parse_duration("02:30") == 150.0 and parse_duration("01:00:05") == 3605.0
    assert parse_duration("1-00:00:00") == 86400.0
    with pytest.raises(ValueError):
        parse_duration("soon")


class SignalAt:
    """A plugin that sends this process ``sig`` at the end of ``step``, and
    again as the checkpoint save that follows begins (``Checkpointing.save``
    wrapped until ``restore``)."""

    def __init__(self, step: int, sig: int):
        self.step, self.sig = step, sig
        self._saved_save = None

    @hookimpl
    def hpctrain_on_step_end(self, state, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), self.sig)
            save = self._saved_save = Checkpointing.save

            def interrupted_save(coordinator, *args, **kwargs):
                os.kill(os.getpid(), self.sig)
                return save(coordinator, *args, **kwargs)

            Checkpointing.save = interrupted_save

    def restore(self):
        if self._saved_save is not None:
            Checkpointing.save, self._saved_save = self._saved_save, None


def _losses(history):
    return [m["loss"] for m in history]


@pytest.fixture(scope="module")
def whole():
    """The per-step losses of the run never stopped (one run for the module)."""
    from hpctrain.plugins import create_manager

    pm = create_manager()
    return _losses(reference_trainer(compose_resolved(RUN, pm), pm).fit())


def _stopped_run(pm, cfg, plugin):
    """(the trainer, its StopRequested) for a run of ``cfg`` that ``plugin`` stops."""
    pm.register(plugin)
    try:
        trainer = reference_trainer(cfg, pm)
        with pytest.raises(StopRequested) as stopped:
            trainer.fit()
    finally:
        pm.unregister(plugin)
        plugin.restore()
    return trainer, stopped.value


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_is_exact(pm, tmp_path, sig, whole):
    """No checkpoint.every and no resume: the checkpointer is made for the stop alone."""
    ckpt = tmp_path / "ckpt"
    cfg = compose_resolved(RUN + (f"checkpoint.dir={ckpt}",), pm)
    assert cfg.checkpoint.every == 0 and cfg.checkpoint.save_on_stop
    trainer, stopped = _stopped_run(pm, cfg, SignalAt(3, sig))
    assert stopped.exit_code == EXIT_CODE
    assert f"step 3: stopped on {signal.Signals(sig).name}" in str(stopped)
    assert f"checkpoint {ckpt / 'step_00000003.h5'} committed" in str(stopped)
    assert sorted(p.name for p in ckpt.glob("*.h5")) == ["step_00000003.h5"]
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)  # handlers put back
    first = trainer.history
    rest = reference_trainer(compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"), pm),
                             pm).fit()
    assert [m["step"] for m in first + rest] == list(range(1, 7))
    assert _losses(first + rest) == whole  # bit for bit


def test_save_on_stop_false_saves_nothing_and_says_so(pm, tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "checkpoint.save_on_stop=false"), pm)
    _, stopped = _stopped_run(pm, cfg, SignalAt(2, signal.SIGTERM))
    assert stopped.exit_code == EXIT_CODE
    assert str(stopped) == ("step 2: stopped on SIGTERM; no checkpoint saved: checkpoint.save_on_stop=false; "
                            "leave it true (the default) to save when a run is stopped")
    assert not ckpt.exists()


def test_without_a_checkpoint_format_plugin_the_stop_says_what_to_install(tmp_path, monkeypatch):
    from hpctrain.plugins import DISABLE_ENV, create_manager

    monkeypatch.setenv(DISABLE_ENV, "h5ckpt")
    pm = create_manager()
    ckpt = tmp_path / "ckpt"
    _, stopped = _stopped_run(pm, compose_resolved(RUN + (f"checkpoint.dir={ckpt}",), pm), SignalAt(2, signal.SIGUSR1))
    assert ("step 2: stopped on SIGUSR1; no checkpoint saved: no installed plugin provides "
            "checkpoint.format='hdf5' (available: none); install one") in str(stopped)
    assert f"blocked by {DISABLE_ENV}: h5ckpt" in str(stopped)
    assert not ckpt.exists()


@pytest.mark.parametrize("off", ["checkpoint.save_on_stop=false", None])
def test_when_a_stop_cannot_save_sigint_is_still_a_keyboard_interrupt(pm, tmp_path, off):
    """Waiting for the step would save nothing: Ctrl-C interrupts at once
    (None: a programmatic run with no checkpoint.dir)."""
    extra = (f"checkpoint.dir={tmp_path}", off) if off else ()
    plugin = SignalAt(2, signal.SIGINT)
    pm.register(plugin)
    try:
        with pytest.raises(KeyboardInterrupt):
            reference_trainer(compose_resolved(RUN + extra, pm), pm).fit()
    finally:
        pm.unregister(plugin)
        plugin.restore()


def test_the_clock_stops_the_run_before_max_time_with_a_checkpoint_and_the_resume_is_exact(pm, tmp_path, whole):
    """A margin as large as max_time: the first step already leaves too
    little time. No checkpoint.every: the stop saves all the same."""
    ckpt = tmp_path / "ckpt"
    cfg = compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "trainer.max_time=00:01:00",
                                  "trainer.end_margin_s=60"), pm)
    trainer = reference_trainer(cfg, pm)
    with pytest.raises(StopRequested) as stopped:
        trainer.fit()
    assert "step 1: stopped on trainer.max_time=00:01:00" in str(stopped.value) and "committed" in str(stopped.value)
    assert [p.name for p in ckpt.glob("*.h5")] == ["step_00000001.h5"]
    rest = reference_trainer(compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"), pm),
                             pm).fit()
    assert _losses(trainer.history + rest) == whole  # bit for bit


def test_the_slurm_jobs_end_time_is_a_limit(pm, monkeypatch):
    """Slurm >= 23.02 exports the job's end; without it squeue is asked (tests/slurm)."""
    from hpctrain.train.stopping import StopRequests

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 600))
    stops = StopRequests(compose_resolved(RUN + ("trainer.max_time=3600",), pm), is_main=True, catch_sigint=False)
    assert stops.deadline_from == "the SLURM job's time limit"
    assert 590 < stops.deadline - time.monotonic() <= 600
    assert StopRequests(compose_resolved(RUN, pm), is_main=False, catch_sigint=False).deadline is None  # rank 0 decides


def _fake_squeue(tmp_path, monkeypatch, script: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\n" + script)
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)


def test_squeue_is_asked_again_when_the_controller_does_not_answer(tmp_path, monkeypatch):
    """Slurm < 23.02 (Debian 12's 22.05): the end time comes from squeue,
    which fails while the controller is busy; the second try answers."""
    from hpctrain.train.stopping import slurm_end_time

    calls = tmp_path / "calls"
    _fake_squeue(tmp_path, monkeypatch, f"""echo x >> {calls}
if [ $(wc -l < {calls}) -lt 2 ]; then echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1; fi
echo 2030-01-02T03:04:05
""")
    assert slurm_end_time(retry_wait_s=0) == time.mktime((2030, 1, 2, 3, 4, 5, 0, 0, -1))
    assert len(calls.read_text().splitlines()) == 2


def test_an_unreadable_end_time_is_warned_about(tmp_path, monkeypatch, caplog):
    from hpctrain.train.stopping import SQUEUE_TRIES, slurm_end_time

    calls = tmp_path / "calls"
    _fake_squeue(tmp_path, monkeypatch,
                 f"echo x >> {calls}; echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1\n")
    with caplog.at_level(logging.WARNING):
        assert slurm_end_time(retry_wait_s=0) is None
    assert "could not read SLURM job 42's end time from squeue (slurm_load_jobs error: Socket timed out)" in caplog.text
    assert "set trainer.max_time" in caplog.text
    assert len(calls.read_text().splitlines()) == SQUEUE_TRIES > 1


def test_a_job_without_a_time_limit_has_no_end(tmp_path, monkeypatch, caplog):
    from hpctrain.train.stopping import slurm_end_time

    _fake_squeue(tmp_path, monkeypatch, "echo NONE\n")
    with caplog.at_level(logging.WARNING):
        assert slurm_end_time(retry_wait_s=0) is None
    assert "could not read" not in caplog.text
