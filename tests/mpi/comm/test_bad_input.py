"""Bad input gives a clear CommError on every rank, not a hang or a wrong sum.

After each error the group must still be in step: the tests end with a
collective that has to give the right answer.
"""
import pytest
import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.errors import CommError
from hpctrain.plugins import get_manager

from conftest import compose_config, world_group

pytestmark = pytest.mark.every_size  # the world size changes what is tested


def _in_step(comm):
    t = torch.ones(3)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(comm.size)))


@pytest.fixture(scope="module")
def checked():
    """``checked("mpi")``: a world communicator with the cross-rank shape check on."""
    cfg = compose_config("comm.mpi.check_shapes=true", "comm.hier.check_shapes=true")
    made = {}

    def get(backend):
        if backend not in made:
            made[backend] = get_manager().hook.hpctrain_make_backend(name=backend, group=world_group(), cfg=cfg)
        return made[backend]

    return get


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "hier"])
@pytest.mark.parametrize("dtype,op,message", [
    (torch.bool, "sum", "cannot reduce dtype bool"),
    (torch.complex64, "max", "cannot reduce dtype complex64"),
    (torch.int8, "sum", "cannot reduce dtype int8"),
    (torch.int32, "avg", "op=avg needs a floating dtype"),
])
def test_reduction_of_unsupported_dtype(comms, backend, dtype, op, message):
    comm = comms(backend)
    with pytest.raises(CommError, match=message):
        comm.all_reduce(torch.zeros(4, dtype=dtype), ReduceOp(op))
    n = comm.size
    with pytest.raises(CommError, match=message):
        comm.reduce_scatter(torch.zeros(2, dtype=dtype), torch.zeros(2 * n, dtype=dtype), ReduceOp(op))
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["gloo", "mpi", "hier"])
def test_local_shape_errors(comms, backend):
    """Caught on each rank from its own arguments (no communication needed)."""
    comm = comms(backend)
    n = comm.size
    with pytest.raises(CommError, match="all_gather: output has 5 elements"):
        comm.all_gather(torch.zeros(5), torch.zeros(3))
    with pytest.raises(CommError, match="reduce_scatter: input has 5 elements"):
        comm.reduce_scatter(torch.zeros(2), torch.zeros(5))
    with pytest.raises(CommError, match="input_splits sum to"):
        comm.all_to_all(torch.zeros(n), torch.zeros(n), [1] * n, [2] * n)
    with pytest.raises(CommError, match="dtype"):
        comm.all_gather(torch.zeros(n, dtype=torch.float64), torch.zeros(1))
    with pytest.raises(CommError, match="outside group"):
        comm.broadcast(torch.zeros(1), src=n)
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
def test_mpi_rejects_rows_of_different_sizes_and_bad_tags(comms):
    comm = comms("mpi")
    n = comm.size
    with pytest.raises(CommError, match="rows of shape"):
        comm.all_to_all(torch.zeros(n, 3), torch.zeros(n, 2))
    with pytest.raises(CommError, match="tag -1"):
        comm.send(torch.zeros(1), (comm.rank + 1) % n, tag=-1)
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "hier"])
def test_size_mismatch_across_ranks(checked, backend):
    """Rank 0 passes one element more than the others, consistently with its
    own output: only the cross-rank check can see it."""
    comm = checked(backend)
    n, extra = comm.size, int(comm.rank == 0)
    with pytest.raises(CommError, match="disagree"):
        comm.all_reduce(torch.ones(6 + extra))
    with pytest.raises(CommError, match="disagree"):
        comm.all_gather(torch.zeros(n * (3 + extra)), torch.ones(3 + extra))
    with pytest.raises(CommError, match="disagree"):
        comm.reduce_scatter(torch.zeros(2 + extra), torch.ones(n * (2 + extra)))
    with pytest.raises(CommError, match="disagree"):
        comm.broadcast(torch.zeros(4 + extra), src=0)
    _in_step(comm)


@pytest.mark.mpi(min_size=4)
def test_hier_catches_mismatch_between_nodes(checked):
    """Node 0 passes 35 elements, node 1 (and beyond) 36: inside each node the
    sizes agree and both pad to chunks of 18, so only the hier-level check
    sees it."""
    comm = checked("hier")
    assert comm.two_level
    numel = 35 if comm.inter.rank == 0 else 36  # inter rank = node index
    with pytest.raises(CommError, match="rank 0: numel 35"):
        comm.all_reduce(torch.ones(numel))
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["mpi", "hier"])
def test_all_to_all_splits_inconsistent_with_peers(checked, backend):
    """Every rank's splits add up locally, but rank 0 expects 2 rows from
    rank 1 while rank 1 sends it 1 (and sends the spare row to itself)."""
    comm = checked(backend)
    n, me = comm.size, comm.rank
    send = [1] * n
    recv = [1] * n
    if me == 0:
        send, recv = [1] * n, [1, 2] + [1] * (n - 2)
        send[0] += 1  # keeps its dim-0 total equal to its received total
    out = torch.zeros(sum(recv), 2)
    with pytest.raises(CommError, match="rank 1 sends 1 rows to rank 0, which expects 2"):
        comm.all_to_all(out, torch.ones(sum(send), 2), recv, send)
    _in_step(comm)


@pytest.mark.mpi(min_size=2)
def test_mpi_receive_smaller_than_message(comms):
    """MPI's truncation error comes back as a CommError naming the operation."""
    comm = comms("mpi")
    if comm.rank == 0:
        comm.send(torch.ones(8), 1, tag=7)
    elif comm.rank == 1:
        with pytest.raises(CommError, match="recv on group world failed in MPI"):
            comm.recv(torch.zeros(2), 0, tag=7)
    _in_step(comm)
