"""How the hierarchical backend splits groups into nodes (pure logic)."""
import pytest

from hpctrain_comm_hier.layout import plan_partition, split_by_node

TWO_PER_NODE = tuple(r // 2 for r in range(8))  # nodes of 2 consecutive ranks


def test_even_group_splits_into_intra_and_inter_lists():
    s = split_by_node((0, 1, 2, 3, 4, 5), TWO_PER_NODE)
    assert s.even and s.nodes == 3 and s.per_node == (2, 2, 2)
    assert s.intra == ((0, 1), (2, 3), (4, 5))
    assert s.inter == ((0, 2, 4), (1, 3, 5))
    # slot = position on the node * nodes + position in the inter list
    assert s.slots() == (0, 3, 1, 4, 2, 5)
    assert s.intra_of(3) == (2, 3) and s.inter_of(3) == (1, 3, 5)


def test_round_robin_placement_keeps_world_rank_order():
    """Ranks dealt to nodes in turn (0 and 2 on node 0, 1 and 3 on node 1)."""
    s = split_by_node((0, 1, 2, 3), (0, 1, 0, 1))
    assert s.intra == ((0, 2), (1, 3)) and s.inter == ((0, 1), (2, 3))
    assert sorted(s.slots()) == [0, 1, 2, 3]


@pytest.mark.parametrize("partition,mode", [
    (((0, 1, 2, 3),), "hier"),                       # 2 nodes x 2
    (((0, 1), (2, 3)), "one-node"),                  # each group inside a node
    (((0, 2), (1, 3)), "one-per-node"),              # each group one rank per node
    (((0, 1, 2), (3,)), "uneven"),                   # 2 + 1 ranks on two nodes
    (((0, 1, 2, 3, 4, 5, 6, 7),), "hier"),           # 4 nodes x 2
])
def test_partition_modes(partition, mode):
    plan = plan_partition(partition, TWO_PER_NODE[:sum(len(g) for g in partition)])
    assert plan.mode == mode


def test_sub_partitions_cover_the_world_once():
    plan = plan_partition(((0, 1, 4, 5), (2, 3, 6, 7)), TWO_PER_NODE)
    assert plan.mode == "hier"
    for part in (plan.intra_partition, plan.inter_partition):
        assert sorted(r for g in part for r in g) == list(range(8))
    assert plan.intra_partition == ((0, 1), (4, 5), (2, 3), (6, 7))
    assert plan.inter_partition == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_uneven_example_names_the_counts():
    plan = plan_partition(((0, 1, 2), (3,)), TWO_PER_NODE[:4])
    assert plan.uneven_example() == "ranks [0, 1, 2] hold [2, 1] ranks on their 2 nodes"
