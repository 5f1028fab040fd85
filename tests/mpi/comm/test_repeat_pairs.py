"""all_gather, reduce_scatter and all_to_all called again and again on the
same pair of tensors, as ZeRO's shards and buckets and a layer's exchange
buffers are.

The mpi backend remembers the zero-copy MPI buffers of a pair passed twice
(``hpctrain_comm_mpi.buffers.PairCache``) and sends it straight to MPI
from then on. These tests call each pair several times, blocking and
not, then change one tensor in place (``set_``, ``resize_``, an in-place
transpose or reshape), swap in another partner, pass splits, or use a
dtype that needs staging, checking every result against what each rank
knows every other rank sent: a stale buffer would move the wrong memory or
the wrong number of elements, or skip an error. The mpi tests also check
that the pair was remembered (or not), so they cover the fast path.
"""
import gc
import weakref

import pytest
import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.errors import CommError
from hpctrain.plugins import get_manager

from comm_reference import all_inputs, assert_equal, assert_reduced, reduce_reference
from conftest import compose_config, world_group

pytestmark = pytest.mark.every_size  # the world size changes what is tested

REPEATING = ["mpi", "hier"]  # hier's inner backends are mpi here


def _wait(work, async_op):
    if async_op:
        work.wait()
    assert work.is_completed()


def _remembered(comm, cache, output, input):
    """Whether the mpi communicator would take its fast path for this pair (None for hier)."""
    if comm.backend != "mpi":
        return None
    return getattr(comm, cache).get(output, input) is not None


def _gather(comm, output, input, seed, async_op=False):
    inputs = all_inputs(comm.size, tuple(input.shape), input.dtype, seed)
    input.copy_(inputs[comm.rank])
    _wait(comm.all_gather(output, input, async_op=async_op), async_op)
    assert_equal(output.reshape(-1), torch.cat([x.reshape(-1) for x in inputs]))


def _scatter(comm, output, input, seed, op=ReduceOp.SUM, async_op=False):
    inputs = all_inputs(comm.size, tuple(input.shape), input.dtype, seed)
    input.copy_(inputs[comm.rank])
    _wait(comm.reduce_scatter(output, input, op, async_op=async_op), async_op)
    mine = reduce_reference(inputs, ReduceOp(op).value).reshape(comm.size, -1)[comm.rank]
    assert_reduced(output.reshape(-1), mine, output.dtype)


