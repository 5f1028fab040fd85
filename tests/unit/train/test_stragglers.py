"""The straggler rule (``hpctrain/train/health.py``): a rank is named only
when its compute time exceeds both ``reliability.straggler_factor`` x the
other ranks' median and that median plus a floor
(``reliability.straggler_min_s``; by default max(10 ms, 5% of the step)), and
its compute time per step is the median over the check's window, so one
descheduled step does not make a straggler."""
from __future__ import annotations

import torch

from hpctrain.train.health import ForwardClock, Stragglers, slow_ranks


def test_millisecond_noise_is_not_a_straggler():
    """Noise on a small model: 0.005 s against the others' 0.002 s is 2.5x,
    but 3 ms is below the 10 ms floor."""
    floor = Stragglers(1.5).floor([0.05] * 4)
    assert floor == 0.010
    assert slow_ranks([0.005, 0.002, 0.002, 0.002], 1.5, floor) == set()


def test_a_rank_slower_by_the_factor_and_the_floor_is_one():
    assert slow_ranks([0.080, 0.020, 0.021, 0.019], 1.5, 0.010) == {0}


def test_the_default_floor_grows_with_the_step():
    """On 2 s steps the floor is 5% of the step: a rank 60 ms slower is 2x
    slower in its forwards yet costs the job 3%."""
    stragglers = Stragglers(1.5)
    floor = stragglers.floor([2.0, 2.0, 2.1, 2.0])
    assert floor == 0.1
    assert slow_ranks([0.12, 0.06, 0.06, 0.06], 1.5, floor) == set()
    assert slow_ranks([0.22, 0.06, 0.06, 0.06], 1.5, floor) == {0}


def test_a_set_floor_is_used_as_given_and_zero_leaves_the_factor_alone():
    assert Stragglers(1.5, 0.5).floor([2.0]) == 0.5
    assert slow_ranks([0.005, 0.002, 0.002], 1.5, Stragglers(1.5, 0.0).floor([0.05])) == {0}


def test_the_window_takes_the_median_step_so_one_descheduled_step_is_ignored():
    layer = torch.nn.Linear(2, 2)
    clock = ForwardClock([layer])
    times = iter([0.0, 0.002, 0.0, 0.002, 0.0, 0.050, 0.0, 0.002])  # pre/post hook clock readings
    clock._now = lambda: next(times)
    for _ in range(4):
        layer(torch.zeros(1, 2))
        clock.take()
    assert clock.take_window() == 0.002
    assert clock.take_window() == 0.0  # a new window
