"""Dealing the local tier's data-parallel replicas out to another dp size
(``trainer.elastic``): which old rank's state each new rank loads, who
sends it, and what is refused."""
from hpctrain.localckpt.reshard import coords, deal, why_not
from hpctrain.localckpt.tier import Replica, decide

ORDER = "tp-cp-ep-dp-pp"


def _layout(world, **sizes):
    full = {a: 1 for a in ("tp", "cp", "ep", "pp")}
    full.update(sizes)
    full.setdefault("dp", world // (full["tp"] * full["cp"] * full["ep"] * full["pp"]))
    return {"world_size": world, "sizes": full, "order": ORDER}


def test_coordinates_follow_the_mesh_order():
    assert coords(5, _layout(8, tp=2)) == {"tp": 1, "cp": 0, "ep": 0, "dp": 2, "pp": 0}


def test_only_a_data_parallel_change_is_accepted():
    assert why_not(_layout(4), _layout(2)) is None
    assert why_not(_layout(4, tp=2), _layout(2)) == "tp(2) -> tp(1)"
    assert "order" in why_not(_layout(4), {**_layout(4), "order": "dp-tp-cp-ep-pp"})


def test_dp4_to_dp2_prefers_the_same_dp_index_on_the_own_node():
    held = {o: {0, 1} for o in range(4)}  # the surviving node holds every old rank's file
    sources, holders = deal(_layout(4), _layout(2), held)
    assert sources == {0: 0, 1: 1} and holders == {}
    # new rank 1's node lost old rank 1's file: it loads a replica its node holds
    held = {0: {0, 1}, 1: {0}, 2: {0, 1}, 3: {0}}
    assert deal(_layout(4), _layout(2), held) == ({0: 0, 1: 0}, {})
    # a node holding nothing: fetch the lowest held replica from its lowest holder
    held = {2: {0}, 3: {0}}
    assert deal(_layout(4), _layout(2), held) == ({0: 2, 1: 2}, {1: 0})


def test_other_coordinates_are_kept_under_tensor_parallelism():
    # tp 2 x dp 2 -> tp 2 x dp 1: new rank r needs an old rank with tp index r
    held = {o: {0, 1} for o in range(4)}
    assert deal(_layout(4, tp=2), _layout(2, tp=2), held)[0] == {0: 0, 1: 1}
    assert deal(_layout(4, tp=2), _layout(2, tp=2), {0: {0}, 2: {0}}) is None  # no tp-1 replica left


def test_decide_reshards_only_with_elastic_and_only_over_dp():
    about = {"old": {"family": "f", "layout": _layout(4)}, "tp": {"family": "f", "layout": _layout(4, tp=2)}}
    node = {6: {"old": [0, 1, 2, 3]}}
    found = decide([node, node], "new", 2, Replica("f", _layout(2), about))
    assert found.step == 6 and found.sources == {0: 0, 1: 1} and found.resharded_from == _layout(4)
    plain = decide([node, node], "new", 2)  # without elastic: another layout's, not used
    assert plain.step is None and plain.other_layout == 6
    other_run = decide([node, node], "new", 2, Replica("g", _layout(2), about))  # another experiment
    assert other_run.step is None and other_run.other_layout == 6
    refused = decide([{6: {"tp": [0, 1, 2, 3]}}] * 2, "new", 2, Replica("f", _layout(2), about))
    assert refused.step is None and refused.refused == "step 6: tp(2) -> tp(1)"
    # this layout's own newer step wins over an older one to reshard
    mixed = {9: {"new": [0, 1]}, 6: {"old": [0, 1, 2, 3]}}
    assert decide([mixed, mixed], "new", 2, Replica("f", _layout(2), about)).resharded_from is None


def test_state_split_over_dp_gathers_every_old_data_parallel_rank_with_the_other_coordinates():
    from hpctrain.localckpt.reshard import gather

    # tp 2 x dp 4 on 8 ranks -> tp 2 x dp 2 on 4; nodes 1 and 3 gone: new ranks 0, 1 on node 0 (old files 0, 1 and
    # node 3's copies 6, 7), new ranks 2, 3 on node 2 (old 4, 5 and node 1's copies 2, 3)
    held = {0: {0, 1}, 1: {0, 1}, 6: {0, 1}, 7: {0, 1}, 4: {2, 3}, 5: {2, 3}, 2: {2, 3}, 3: {2, 3}}
    plan = gather(_layout(8, tp=2), _layout(4, tp=2), held)
    assert plan == {0: [(0, 0), (2, 2), (4, 2), (6, 0)], 1: [(1, 1), (3, 2), (5, 2), (7, 1)],
                    2: [(0, 0), (2, 2), (4, 2), (6, 0)], 3: [(1, 0), (3, 3), (5, 3), (7, 0)]}
    del held[5]  # old rank 5's shards are nowhere: new ranks with tp index 1 cannot assemble theirs
    assert gather(_layout(8, tp=2), _layout(4, tp=2), held) is None


def test_decide_gathers_shards_only_where_the_writer_split_state_over_dp():
    old, new = _layout(4), _layout(2)
    everyone = [{2: {"old": [0, 1, 2, 3]}}, {}]
    about = {"old": {"family": "f", "layout": old, "dp_split": True}}
    found = decide(everyone, "new", 2, Replica("f", new, about))
    assert found.step == 2 and found.shards == {0: [(0, 0), (1, 0), (2, 0), (3, 0)],
                                                1: [(0, 0), (1, 0), (2, 0), (3, 0)]}
    about["old"]["dp_split"] = False
    assert decide(everyone, "new", 2, Replica("f", new, about)).shards == {}
