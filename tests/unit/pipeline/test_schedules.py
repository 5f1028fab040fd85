"""Every pipeline schedule, for every small (p, v, m), played on paper
(``hpctrain.pipeline.simulate``): well-formed programs, no deadlock, bounded
activations, and the bubble of theory, exactly, with unit action times
(F = B = W = 1; without a separate W pass a backward takes B + W = 2)."""
from __future__ import annotations

import pytest

from hpctrain.pipeline.bubble import bubble_time, in_flight
from hpctrain.pipeline.schedules import Action, actions, check, compute_order, forward_actions
from hpctrain.pipeline.simulate import ScheduleError, check_programs, simulate

SMALL = [(p, m) for p in (2, 3, 4) for m in range(1, 13)]


def _run(schedule, p, v, m):
    programs = actions(schedule, p, v, m)
    check_programs(programs, p, v, m)
    return simulate(programs, p, v)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p,m", SMALL)
def test_plain_schedules(schedule, p, m):
    tl = _run(schedule, p, 1, m)
    ideal = m * 3  # F + B + W per micro-batch
    # the planner's formulas, in the same units (t_f = 1, t_b = B + W = 2, t_w = 1)
    want = bubble_time(schedule, p, 1, 1.0, 2.0, 1.0) / ideal
    for r in range(p):
        if schedule == "zb-h1" and m < p:
            # too few micro-batches to fill the cool-down with W's: the
            # critical path F..F B..B W (2p + 1) exceeds theory; still under 1F1B's
            assert want < tl.bubble(r) < bubble_time("1f1b", p, 1, 1.0, 2.0, 1.0) / ideal, r
        else:
            assert tl.bubble(r) == pytest.approx(want), r
    for r in range(p):
        held = tl.peak_held[r]
        if schedule == "gpipe":
            assert held == m
        elif schedule == "1f1b":
            assert held == min(p - r, m) == in_flight("1f1b", p, 1, m, r)
        else:  # zb-h1: never more than 1F1B's first stage holds
            assert held <= min(p, m)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved(p, v, groups):
    m = groups * p
    tl = _run("interleaved", p, v, m)
    want = bubble_time("interleaved", p, v, 1.0, 2.0, 1.0) / (m * 3)
    assert all(tl.bubble(r) == pytest.approx(want) for r in range(p))
    # activations, in micro-batches through all of a rank's layers: the planner's bound for the first stage
    assert tl.peak_held[0] / v <= in_flight("interleaved", p, v, m, 0) + 1e-9


def test_zero_bubble_is_a_third_of_1f1b():
    assert _run("zb-h1", 4, 1, 8).bubble(0) == pytest.approx(_run("1f1b", 4, 1, 8).bubble(0) / 3)


def test_1f1b_order_and_messages():
    """p 2, m 3, rank 0: one warm-up forward, then forward/backward pairs."""
    assert [str(a) for a in actions("1f1b", 2, 1, 3)[0]] == [
        "F0", "SEND_F0->1", "F1", "SEND_F1->1", "RECV_B0<-1", "B0", "F2", "SEND_F2->1", "RECV_B1<-1", "B1",
        "RECV_B2<-1", "B2"]
    assert [str(a) for a in actions("1f1b", 2, 1, 3)[1]] == [
        "RECV_F0<-0", "F0", "B0", "SEND_B0->0", "RECV_F1<-0", "F1", "B1", "SEND_B1->0", "RECV_F2<-0", "F2", "B2",
        "SEND_B2->0"]


def test_interleaved_crosses_between_chunks():
    """p 2, v 2: stage 1 (rank 1, chunk 0) sends to stage 2 (rank 0, chunk 1)."""
    prog = actions("interleaved", 2, 2, 2)
    assert Action("SEND_F", 0, 0, 0) in prog[1] and Action("RECV_F", 0, 1, 1) in prog[0]
    assert compute_order("interleaved", 2, 2, 2, 0)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]


def test_simulator_catches_deadlock_and_malformed_programs():
    programs = actions("1f1b", 2, 1, 2)
    swapped = {0: programs[0], 1: programs[1][4:] + programs[1][:4]}  # rank 1 starts with micro-batch 1
    check_programs(swapped, 2, 1, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(programs | {0: [a for a in programs[0] if a.kind != "F" or a.microbatch != 0] +
                             [Action("F", 0)]}, 2, 1)
    with pytest.raises(ScheduleError, match="one F/B"):
        check_programs({0: programs[0][:-1], 1: programs[1]}, 2, 1, 2)
    with pytest.raises(ScheduleError, match="pair up"):
        check_programs({0: [a for a in programs[0] if a.kind != "SEND_F"], 1: programs[1]}, 2, 1, 2)


@pytest.mark.parametrize("args,message", [
    (("interleaved", 4, 2, 6), "multiple of parallel.pp"),
    (("interleaved", 4, 1, 8), "vpp=1 goes with schedule=interleaved"),
    (("1f1b", 4, 2, 8), "vpp=2 goes with schedule=interleaved"),
    (("pipedream", 4, 1, 8), "is not one of gpipe, 1f1b, interleaved, zb-h1"),
])
def test_check_names_the_problem(args, message):
    assert message in check(*args)
    with pytest.raises(ValueError, match=message.split("=")[0]):
        compute_order(*args, 0)


@pytest.mark.parametrize("p,v,m", [(p, 1, m) for p, m in SMALL] + [(p, v, g * p) for p in (2, 3, 4) for v in (2, 3)
                                                                    for g in (1, 2, 3)])
def test_forward_only_programs(p, v, m):
    """Validation's programs: one F per micro-batch and chunk, paired
    transfers, no deadlock, and the pipeline fill of theory: m forwards plus
    (p - 1) / v of a micro-batch's forward through the other stages."""
    programs = forward_actions(p, v, m)
    check_programs(programs, p, v, m, forward_only=True)
    assert all(a.kind in ("F", "RECV_F", "SEND_F") for prog in programs.values() for a in prog)
    assert simulate(programs, p, v).makespan == pytest.approx(m + (p - 1) / v)
    with pytest.raises(ScheduleError, match="not one F per micro-batch"):
        check_programs(actions("1f1b", p, 1, m) if v == 1 else actions("interleaved", p, v, m), p, v, m,
                       forward_only=True)
