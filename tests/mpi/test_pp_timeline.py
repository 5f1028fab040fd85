"""The pipeline timeline files: after training, rank 0 writes
``pipeline_timeline.json`` (Chrome trace) and ``pipeline_timeline.png``; the
trace holds every action of every pipeline rank's program exactly once, in
the schedule's order, and its times obey the pipeline's dependencies across
ranks (a stage's forward of a micro-batch starts after the previous stage's
ended; backwards the other way), which only holds if the ranks' times were
gathered and aligned correctly."""
from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import pytest

from hpctrain.pipeline.schedules import COMPUTE, actions, stage_of

from hpctrain_pp.timeline import JSON_NAME, PNG_NAME, measured_actions
from parity import world_trainer

BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "trainer.steps=2", "model.n_layers=4")
PP2 = {
    "1f1b": ("parallel.pipeline.schedule=1f1b",),
    "zb-h1": ("parallel.pipeline.schedule=zb-h1",),
    "interleaved": ("parallel.pipeline.schedule=interleaved", "parallel.pipeline.vpp=2"),
}
CLOCK_SLACK_US = 50.0
"""Ranks of this test share one node's clock; the slack covers the
microsecond rounding of the trace and the recorder's own two clock reads."""


def _spans(trace, pid):
    out = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == pid:
            out.setdefault(e["tid"], []).append(e)
    return out


def _check_trace(trace, schedule, p, v, m):
    programs = actions(schedule, p, v, m)
    measured = _spans(trace, 0)
    assert sorted(measured) == list(range(p))
    for r in range(p):
        assert list(measured_actions(trace, r)) == [str(a) for a in programs[r]]
        events = sorted(measured[r], key=lambda e: e["ts"])
        assert all(e["dur"] >= 0 for e in events)
        for a, b in zip(events, events[1:]):  # one rank runs one action at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0
    # dependencies across ranks: F(mb, s) ends before F(mb, s+1) starts; B(mb, s+1) before B(mb, s)
    ends, starts = {}, {}
    for r, events in measured.items():
        for e in events:
            if e["cat"] in ("F", "B"):
                key = (e["cat"], e["args"]["microbatch"], stage_of(r, e["args"]["chunk"], p))
                starts[key], ends[key] = e["ts"], e["ts"] + e["dur"]
    last = p * v - 1
    for (kind, mb, s), start in starts.items():
        before = (kind, mb, s - 1) if kind == "F" else (kind, mb, s + 1)
        if 0 <= before[2] <= last:
            assert ends[before] <= start + CLOCK_SLACK_US, (kind, mb, s)
    theory = _spans(trace, 1)
    for r in range(p):
        got = Counter(e["name"] for e in theory[r])
        assert got == Counter(str(a) for a in programs[r] if a.kind in COMPUTE)
    data = trace["otherData"]
    assert (data["schedule"], data["pp"], data["vpp"], data["microbatches"]) == (schedule, p, v, m)
    assert 0.0 <= data["measured_bubble"] < 10.0


def _train_and_check(world, pm, pp, *extra):
    trainer = world_trainer(pm, *BASE, f"parallel.pp={pp}", *extra)
    run_dir = world.bcast(tempfile.mkdtemp(prefix="pptl-") if world.Get_rank() == 0 else None)
    trainer.run_dir = run_dir
    trainer.fit()  # the pipeline handle's after_training writes the files
    failure = None
    if world.Get_rank() == 0:
        try:
            with open(os.path.join(run_dir, JSON_NAME)) as f:
                trace = json.load(f)
            data = trace["otherData"]
            _check_trace(trace, data["schedule"], pp, data["vpp"], trainer.cursor.num_microbatches)
            with open(os.path.join(run_dir, PNG_NAME), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
        except AssertionError as e:  # every rank fails with rank 0 (no rank left waiting)
            failure = f"rank 0: {e!r}"
    failure = world.bcast(failure)
    assert failure is None, failure


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", PP2)
def test_timeline_files_pp2(world, pm, schedule):
    _train_and_check(world, pm, 2, *PP2[schedule])


@pytest.mark.mpi(min_size=4)
def test_timeline_files_pp4(world, pm):
    _train_and_check(world, pm, 4, "parallel.pipeline.schedule=gpipe")
