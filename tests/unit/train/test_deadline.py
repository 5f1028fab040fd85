"""The wall-clock deadline (hpctrain.train.deadline): the decision as pure
functions, where the end comes from, and one run whose measured save makes it
stop before the clock alone would. The launcher version (a real stop under
mpiexec) is in tests/launch/test_stop_and_relaunch.py, the Slurm one (a
2-minute job stopping itself and requeued) in tests/slurm/test_deadline_requeue.py."""
from __future__ import annotations

import logging
import time

import pytest

from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.run import reference_trainer
from hpctrain.train.deadline import Clock, Decision, parse_end_time, stop_due
from hpctrain.train.stopping import StopRequested, StopRequests

RUN = ("trainer.steps=6", "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32",
       "trainer.progress=off", "trainer.log_every=100")


def test_stop_when_the_next_step_the_save_and_the_margin_do_not_fit():
    assert not stop_due(left_s=100, step_s=10, save_s=20, margin_s=60)  # 90 <= 100: one more step
    assert stop_due(left_s=89.9, step_s=10, save_s=20, margin_s=60)
    assert stop_due(left_s=65, step_s=1, save_s=5, margin_s=60)  # the save alone tips it
    assert not stop_due(left_s=65, step_s=1, save_s=0, margin_s=60)  # (before a save is measured)
    d = Decision(left_s=65, step_s=1, save_s=5, margin_s=60)
    assert d.stop and d.describe() == ("65.0 s left < next step 1.0 s + save 5.0 s (measured) + "
                                       "trainer.end_margin_s 60 s")
    assert "no save measured yet" in Decision(65, 1, 0, 60).describe()
    # a tiny model's save and step are milliseconds: still shown as measured, never as 0.0 s
    assert Decision(95.2, 0.0123, 0.0234, 95).describe() == (
        "95.2 s left < next step 0.0123 s + save 0.0234 s (measured) + trainer.end_margin_s 95 s")


def test_the_next_step_is_the_longest_recent_iteration_without_its_saves():
    clock = Clock(window=3)
    clock.boundary(100.0)
    assert clock.boundary(101.0) == 1.0
    assert clock.boundary(106.0, saving_s=4.5) == 1.0  # a 5 s iteration of which 4.5 s was the save
    assert clock.boundary(109.0) == 3.0
    clock.boundary(110.0), clock.boundary(111.0), clock.boundary(112.0)
    assert clock.step_s == 1.0  # the 3 s iteration left the window
    # the trainer's own step time counts when it is longer (the first boundary knows no iteration yet)
    assert Clock().decide(deadline=200.0, now=100.0, step_s=7.0, save_s=2.0, margin_s=60).step_s == 7.0


def test_end_times_in_the_forms_squeue_prints_and_unix_seconds():
    assert parse_end_time(None) is None and parse_end_time("") is None
    assert parse_end_time(1767225600) == 1767225600.0 and parse_end_time("1767225600") == 1767225600.0
    assert parse_end_time("2030-01-02T03:04:05") == time.mktime((2030, 1, 2, 3, 4, 5, 0, 0, -1))
    assert parse_end_time("2030-01-02 03:04") == time.mktime((2030, 1, 2, 3, 4, 0, 0, 0, -1))
    for bad in ("tomorrow", "2030-13-02T03:04:05", "2030-01-02T25:00"):
        with pytest.raises(ValueError):
            parse_end_time(bad)


def test_a_bad_end_time_is_one_problem_before_anything_runs(pm):
    """(The table of bad inputs has the row too, tests/unit/config/test_bad_inputs.py.)"""
    assert validate(compose_resolved(RUN + ("trainer.end_time=soon",), pm), 1, pm) == [
        "trainer.end_time='soon' is not a time: give YYYY-MM-DDTHH:MM[:SS] (local time, as squeue prints it) or "
        "Unix seconds"]
    assert validate(compose_resolved(RUN + ("trainer.end_time=2030-01-02T03:04:05",), pm), 1, pm) == []


def test_the_earliest_end_wins_and_squeue_is_not_asked_when_missing(pm, monkeypatch, tmp_path, caplog):
    """No Slurm end (a job on a Slurm without SLURM_JOB_END_TIME and without squeue on PATH: one warning),
    trainer.end_time in 300 s beats trainer.max_time=3600; rank 0 alone holds the clock."""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue here
    end = int(time.time()) + 300
    cfg = compose_resolved(RUN + ("trainer.max_time=3600", f"trainer.end_time={end}"), pm)
    with caplog.at_level(logging.WARNING):
        stops = StopRequests(cfg, is_main=True, catch_sigint=False)
    assert stops.deadline_from == f"trainer.end_time={end}"
    assert 290 < stops.deadline - time.monotonic() <= 300
    assert "no SLURM_JOB_END_TIME and no squeue on PATH" in caplog.text
    assert StopRequests(cfg, is_main=False, catch_sigint=False).deadline is None


def test_a_measured_save_stops_the_run_earlier_than_the_step_and_margin_alone(pm, tmp_path):
    """trainer.max_time=20 s, a margin of 15 s, a save every 2 steps that takes 3 s (slowed here). After
    step 1 (no save measured) 15 s plus a step fit; after step 2's save about 16.8 s are left, less than a
    step + 3 s + 15 s: the run stops there, its step-2 checkpoint committed. Counting the step and the
    margin alone it would go on to step 4."""
    ckpt = tmp_path / "ckpt"
    cfg = compose_resolved(RUN + (f"checkpoint.dir={ckpt}", "checkpoint.every=2", "trainer.max_time=20",
                                  "trainer.end_margin_s=15"), pm)
    trainer = reference_trainer(cfg, pm)
    persistent = trainer.checkpointing.persistent
    save = persistent.save

    def slow_save(*args, **kwargs):
        time.sleep(3.0)
        return save(*args, **kwargs)

    persistent.save = slow_save
    with pytest.raises(StopRequested) as stopped:
        trainer.fit()
    message = str(stopped.value)
    assert message.startswith("step 2: stopped on trainer.max_time=20 ("), message
    assert "save 3." in message and "(measured)" in message and "committed" in message, message
    assert [p.name for p in ckpt.glob("*.h5")] == ["step_00000002.h5"]
    assert 3.0 <= trainer.checkpointing.save_seconds() < 10
