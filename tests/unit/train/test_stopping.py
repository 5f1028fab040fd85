"""Stopping on a signal or the clock (hpctrain.train.stopping), in one
process: a real signal sent to this process mid-run ends it after that step
with a committed checkpoint, and a resumed run finishes with the same
per-step losses, bit for bit, as one that was never stopped. Multi-rank and
SLURM versions: tests/launch/test_stop_and_relaunch.py, tests/slurm."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from hpctrain import hookimpl
from hpctrain.config import compose_resolved
from hpctrain.run import reference_trainer
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
    again in the middle of the checkpoint save that follows (between the
    save's start and its write)."""

    def __init__(self, step: int, sig: int):
        self.step, self.sig = step, sig

    @hookimpl
    def hpctrain_on_step_end(self, trainer, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), self.sig)
            ckpt = trainer.checkpointer
            write = ckpt._write_and_commit

            def interrupted_write(*args, **kwargs):
                os.kill(os.getpid(), self.sig)
                return write(*args, **kwargs)

            ckpt._write_and_commit = interrupted_write


def _losses(history):
    return [m["loss"] for m in history]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_is_exact(pm, tmp_path, sig):
    whole = reference_trainer(compose_resolved(RUN, pm), pm).fit()
    ckpt = tmp_path / "ckpt"
    cfg = compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "checkpoint.resume=auto"), pm)
    plugin = SignalAt(3, sig)
    pm.register(plugin)
    try:
        trainer = reference_trainer(cfg, pm)
        with pytest.raises(StopRequested) as stopped:
            trainer.fit()
    finally:
        pm.unregister(plugin)
    assert stopped.value.exit_code == EXIT_CODE
    assert f"step 3: stopped on {signal.Signals(sig).name}" in str(stopped.value)
    assert sorted(p.name for p in ckpt.glob("*.h5")) == ["step_00000003.h5"]
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)  # handlers put back
    first = trainer.history
    rest = reference_trainer(cfg, pm).fit()
    assert [m["step"] for m in first + rest] == list(range(1, 7))
    assert _losses(first + rest) == _losses(whole)  # bit for bit


def test_without_checkpointing_sigint_is_still_a_keyboard_interrupt(pm):
    plugin = SignalAt(2, signal.SIGINT)
    pm.register(plugin)
    try:
        with pytest.raises(KeyboardInterrupt):
            reference_trainer(compose_resolved(RUN, pm), pm).fit()
    finally:
        pm.unregister(plugin)


def test_the_clock_stops_the_run_before_max_time(pm, tmp_path):
    """A margin as large as max_time: the first step already leaves too little time."""
    ckpt = tmp_path / "ckpt"
    cfg = compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "checkpoint.every=100", "trainer.max_time=00:01:00",
                                  "trainer.max_time_margin_s=60"), pm)
    trainer = reference_trainer(cfg, pm)
    with pytest.raises(StopRequested) as stopped:
        trainer.fit()
    assert "step 1: stopped on trainer.max_time=00:01:00" in str(stopped.value)
    assert [p.name for p in ckpt.glob("*.h5")] == ["step_00000001.h5"]


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
    _fake_squeue(tmp_path, monkeypatch, f"echo x >> {calls}; echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1\n")
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
