"""The hierarchical backend: that it really runs two-level, that it equals the
flat MPI backend, uneven groups, mixed sub-backends, and real mesh groups.

Nodes are emulated (``HPCTRAIN_RANKS_PER_NODE=2``, see conftest.py): at 4
ranks the world is 2 nodes x 2 ranks, at 8 ranks 4 nodes x 2.
"""
import pytest
import torch

from hpctrain.bootstrap import get_runtime
from hpctrain.comm.protocol import ReduceOp
from hpctrain.errors import CommError
from hpctrain.mesh import Group, Mesh
from hpctrain.plugins import get_manager
from hpctrain.run import backend_factory

from comm_reference import all_inputs, assert_reduced, reduce_reference
from conftest import compose_config, world_group

pytestmark = pytest.mark.every_size  # the world size changes what is tested


@pytest.mark.mpi(min_size=4)
def test_world_group_is_two_level(comms):
    rt = get_runtime()
    assert rt.emulated_nodes and rt.num_nodes == rt.world_size // 2, \
        "the runtime was created before tests/mpi/comm/conftest.py set HPCTRAIN_RANKS_PER_NODE"
    assert rt.rank_nodes == tuple(r // 2 for r in range(rt.world_size))
    hier = comms("hier")
    assert hier.mode == "hier" and hier.two_level
    assert (hier.intra.size, hier.inter.size) == (2, rt.world_size // 2)
    assert hier.intra.rank == rt.local_rank and hier.inter.rank == rt.node_rank


def _integer_valued(n, shape, seed):
    """float32 data with small integer values: every partial sum is exact,
    so any reduction order gives the same bits."""
    return [torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(seed * 31 + r)).float()
            for r in range(n)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op,data", [("sum", "integer-valued"), ("avg", "integer-valued"),
                                     ("max", "integer-valued"), ("max", "random")])
def test_hier_equals_flat_bit_for_bit(comms, op, data):
    """Exact where the order cannot matter: integer-valued float32 data
    (exact partial sums; AVG divides the same exact sum by the same n), and
    MAX on random floats. Random SUM/AVG: see the next test."""
    hier, flat = comms("hier"), comms("mpi")
    n, me = hier.size, hier.rank
    rows = 3 * n  # reduce_scatter input: n chunks of 3 rows
    inputs = _integer_valued(n, (rows, 5), 41) if data == "integer-valued" else \
        all_inputs(n, (rows, 5), torch.float32, 42)
    a, b = inputs[me].clone(), inputs[me].clone()
    hier.all_reduce(a, ReduceOp(op))
    flat.all_reduce(b, ReduceOp(op))
    assert torch.equal(a, b)
    out_h, out_f = torch.empty(3, 5), torch.empty(3, 5)
    hier.reduce_scatter(out_h, inputs[me], ReduceOp(op))
    flat.reduce_scatter(out_f, inputs[me], ReduceOp(op))
    assert torch.equal(out_h, out_f)
    # and both are right, not just equal
    assert_reduced(out_h, reduce_reference(inputs, op)[3 * me:3 * me + 3], torch.float32)


@pytest.mark.mpi(min_size=2)
def test_hier_close_to_flat_on_random_floats(comms):
    """Random float32 sums depend on the order of additions: hier adds
    within nodes first. Inputs in [1, 2), <= 8 terms: each order is within
    8 * 2^-24 ~ 5e-7 of the exact sum, so the two within 1e-6 relative."""
    hier, flat = comms("hier"), comms("mpi")
    inputs = all_inputs(hier.size, (33,), torch.float32, seed=43)
    a, b = inputs[hier.rank].clone(), inputs[hier.rank].clone()
    hier.all_reduce(a)
    flat.all_reduce(b)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert_reduced(a, reduce_reference(inputs, "sum"), torch.float32)


@pytest.mark.mpi(min_size=4)
def test_hier_async_ops_in_flight_together(comms):
    """Several two-level operations started before any is waited, waited in
    reverse order: every rank runs the later phases in the same order."""
    hier = comms("hier")
    n, me = hier.size, hier.rank
    x = all_inputs(n, (7,), torch.bfloat16, seed=44)
    y = all_inputs(n, (2 * n,), torch.float32, seed=45)
    z = all_inputs(n, (3,), torch.int64, seed=46)
    tx, ty_out, tz_out = x[me].clone(), torch.empty(2), torch.empty(3 * n, dtype=torch.int64)
    works = [hier.all_reduce(tx, ReduceOp.AVG, async_op=True),
             hier.reduce_scatter(ty_out, y[me].clone(), ReduceOp.MAX, async_op=True),
             hier.all_gather(tz_out, z[me], async_op=True)]
    assert not any(w.is_completed() for w in works)  # later phases wait for wait()
    for w in reversed(works):
        w.wait()
        assert w.is_completed()
    assert_reduced(tx, reduce_reference(x, "avg"), torch.bfloat16)
    assert_reduced(ty_out, reduce_reference(y, "max")[2 * me:2 * me + 2], torch.float32)
    assert torch.equal(tz_out, torch.cat(z))


