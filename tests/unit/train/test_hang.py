"""The hang watchdog's rules (hpctrain.train.hang) on hand-made heartbeats."""
from hpctrain.train.hang import RankState, diagnose

T = 10.0  # reliability.hang_timeout_s
NOW = 1000.0
DP = (0, 1, 2, 3)


def _rank(r, issued, waiting=None, waited=0.0, heard=NOW, step=5, **kw):
    w = None if waiting is None else (*waiting, waited)
    return RankState(r, host="n1", pid=100 + r, step=step, phase="training", issued=issued, waiting=w, heard=heard,
                     last_op=("all_reduce", "dp", issued.get("dp")) if issued.get("dp") else None, **kw)


def _job(*ranks):
    return {s.rank: s for s in ranks}


def test_short_waits_are_not_a_hang():
    states = _job(*(_rank(r, {"dp": 7}, ("all_reduce", "dp", 7, DP), waited=T - 1) for r in (0, 1, 3)),
                  _rank(2, {"dp": 6}))
    assert diagnose(states, NOW, T) is None


def test_the_rank_that_never_entered_the_collective_is_blamed_with_its_waiters():
    states = _job(*(_rank(r, {"dp": 7}, ("all_reduce", "dp", 7, DP), waited=T + 1) for r in (0, 1, 3)),
                  _rank(2, {"dp": 6}))
    v = diagnose(states, NOW, T)
    assert v.stuck == [2]
    assert "rank 2 (host n1, pid 102) stopped making progress in step 5 (training), in no collective" in v.message
    assert "its last op: all_reduce #6 on dp" in v.message
    assert "rank(s) 0, 1, 3 wait for it (11 s) in all_reduce #7 on dp" in v.message


def test_the_age_of_a_heartbeat_adds_to_the_wait_it_reports():
    states = _job(_rank(0, {"dp": 7}, ("all_reduce", "dp", 7, (0, 1)), waited=T - 3, heard=NOW - 4),
                  _rank(1, {"dp": 6}))
    assert diagnose(states, NOW, T).stuck == [1]


def test_a_silent_rank_is_named_at_once_with_the_ranks_waiting_for_it():
    states = _job(_rank(0, {"dp": 7}, ("all_reduce", "dp", 7, DP), waited=2.0),
                  _rank(1, {"dp": 6}, heard=NOW - T - 1), _rank(2, {"dp": 7}), _rank(3, {"dp": 7}))
    v = diagnose(states, NOW, T)
    assert v.stuck == [1] and "stopped responding: no heartbeat for 11 s" in v.message
    assert "rank(s) 0 wait for it" in v.message


def test_a_dead_rank_is_named_without_waiting_for_the_timeout():
    states = _job(_rank(0, {"dp": 3}), _rank(1, {"dp": 3}, gone="died"))
    v = diagnose(states, NOW, T)
    assert v.stuck == [1] and "rank 1 (host n1, pid 101) died in step 5" in v.message


def test_a_dead_rank_whose_last_heartbeat_is_old_is_not_placed_in_an_earlier_step():
    states = _job(_rank(0, {"dp": 3}), _rank(1, {"dp": 3}, gone="died"))
    states[0].step, states[1].step = 6, 1  # rank 0 is in step 6; rank 1's last beat came in step 1
    v = diagnose(states, NOW, T)
    assert "rank 1 (host n1, pid 101) died in step >= 5 (the job was in step 6)" in v.message, v.message


def test_ranks_that_said_goodbye_are_not_dead():
    states = _job(_rank(0, {"dp": 3}), _rank(1, {"dp": 3}, gone="done", heard=NOW - 100))
    assert diagnose(states, NOW, T) is None


def test_a_pipeline_chain_of_receives_blames_its_end():
    """Stage 3 waits on 2, 2 on 1 (both point-to-point), 1 computes for ever."""
    states = _job(_rank(0, {}, ("recv", "pp", None, (1,)), waited=T + 5),
                  _rank(1, {}),
                  _rank(2, {}, ("recv", "pp", None, (1,)), waited=T + 2),
                  _rank(3, {}, ("recv", "pp", None, (2,)), waited=T + 1))
    v = diagnose(states, NOW, T)
    assert v.stuck == [1]
    assert "rank(s) 0, 2, 3 wait for it" in v.message and "recv on pp" in v.message


def test_ranks_waiting_for_each_other_are_a_deadlock():
    states = _job(_rank(0, {}, ("recv", "pp", None, (1,)), waited=T + 1),
                  _rank(1, {}, ("recv", "pp", None, (0,)), waited=T + 1))
    v = diagnose(states, NOW, T)
    assert v.stuck == [0, 1] and "deadlock" in v.message


def test_everyone_inside_the_same_collective_too_long_is_a_stuck_transport():
    states = _job(*(_rank(r, {"checkpoint": 2}, ("checkpoint save", "checkpoint", 2, DP), waited=T + 1) for r in DP))
    v = diagnose(states, NOW, T)
    assert v.stuck == list(DP) and "inside checkpoint save #2 on checkpoint" in v.message
    assert "every member of the group in it" in v.message


def test_a_rank_ahead_in_another_group_is_not_blamed():
    """Ranks 0 and 1 wait in tp collective #4; rank 1 has issued it, rank 0
    too; only their dp peer 2 (behind on dp) is what 3 waits for."""
    states = _job(_rank(0, {"tp": 4, "dp": 2}, ("all_reduce", "tp", 4, (0, 1)), waited=1.0),
                  _rank(1, {"tp": 4, "dp": 2}, ("all_reduce", "tp", 4, (0, 1)), waited=1.0),
                  _rank(2, {"tp": 3, "dp": 1}),
                  _rank(3, {"tp": 3, "dp": 2}, ("all_reduce", "dp", 2, (1, 3, 2)), waited=T + 1))
    v = diagnose(states, NOW, T)
    assert v.stuck == [2] and "rank(s) 3 wait for it" in v.message
