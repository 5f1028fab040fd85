"""trainer.profile writes a torch profiler trace that loads as Chrome-trace
JSON with the chosen steps, and only those, as named ranges; consecutive
steps share a trace."""
from __future__ import annotations

import json

from hpctrain.run import reference_trainer
from hpctrain.train.profile import step_runs


def test_consecutive_steps_share_a_trace():
    assert step_runs([8, 3, 4, 4]) == [(3, 4), (8, 8)]


def _step_names(path):
    trace = json.load(open(path))
    return sorted({e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("step ")})


def test_profile_steps_write_chrome_traces_with_the_named_steps(make_config, pm, tmp_path):
    cfg = make_config("trainer.steps=4", "trainer.profile.steps=[2,3]", "trainer.profile.memory=true",
                      "trainer.progress=off", "trainer.log_every=10")
    reference_trainer(cfg, pm, str(tmp_path)).fit()
    traces = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert traces == ["rank0.steps2-3.json"]
    assert _step_names(tmp_path / "profile" / "rank0.steps2-3.json") == ["step 2", "step 3"]
    trace = json.load(open(tmp_path / "profile" / "rank0.steps2-3.json"))
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"])  # profile.memory: allocations


def test_a_rank_not_chosen_writes_nothing(make_config, pm, tmp_path):
    cfg = make_config("trainer.steps=2", "trainer.profile.steps=[1]", "trainer.profile.ranks=[0]",
                      "trainer.progress=off")
    t = reference_trainer(cfg, pm, str(tmp_path))
    t.profiler.rank = 1
    t.profiler.runs = []  # what the constructor leaves on a rank not in trainer.profile.ranks
    t.fit()
    assert not (tmp_path / "profile").exists()
