"""Pipelines whose stages cost different amounts (``parallel.pipeline.layers``
uneven, the head on the last stage): the simulator against schedules
computed by hand, and ``stage_bubble_time`` (the slowest stage sets the
pace) against the simulator."""
from __future__ import annotations

import pytest

from hpctrain.model.shapes import ModelShape
from hpctrain.pipeline.bubble import bubble_time, stage_bubble_time
from hpctrain.pipeline.schedules import actions
from hpctrain.pipeline.simulate import simulate
from hpctrain.pipeline.split import auto_counts, model_end_cost, rank_layers


def _spans(tl, rank):
    return [(f"{a.kind}{a.microbatch}", start, end) for a, start, end in tl.spans[rank]]


def _costs(blocks, split_w=False):
    """Per virtual stage: a block's forward takes 1, its backward 2 (B 1 + W 1 when split)."""
    return {s: ({"F": n, "B": n, "W": n} if split_w else {"F": n, "B": 2 * n}) for s, n in enumerate(blocks)}


def test_1f1b_two_stages_by_hand():
    """1F1B, p 2, m 2, blocks [1, 2]. By hand (rank 0 warms up with one
    forward): rank 0 F0 0-1, F1 1-2, then waits for rank 1's backward: B0
    7-9, B1 13-15; rank 1 F0 1-3, B0 3-7, F1 7-9, B1 9-13. 15 = m x 6 (the
    slow stage, busy throughout) + 3 (the other stage's f + b)."""
    tl = simulate(actions("1f1b", 2, 1, 2), 2, 1, per_stage=_costs([1, 2]))
    assert _spans(tl, 0) == [("F0", 0, 1), ("F1", 1, 2), ("B0", 7, 9), ("B1", 13, 15)]
    assert _spans(tl, 1) == [("F0", 1, 3), ("B0", 3, 7), ("F1", 7, 9), ("B1", 9, 13)]
    assert tl.makespan == 15
    assert 2 * 6 + stage_bubble_time("1f1b", 1, [1, 2], [2, 4], [1, 2]) == 15


def test_1f1b_slow_middle_stage_by_hand():
    """1F1B, p 3, m 3, blocks [1, 2, 1]. By hand:
    rank 0: F0 0-1, F1 1-2, F2 2-3, B0 10-12, B1 16-18, B2 20-22;
    rank 1: F0 1-3, F1 3-5, B0 6-10 (waits 1 for rank 2's), F2 10-12, B1 12-16, B2 16-20;
    rank 2: F0 3-4, B0 4-6, F1 6-7, B1 7-9, F2 12-13, B2 13-15.
    22 = m x 6 + 4; the formula charges every other stage's f + b (6), an
    over-estimate of 2 here: the stage after the slow one waits less than a
    whole stage time."""
    tl = simulate(actions("1f1b", 3, 1, 3), 3, 1, per_stage=_costs([1, 2, 1]))
    assert _spans(tl, 0) == [("F0", 0, 1), ("F1", 1, 2), ("F2", 2, 3), ("B0", 10, 12), ("B1", 16, 18),
                             ("B2", 20, 22)]
    assert _spans(tl, 1) == [("F0", 1, 3), ("F1", 3, 5), ("B0", 6, 10), ("F2", 10, 12), ("B1", 12, 16),
                             ("B2", 16, 20)]
    assert _spans(tl, 2) == [("F0", 3, 4), ("B0", 4, 6), ("F1", 6, 7), ("B1", 7, 9), ("F2", 12, 13),
                             ("B2", 13, 15)]
    assert tl.makespan == 22
    assert 3 * 6 + stage_bubble_time("1f1b", 1, [1, 2, 1], [2, 4, 2], [1, 2, 1]) == 24


def test_equal_stages_reduce_to_the_published_bubbles():
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1)):
        for p in (2, 4, 8):
            uneven = stage_bubble_time(schedule, v, [1.5] * p, [3.0] * p, [1.5] * p)
            assert uneven == pytest.approx(bubble_time(schedule, p, v, 1.5, 3.0, 1.5))


LLAMA3 = {  # (blocks, shape): the stages' costs come from auto's split, the head on the last stage
    "405b": (126, ModelShape(128256, 16384, 126, 128, 8, 53248, False)),
    "70b": (80, ModelShape(128256, 8192, 80, 64, 8, 28672, False)),
    "8b": (32, ModelShape(128256, 4096, 32, 32, 8, 14336, False)),
}


@pytest.mark.parametrize("model,p,m", [("405b", 16, 32), ("70b", 4, 32), ("70b", 8, 16), ("8b", 4, 16)])
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 4)])
def test_formula_against_the_simulator_on_auto_splits(model, p, m, schedule, v):
    """For the Llama 3 shapes split by ``auto`` (head 0.6-1.8 blocks on the last
    stage), m x the slowest rank + ``stage_bubble_time`` is the simulated step
    or at most 3% more."""
    n, shape = LLAMA3[model]
    assert p * v <= n
    head = shape.vocab_size * shape.d_model / shape.block_params  # (a parameter share stands in for its FLOPs)
    counts = auto_counts(n, p * v, model_end_cost(shape))
    cost = [c + (head if s == p * v - 1 else 0.0) for s, c in enumerate(counts)]
    split_w = schedule == "zb-h1"
    tl = simulate(actions(schedule, p, v, m), p, v, per_stage=_costs(cost, split_w))
    f = [sum(cost[r::p]) for r in range(p)]
    b, w = [2 * x for x in f], f
    predicted = m * max(x + y for x, y in zip(f, b)) + stage_bubble_time(schedule, v, f, b, w)
    assert tl.makespan <= predicted + 1e-9 <= 1.03 * tl.makespan
    assert rank_layers(counts, p) == [sum(counts[r::p]) for r in range(p)]
