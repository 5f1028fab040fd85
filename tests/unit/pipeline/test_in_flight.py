"""``bubble.in_flight``, the planner's micro-batches held per stage, is what the schedule the pipeline
plugin runs holds: for every rank of every small interleaved (p, v, m), the most chunks the simulator
(``hpctrain.pipeline.simulate``, which plays ``schedules.actions``) finds held at once, over v, and
Megatron-LM's warm-up count, 2(p - r - 1) + (v - 1)p forwards plus the first steady one. Korthikanti et
al.'s p (1 + (p - 1)/(p v)) is the first stage's; the last stage holds ((v - 1)p + 1)/v, not ~1."""
from __future__ import annotations

import pytest

from hpctrain.pipeline.bubble import in_flight, peak_held
from hpctrain.pipeline.schedules import actions
from hpctrain.pipeline.simulate import simulate


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_in_flight_is_the_schedules(p, v, groups):
    m = groups * p
    tl = simulate(actions("interleaved", p, v, m), p, v)
    for r in range(p):
        chunks = min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
        assert in_flight("interleaved", p, v, m, r) * v == pytest.approx(tl.peak_held[r]) == chunks, r
    if 2 * (p - 1) + (v - 1) * p < m * v:  # Korthikanti's first stage, when the warm-up is not cut short by m
        assert in_flight("interleaved", p, v, m, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_llama3_405b_last_stage_and_weighted_chunks():
    assert in_flight("interleaved", 16, 2, 32, 15) == 8.5  # (v-1)p warm-up forwards of chunk 0, then chunk 1
    # the last stage's second chunk (the loss) is held once at a time: 16 x chunk 0 + 1 x chunk 1
    assert peak_held("interleaved", 16, 2, 32, 15, (1.0, 10.0)) == 16 * 1.0 + 10.0