def _exchange(comm, output, input, seed, async_op=False, splits=None):
    """all_to_all of dim-0 rows; ``splits``: the rows rank i sends rank j (None: equal)."""
    n, me = comm.size, comm.rank
    inputs = all_inputs(n, tuple(input.shape), input.dtype, seed)
    input.copy_(inputs[me])
    if splits is None:
        blocks = [list(x.chunk(n)) for x in inputs]
        work = comm.all_to_all(output, input, async_op=async_op)
    else:
        blocks = [list(inputs[i].split(splits[i])) for i in range(n)]
        work = comm.all_to_all(output, input, [splits[i][me] for i in range(n)], splits[me], async_op=async_op)
    _wait(work, async_op)
    assert_equal(output, torch.cat([blocks[i][me] for i in range(n)]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("backend", REPEATING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_same_pair_many_times(comms, backend, dtype, async_op):
    comm = comms(backend)
    n = comm.size
    gathered, shard = torch.zeros(n * 6, dtype=dtype), torch.zeros(6, dtype=dtype)
    summed, grads = torch.zeros(5, dtype=dtype), torch.zeros(n * 5, dtype=dtype)
    received, sent = torch.zeros(2 * n, 3, dtype=dtype), torch.zeros(2 * n, 3, dtype=dtype)
    ops = [ReduceOp.SUM, ReduceOp.MAX] + ([ReduceOp.AVG, "avg"] if dtype.is_floating_point else [])
    for round_ in range(3):
        _gather(comm, gathered, shard, seed=300 + round_, async_op=async_op)
        for k, op in enumerate(ops):
            _scatter(comm, summed, grads, seed=310 + 10 * round_ + k, op=op, async_op=async_op)
        _exchange(comm, received, sent, seed=350 + round_, async_op=async_op)
    # byte moves are never staged; a 16-bit reduction is (in float32), so never remembered
    assert _remembered(comm, "_gathers", gathered, shard) in (None, True)
    assert _remembered(comm, "_exchanges", received, sent) in (None, True)
    assert _remembered(comm, "_scatters", summed, grads) in (None, dtype != torch.bfloat16)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_all_gather_pair_changed_in_place(comms, backend):
    comm = comms(backend)
    n = comm.size
    output, input = torch.zeros(2 * n, 2 * n), torch.zeros(4 * n)  # output numel = n x input numel
    _gather(comm, output, input, seed=400)
    _gather(comm, output, input, seed=400)
    assert _remembered(comm, "_gathers", output, input) in (None, True)

    input.set_(torch.zeros(4 * n))  # the input moved: send from its new memory
    _gather(comm, output, input, seed=401)
    old = output.clone()
    output.set_(torch.zeros(2 * n, 2 * n))  # the output moved: receive into its new memory
    _gather(comm, output, input, seed=402)
    assert not torch.equal(old, output)

    output.t_()  # same memory and size, no longer contiguous: staged, gathered in the new element order
    assert not output.is_contiguous()
    _gather(comm, output, input, seed=403)
    assert _remembered(comm, "_gathers", output, input) in (None, False)
    output.t_()

    input.resize_(n)  # same memory, fewer elements, for both
    output.resize_(n * n)
    _gather(comm, output, input, seed=404)

    other = torch.zeros(n)  # the same output with another input
    _gather(comm, output, other, seed=405)
    _gather(comm, output, input, seed=406)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_all_gather_from_own_slot_again_and_after_moving_the_input(comms, backend):
    """The FSDP-style pair (MPI_IN_PLACE) is remembered as such, and forgotten
    when the input is no longer the slot."""
    comm = comms(backend)
    n, me = comm.size, comm.rank
    output = torch.zeros(n * 4, dtype=torch.bfloat16)
    mine = output[me * 4:(me + 1) * 4]
    for seed in (410, 411, 412):
        _gather(comm, output, mine, seed=seed)
    assert _remembered(comm, "_gathers", output, mine) in (None, True)
    mine.set_(torch.zeros(4, dtype=torch.bfloat16))  # now outside the output: sent from its own memory
    _gather(comm, output, mine, seed=413)
    _gather(comm, output, mine, seed=414)
    assert _remembered(comm, "_gathers", output, mine) in (None, True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_reduce_scatter_pair_changed_in_place(comms, backend):
    comm = comms(backend)
    n = comm.size
    output, input = torch.zeros(6), torch.zeros(n * 6)
    _scatter(comm, output, input, seed=420)
    _scatter(comm, output, input, seed=420)
    assert _remembered(comm, "_scatters", output, input) in (None, True)

    input.set_(torch.zeros(n * 6))
    _scatter(comm, output, input, seed=421, op=ReduceOp.AVG)
    output.set_(torch.zeros(6))
    _scatter(comm, output, input, seed=422)
    input.resize_(n * 2)
    output.resize_(2)
    _scatter(comm, output, input, seed=423)

    _scatter(comm, output, torch.zeros(n * 2), seed=424)  # the same output with another input
    _scatter(comm, output, input, seed=425, op=ReduceOp.MAX)  # MAX: the full path, on a remembered pair

    square, mine = torch.zeros(n, n), torch.zeros(n)
    _scatter(comm, mine, square, seed=426)
    _scatter(comm, mine, square, seed=426)
    assert _remembered(comm, "_scatters", mine, square) in (None, True)
    square.t_()  # same memory and size, no longer contiguous: staged, chunks in the new element order
    _scatter(comm, mine, square, seed=427)
    assert _remembered(comm, "_scatters", mine, square) in (None, False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_reduce_scatter_into_a_slot_of_its_own_input(comms, backend):
    """Output inside the input (in-place ZeRO style): MPI may not alias them,
    so the output is received into a copy every time, never remembered."""
    comm = comms(backend)
    n, me = comm.size, comm.rank
    buffer = torch.zeros(n * 3)
    slot = buffer[me * 3:(me + 1) * 3]
    for seed in (430, 431, 432):
        inputs = all_inputs(n, (n * 3,), torch.float32, seed)
        buffer.copy_(inputs[me])
        comm.reduce_scatter(slot, buffer)
        assert_reduced(slot, reduce_reference(inputs, "sum")[me * 3:(me + 1) * 3], torch.float32)
    assert _remembered(comm, "_scatters", slot, buffer) in (None, False)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_all_to_all_pair_with_other_splits_and_shapes(comms, backend):
    comm = comms(backend)
    n = comm.size
    output, input = torch.zeros(2 * n, 3), torch.zeros(2 * n, 3)
    _exchange(comm, output, input, seed=440)
    _exchange(comm, output, input, seed=440)
    assert _remembered(comm, "_exchanges", output, input) in (None, True)

    equal = [[2] * n for _ in range(n)]  # the same rows, passed as splits (MPI_Alltoallv on every rank)
    _exchange(comm, output, input, seed=441, splits=equal)
    # rank i sends 1 or 3 rows to rank j (2 on average, so 2n in all; n is even or the last pair is 2)
    uneven = [[2 + (1 if (i + j) % 2 else -1) * (j < n - n % 2) for j in range(n)] for i in range(n)]
    assert all(sum(row) == 2 * n for row in uneven)
    received = sum(uneven[i][comm.rank] for i in range(n))
    _exchange(comm, torch.zeros(received, 3), input, seed=442, splits=uneven)
    _exchange(comm, output, input, seed=443)  # back to the remembered pair

    input.set_(torch.zeros(2 * n, 3))
    _exchange(comm, output, input, seed=444)
    output.set_(torch.zeros(2 * n, 3))
    _exchange(comm, output, input, seed=445, async_op=True)

    # same memory and element count, other rows: the shape is checked again
    input.resize_(n, 6)
    with pytest.raises(CommError, match="rows of shape"):
        comm.all_to_all(output, input)
    input.resize_(3, 2 * n)  # 3 rows: not divisible by n >= 2
    with pytest.raises(CommError, match="not divisible"):
        comm.all_to_all(output, input)
    input.resize_(2 * n, 3)
    _exchange(comm, output, input, seed=446)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_all_to_all_non_contiguous_after_remembered(comms, backend):
    comm = comms(backend)
    n = comm.size
    output, input = torch.zeros(n, n), torch.zeros(n, n)
    _exchange(comm, output, input, seed=450)
    _exchange(comm, output, input, seed=450)
    input.t_()  # same memory and shape (square), no longer contiguous: staged
    assert not input.is_contiguous()
    _exchange(comm, output, input, seed=451)
    output.t_()
    _exchange(comm, output, input, seed=452)
    assert _remembered(comm, "_exchanges", output, input) in (None, False)


@pytest.mark.mpi(min_size=2)
def test_pair_cache_holds_no_memory_and_forgets_dead_tensors(comms):
    comm = comms("mpi")
    n = comm.size
    before = len(comm._gathers), len(comm._scatters), len(comm._exchanges)
    for seed in range(5):  # fresh pairs, likely at reused addresses and ids
        output, input, sent = torch.zeros(n * 1000), torch.zeros(1000), torch.zeros(n * 1000)
        for _ in range(2):  # remembered the second time
            _gather(comm, output, input, seed=460 + seed)
            _scatter(comm, input, output, seed=470 + seed)
            _exchange(comm, output, sent, seed=480 + seed)
        assert _remembered(comm, "_exchanges", output, sent)
        alive = weakref.ref(output), weakref.ref(input), weakref.ref(sent)
        del output, input, sent
        gc.collect()
        assert all(a() is None for a in alive)  # no tensor or view of one was kept
    after = len(comm._gathers), len(comm._scatters), len(comm._exchanges)
    assert all(a <= b + 1 for a, b in zip(after, before))  # dead pairs were forgotten


@pytest.mark.mpi(min_size=2)
def test_remembered_the_second_time(comms):
    """A pair passed once (a layer's fresh output) is only noted; the same
    pair passed again is remembered; fresh pairs never are."""
    comm = comms("mpi")
    n = comm.size
    output, input = torch.zeros(n * 2), torch.zeros(2)
    _gather(comm, output, input, seed=495)
    assert not _remembered(comm, "_gathers", output, input)
    for seed in (496, 497):  # fresh tensors each time, as a layer's forward makes them
        _gather(comm, torch.zeros(n * 2), torch.zeros(2), seed=seed)
    _gather(comm, output, input, seed=498)
    assert _remembered(comm, "_gathers", output, input)


@pytest.mark.mpi(min_size=2)
def test_a_dead_partner_drops_the_pair(comms):
    comm = comms("mpi")
    n = comm.size
    output = torch.zeros(n * 8)
    input = torch.zeros(8)
    _gather(comm, output, input, seed=490)
    _gather(comm, output, input, seed=490)
    key = (id(output), id(input))
    assert key in comm._gathers.entries
    del input
    gc.collect()
    assert key not in comm._gathers.entries
    _gather(comm, output, torch.zeros(8), seed=491)


@pytest.fixture(scope="module")
def checked_mpi():
    """A world mpi communicator with comm.mpi.check_shapes=true."""
    cfg = compose_config("comm.mpi.check_shapes=true")
    return get_manager().hook.hpctrain_make_backend(name="mpi", group=world_group(), cfg=cfg)


@pytest.mark.mpi(min_size=2)
def test_check_shapes_checks_every_call(checked_mpi):
    """With the cross-rank check on, nothing is remembered: a repeated pair
    whose size then disagrees across ranks is still caught."""
    comm = checked_mpi
    n = comm.size
    gathered, shard = torch.zeros(n * 4), torch.zeros(4)
    summed, grads = torch.zeros(4), torch.zeros(n * 4)
    received, sent = torch.zeros(n, 2), torch.zeros(n, 2)
    for seed in (500, 501):
        _gather(comm, gathered, shard, seed=seed)
        _scatter(comm, summed, grads, seed=seed)
        _exchange(comm, received, sent, seed=seed)
    assert len(comm._gathers) == len(comm._scatters) == len(comm._exchanges) == len(comm._views) == 0
    extra = int(comm.rank == 0)
    shard.set_(torch.zeros(4 + extra))  # (set_: a storage numpy has seen cannot grow)
    gathered.set_(torch.zeros(n * (4 + extra)))
    with pytest.raises(CommError, match="disagree"):
        comm.all_gather(gathered, shard)


@pytest.mark.mpi(min_size=2)
def test_check_shapes_catches_splits_on_some_ranks_only(checked_mpi):
    """None on one rank and splits on the others would pair MPI_Alltoall with
    MPI_Alltoallv (a hang): the check raises on every rank instead."""
    comm = checked_mpi
    n = comm.size
    output, input = torch.zeros(n, 2), torch.zeros(n, 2)
    splits = None if comm.rank == 0 else [1] * n
    with pytest.raises(CommError, match="some ranks passed splits and others None"):
        comm.all_to_all(output, input, splits, splits)
    t = torch.ones(3)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
