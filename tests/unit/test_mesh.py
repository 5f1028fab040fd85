import pytest

from hpctrain.errors import ConfigError
from hpctrain.mesh import Mesh, resolve_sizes


def test_default_order_tp_fastest_pp_slowest():
    m = Mesh({"tp": 2, "pp": 2, "dp": -1}, world_rank=5, world_size=8)
    assert m.sizes == {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2}
    # rank = tp + 2*dp + 4*pp  ->  5 = tp 1, dp 0, pp 1
    assert m.coords == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert m.group("tp").ranks == (4, 5)
    assert m.group("dp").ranks == (5, 7)
    assert m.group("pp").ranks == (1, 5)
    assert m.group("dp").rank == 0 and m.group("pp").rank == 1


def test_every_rank_round_trips_and_partitions_cover_world():
    m = Mesh({"tp": 2, "cp": 2, "dp": 2}, world_rank=0, world_size=8)
    for r in range(8):
        assert m.rank_of(m.coords_of(r)) == r
    for axes in ("tp", "cp", "dp", ("cp", "dp"), ("tp", "cp", "dp")):
        part = m.partition(axes)
        flat = sorted(r for g in part for r in g)
        assert flat == list(range(8)), axes


def test_multi_axis_group_is_order_independent():
    m = Mesh({"tp": 2, "ep": 2, "dp": 2}, world_rank=3, world_size=8)
    assert m.group(("dp", "ep")) is m.group(("ep", "dp"))
    assert m.group(("ep", "dp")).ranks == (1, 3, 5, 7)
    assert m.group(("ep", "dp")).name == "ep+dp"


def test_custom_order_puts_dp_fastest():
    m = Mesh({"tp": 2, "dp": 2}, world_rank=1, world_size=4, order="dp-tp-cp-ep-pp")
    assert m.group("dp").ranks == (0, 1)
    assert m.group("tp").ranks == (1, 3)


def test_world_size_mismatch_prints_whole_product():
    with pytest.raises(ConfigError) as e:
        resolve_sizes({"tp": 2, "pp": 2, "dp": 3}, 8)
    assert "tp(2) * cp(1) * ep(1) * dp(3) * pp(2) = 12 != world size 8" in str(e.value)


def test_dp_rest_must_divide():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by tp\\(4\\)"):
        resolve_sizes({"tp": 4, "dp": -1}, 6)


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-tp-cp-ep-dp-pp", "tp-cp-ep-dp-xx"])
def test_bad_order_names_the_fix(order):
    with pytest.raises(ConfigError, match="parallel.order"):
        resolve_sizes({}, 1, order)


def test_invalid_sizes():
    with pytest.raises(ConfigError, match="parallel.tp=0"):
        resolve_sizes({"tp": 0}, 1)
    with pytest.raises(ConfigError, match="parallel.pp=-1"):
        resolve_sizes({"pp": -1}, 1)


def test_data_axes_samples_and_reduction_groups():
    m = Mesh({"tp": 2, "ep": 2, "dp": 2}, world_rank=7, world_size=8)
    assert m.coords == {"tp": 1, "cp": 0, "ep": 1, "dp": 1, "pp": 0}
    assert (m.sample_size, m.sample_rank, m.data_size) == (4, 3, 4)
    assert m.reduction_axes(()) == ("ep", "dp")            # dense weights
    assert m.reduction_axes(("ep",)) == ("dp",)            # expert weights
    assert m.reduction_axes(("tp",)) == ("ep", "dp")       # tp-split weights are still averaged over the data axes
    assert m.group(("cp", "ep", "dp")).ranks == (1, 3, 5, 7)


def test_groups_with_the_same_ranks_are_one_object():
    m = Mesh({"dp": 4}, world_rank=1, world_size=4)
    world = m.group(("tp", "cp", "ep", "dp", "pp"))
    assert world is m.group("dp") is m.group(("cp", "ep", "dp")) and world.name == "dp"
    assert m.group("tp") is m.group("pp") and m.group("tp").size == 1
    assert len({id(g) for g in m.distinct_groups}) == len(m.distinct_groups)


def test_pipeline_ends_group():
    m = Mesh({"pp": 4, "dp": 2}, world_rank=1, world_size=8)  # rank = dp + 2 * pp
    assert m.pp_ends().ranks == (1, 7)  # stage 0 and stage 3 of this rank's pipeline
    middle = Mesh({"pp": 4, "dp": 2}, world_rank=3, world_size=8)
    assert middle.pp_ends().ranks == (3,)  # stage 1 is alone
    two = Mesh({"pp": 2}, world_rank=0, world_size=2)
    assert two.pp_ends() is two.group("pp")


def test_node_local_and_across_nodes():
    nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    m = Mesh({"tp": 2, "dp": 4}, world_rank=6, world_size=8, rank_nodes=nodes)  # dp group of rank 6: 0 2 4 6
    assert m.group("dp").ranks == (0, 2, 4, 6)
    assert m.node_local("dp").ranks == (4, 6) and m.node_local("dp").name == "dp:node"
    assert m.across_nodes("dp").ranks == (2, 6)
    one_node = Mesh({"dp": 4}, world_rank=0, world_size=4)
    assert one_node.node_local("dp") is one_node.group("dp") and one_node.across_nodes("dp").size == 1


def test_replica_groups_for_replicated_pieces():
    m = Mesh({"tp": 4, "dp": 2}, world_rank=6, world_size=8)  # tp rank 2
    assert m.replicas("tp", 2).ranks == (6, 7)  # tp ranks 2 and 3 hold piece 1 of 2
    with pytest.raises(ValueError, match="cannot cut"):
        m.replicas("tp", 3)


def test_sealed_mesh_refuses_new_groups_but_serves_existing_ones():
    m = Mesh({"tp": 4, "dp": 2}, world_rank=0, world_size=8)
    m.seal()
    assert m.group(("cp", "ep", "dp")).name == "dp"
    with pytest.raises(RuntimeError, match="was not created at set-up"):
        m.replicas("tp", 2)
