
import pytest
import torch

from hpctrain.bootstrap import _topology, get_runtime, init_torch_distributed

pytestmark = pytest.mark.every_size  # the world size changes what is tested


@pytest.mark.mpi(min_size=2)
def test_runtime_matches_mpi(world):
    rt = get_runtime()
    assert (rt.world_rank, rt.world_size) == (world.Get_rank(), world.Get_size())
    assert 0 <= rt.local_rank < rt.local_size and 0 <= rt.node_rank < rt.num_nodes
    assert rt.device.type == "cpu"
    # one machine: every rank shares a node unless nodes are emulated
    if not rt.emulated_nodes:
        assert rt.num_nodes == 1 and rt.local_size == rt.world_size


@pytest.mark.mpi(min_size=4)
def test_emulated_nodes(world, monkeypatch):
    from mpi4py import MPI

    monkeypatch.setenv("HPCTRAIN_RANKS_PER_NODE", "2")
    local_rank, local_size, node_rank, num_nodes, emulated = _topology(world, MPI)
    r = world.Get_rank()
    assert (local_rank, local_size, node_rank, num_nodes, emulated) == (r % 2, 2, r // 2, world.Get_size() // 2, True)


@pytest.mark.mpi(min_size=2)
def test_torch_rendezvous_over_mpi(world):
    import torch.distributed as dist

    init_torch_distributed("gloo")
    t = torch.tensor([float(world.Get_rank() + 1)])
    dist.all_reduce(t)
    n = world.Get_size()
    assert t.item() == n * (n + 1) / 2