def _uneven_group(n):
    """World ranks split as (0, 1, 2) + (3, ..., n-1): with nodes of 2 the
    first group holds 2 ranks on node 0 and 1 on node 1."""
    parts = ((0, 1, 2), tuple(range(3, n)))
    me = get_runtime().world_rank
    ranks = parts[0] if me < 3 else parts[1]
    return Group(name="uneven", ranks=ranks, rank=ranks.index(me), partition=parts)


@pytest.mark.mpi(min_size=4)
def test_uneven_group_uses_flat_path(world):
    group = _uneven_group(world.Get_size())
    comm = get_manager().hook.hpctrain_make_backend(name="hier", group=group, cfg=compose_config())
    assert comm.mode == "uneven" and not comm.two_level
    t = torch.tensor([float(get_runtime().world_rank)])
    comm.all_reduce(t)
    assert t.item() == sum(group.ranks)


@pytest.mark.mpi(min_size=4)
def test_uneven_group_error_when_asked(world):
    cfg = compose_config("comm.hier.uneven=error")
    with pytest.raises(CommError, match=r"cannot split group uneven: ranks \[0, 1, 2\] hold \[2, 1\] ranks"):
        get_manager().hook.hpctrain_make_backend(name="hier", group=_uneven_group(world.Get_size()), cfg=cfg)


@pytest.mark.mpi(min_size=4)
def test_hier_with_gloo_inside_nodes_and_mpi_across(world):
    """The sub-backends are whatever plugins serve the configured names."""
    cfg = compose_config("comm.hier.intra=gloo", "comm.hier.inter=mpi")
    comm = get_manager().hook.hpctrain_make_backend(name="hier", group=world_group("world-gloo-mpi"), cfg=cfg)
    assert (comm.intra.backend, comm.inter.backend) == ("gloo", "mpi")
    inputs = all_inputs(comm.size, (5, 3), torch.bfloat16, seed=47)
    t = inputs[comm.rank].clone()
    comm.all_reduce(t, ReduceOp.SUM)
    assert_reduced(t, reduce_reference(inputs, "sum"), torch.bfloat16)
    out = torch.empty(comm.size * 5, 3, dtype=torch.bfloat16)
    comm.all_gather(out, inputs[comm.rank])
    assert torch.equal(out, torch.cat(inputs))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("backend", ["mpi", "hier"])
def test_mesh_axes_work_concurrently(world, backend):
    """dp x tp mesh (dp-major order, so dp groups lie inside nodes and tp
    groups span them): asynchronous collectives on the tp group, the dp group
    and the combined tp+dp group in flight at once, waited in reverse."""
    n, me = world.Get_size(), world.Get_rank()
    cfg = compose_config(f"comm.backend={backend}")
    mesh = Mesh({"tp": 2, "dp": -1}, me, n, order="dp-tp-cp-ep-pp")
    mesh.attach_backends(backend_factory(cfg, get_manager(), torch.device("cpu")))
    tp, dp, both = mesh.group("tp"), mesh.group("dp"), mesh.group(("tp", "dp"))
    for g in (tp, dp, both):
        assert g.communicator().backend == backend
    value = float(me + 1)
    t_tp, t_dp = torch.full((6,), value), torch.full((5,), value)
    gathered = torch.empty(n, 2)
    works = [tp.communicator().all_reduce(t_tp, ReduceOp.SUM, async_op=True),
             dp.communicator().all_reduce(t_dp, ReduceOp.MAX, async_op=True),
             both.communicator().all_gather(gathered, torch.full((2,), value), async_op=True)]
    for w in reversed(works):
        w.wait()
    assert torch.equal(t_tp, torch.full((6,), float(sum(r + 1 for r in tp.ranks))))
    assert torch.equal(t_dp, torch.full((5,), float(max(r + 1 for r in dp.ranks))))
    assert torch.equal(gathered, torch.tensor([[float(r + 1)] * 2 for r in both.ranks]))
    if backend == "hier":
        assert both.communicator().mode == "hier"  # the whole world spans nodes evenly
