"""all_reduce called again and again on the same tensor, as DP buckets do.

The mpi backend remembers a zero-copy MPI buffer per tensor
(``hpctrain_comm_mpi.buffers.ViewCache``) and sends a tensor it has seen
straight to MPI. These tests call each tensor several times, with each op,
blocking and not, and after changing the tensor's memory or shape in place
(``set_``, ``resize_``, an in-place transpose), checking every result
against a numpy float64 reference: a stale cached buffer would reduce the
wrong memory or the wrong number of elements.
"""
import gc
import weakref

import pytest
import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.errors import CommError

from comm_reference import all_inputs, assert_reduced, reduce_reference

pytestmark = pytest.mark.every_size  # the world size changes what is tested

REPEATING = ["mpi", "hier"]  # hier's inner backends are mpi here


def _reduce(comm, tensor, op, async_op):
    work = comm.all_reduce(tensor, op, async_op=async_op)
    work.wait()
    assert work.is_completed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("backend", REPEATING)
def test_same_tensor_every_op_many_times(comms, backend, async_op):
    comm = comms(backend)
    tensor = torch.empty(37, dtype=torch.float32)
    for round_ in range(3):
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, "avg"):
            inputs = all_inputs(comm.size, (37,), torch.float32, seed=100 + round_)
            tensor.copy_(inputs[comm.rank])
            _reduce(comm, tensor, op, async_op)
            assert_reduced(tensor, reduce_reference(inputs, ReduceOp(op).value), torch.float32)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", REPEATING)
def test_memory_or_shape_changed_in_place(comms, backend):
    comm = comms(backend)
    tensor = torch.empty(4, 4, dtype=torch.float32)
    inputs = all_inputs(comm.size, (4, 4), torch.float32, seed=7)
    tensor.copy_(inputs[comm.rank])
    _reduce(comm, tensor, ReduceOp.SUM, False)  # now remembered

    # new memory of another size (set_): the old buffer must not be used
    inputs = all_inputs(comm.size, (9,), torch.float32, seed=8)
    tensor.set_(inputs[comm.rank].clone())
    _reduce(comm, tensor, ReduceOp.SUM, False)
    assert_reduced(tensor, reduce_reference(inputs, "sum"), torch.float32)

    # same memory, fewer elements (resize_)
    inputs = all_inputs(comm.size, (5,), torch.float32, seed=9)
    tensor.resize_(5).copy_(inputs[comm.rank])
    _reduce(comm, tensor, ReduceOp.SUM, False)
    assert_reduced(tensor, reduce_reference(inputs, "sum"), torch.float32)

    # same memory and size, no longer contiguous (in-place transpose)
    square = torch.empty(3, 3, dtype=torch.float32)
    _reduce(comm, square, ReduceOp.SUM, False)  # remembered while contiguous
    inputs = all_inputs(comm.size, (3, 3), torch.float32, seed=10)
    square.t_()
    assert not square.is_contiguous()
    square.copy_(inputs[comm.rank])
    _reduce(comm, square, ReduceOp.AVG, True)
    assert_reduced(square, reduce_reference(inputs, "avg"), torch.float32)


@pytest.mark.mpi(min_size=2)
def test_remembered_integer_tensor_still_rejects_avg(comms):
    comm = comms("mpi")
    counts = torch.ones(6, dtype=torch.int64)
    _reduce(comm, counts, ReduceOp.SUM, False)
    assert counts.tolist() == [comm.size] * 6
    with pytest.raises(CommError, match="op=avg needs a floating dtype"):
        comm.all_reduce(counts, ReduceOp.AVG)


@pytest.mark.mpi(min_size=2)
def test_cache_holds_no_memory_and_forgets_dead_tensors(comms):
    comm = comms("mpi")
    views = comm._views
    before = len(views)
    for seed in range(5):  # fresh tensors, likely at reused addresses and ids
        inputs = all_inputs(comm.size, (1000,), torch.float32, seed=200 + seed)
        tensor = inputs[comm.rank].clone()
        _reduce(comm, tensor, ReduceOp.SUM, False)
        assert_reduced(tensor, reduce_reference(inputs, "sum"), torch.float32)
        alive = weakref.ref(tensor)
        del tensor
        gc.collect()
        assert alive() is None  # the cache held neither the tensor nor a numpy view of it
    assert len(views) <= before + 1  # dead tensors were forgotten
