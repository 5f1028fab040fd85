"""Per-axis links in a calibration file (``<axis>_busbw_gbs``, ``<axis>_latency_us``, what hpctrain-tune
measures) change the ranking; the planner offers only layouts the pipeline plugin accepts."""
import json

import pytest

from hpctrain.errors import ConfigError
from hpctrain.planner.cluster import load_calibration
from hpctrain.planner.plan import make_plan

TINY = ["model=tiny", "cluster=cpu-8", "trainer.global_batch_size=8", "trainer.seq_len=64",
        "trainer.precision=fp32", "parallel.zero.stage=0", "model.recompute=none"]


def _plan(tmp_path, pm, calibration=None):
    path = None
    if calibration is not None:
        path = tmp_path / "cal.json"
        path.write_text(json.dumps(calibration))
    return make_plan(TINY, str(path) if path else None, pm)[0]


def test_per_axis_keys_are_read_and_checked(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dp_latency_us": 5e4, "tp_busbw_gbs": 1.5}))
    assert load_calibration(str(path)) == {"dp_latency_us": 5e4, "tp_busbw_gbs": 1.5}
    path.write_text(json.dumps({"xp_latency_us": 1}))
    with pytest.raises(ConfigError, match="unknown key.*xp_latency_us"):
        load_calibration(str(path))
    path.write_text(json.dumps({"dp_latency_us": -1}))
    with pytest.raises(ConfigError, match="dp_latency_us=-1 must be a positive number"):
        load_calibration(str(path))


def test_a_slow_measured_axis_moves_layouts_without_it_first(tmp_path, pm):
    plain = _plan(tmp_path, pm)
    assert plain.best.layout.dp > 1  # datasheet numbers: data parallelism is the cheap axis here
    slow_dp = _plan(tmp_path, pm, {"dp_latency_us": 50_000, "dp_busbw_gbs": 2})
    dps = [e.layout.dp for e in slow_dp.ranked]
    first_dp = dps.index(next(d for d in dps if d > 1))
    assert first_dp > 0 and all(d == 1 for d in dps[:first_dp]) and all(d > 1 for d in dps[first_dp:])
    # the link is what times the axis: the same numbers as the intra level leave every prediction unchanged
    same = _plan(tmp_path, pm, {a + k: v for a in ("tp", "dp", "pp")
                                for k, v in (("_busbw_gbs", 2), ("_latency_us", 2))})
    assert [e.time.total for e in same.ranked] == pytest.approx([e.time.total for e in plain.ranked], rel=1e-12)


def test_no_layout_with_fewer_micro_batches_than_stages(tmp_path, pm):
    from hpctrain.config.validate import validate
    from hpctrain.planner.plan import compose_config
    from hpctrain.planner.report import train_overrides

    plan, _, work, cluster, _, user = make_plan(TINY[:-2], None, pm)  # every ZeRO stage and recompute mode
    pipelined = [e for e in plan.ranked if e.layout.pp > 1]
    assert pipelined
    for e in pipelined:
        lay = e.layout
        assert 8 // (lay.dp * lay.ep * lay.micro_batch) >= lay.pp, lay
    for e in pipelined[:3] + plan.ranked[:3]:  # and the training validator agrees
        assert validate(compose_config(train_overrides(user, e.layout, work.precision), pm), cluster.gpus, pm) == []
