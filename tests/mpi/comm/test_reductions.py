"""all_reduce and reduce_scatter: every backend x dtype x op, in every call
style for float32 and bfloat16 (see comm_reference.VARIANTS), against a
numpy float64 reference (tolerances in comm_reference.RTOL). Shapes have an
odd element count so the hierarchical backend pads.
"""
import pytest
import torch

from hpctrain.comm.protocol import CompletedWork, ReduceOp

from comm_reference import (
    BACKENDS,
    all_inputs,
    assert_reduced,
    reduce_params,
    reduce_reference,
    strided_like,
)

pytestmark = pytest.mark.every_size  # the world size changes what is tested


def _wait(work, async_op):
    if async_op:
        assert not isinstance(work, CompletedWork) or work.is_completed()
        work.wait()
    assert work.is_completed()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,op,variant", reduce_params())
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce(comms, backend, dtype, op, variant):
    comm = comms(backend)
    shape = (5, 7)
    inputs = all_inputs(comm.size, shape, dtype, seed=11)
    if variant == "strided":
        tensor = strided_like(shape, dtype)
        tensor.copy_(inputs[comm.rank])
    else:
        tensor = inputs[comm.rank].clone()
    work = comm.all_reduce(tensor, ReduceOp(op), async_op=variant == "async")
    _wait(work, variant == "async")
    assert_reduced(tensor, reduce_reference(inputs, op), dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,op,variant", reduce_params())
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter(comms, backend, dtype, op, variant):
    comm = comms(backend)
    n, rows = comm.size, 3
    inputs = all_inputs(n, (n * rows, 5), dtype, seed=12)
    if variant == "strided":
        source = strided_like((n * rows, 5), dtype)
        source.copy_(inputs[comm.rank])
        output = strided_like((rows, 5), dtype)
    else:
        source = inputs[comm.rank].clone()
        output = torch.zeros(rows, 5, dtype=dtype)
    work = comm.reduce_scatter(output, source, ReduceOp(op), async_op=variant == "async")
    _wait(work, variant == "async")
    expected = reduce_reference(inputs, op)[comm.rank * rows:(comm.rank + 1) * rows]
    assert_reduced(output, expected, dtype)
    torch.testing.assert_close(source, inputs[comm.rank], rtol=0, atol=0)  # input left alone


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_into_own_chunk_of_input(comms, backend):
    """ZeRO-style aliasing: the output is this rank's chunk of the input."""
    comm = comms(backend)
    n, rows = comm.size, 2
    inputs = all_inputs(n, (n * rows, 3), torch.float32, seed=13)
    source = inputs[comm.rank].clone()
    output = source[comm.rank * rows:(comm.rank + 1) * rows]
    comm.reduce_scatter(output, source, ReduceOp.SUM)
    assert_reduced(output, reduce_reference(inputs, "sum")[comm.rank * rows:(comm.rank + 1) * rows], torch.float32)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_reductions(comms, backend, dtype):
    comm = comms(backend)
    empty = torch.zeros(0, 3, dtype=dtype)
    comm.all_reduce(empty, ReduceOp.SUM)
    comm.all_reduce(empty, ReduceOp.MAX, async_op=True).wait()
    comm.reduce_scatter(torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=dtype), ReduceOp.SUM)
    # a collective after the empty ones still matches up across ranks
    t = torch.ones(3, dtype=dtype)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(comm.size), dtype=dtype))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dtype,big", [(torch.bfloat16, 256.0), (torch.float16, 2048.0)], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_16bit_sums_accumulate_in_fp32(comms, backend, dtype, big):
    """Rank 0 holds ``big``, every other rank 1.0. At ``big`` the 16-bit
    spacing is 2, so summing in 16 bits rounds each +1 (or +2 from a pair)
    away or to a tie, while one float32 sum rounded once gives
    round16(big + n - 1) exactly, e.g. bf16(259) = 260 at 4 ranks where a
    bf16 accumulation gives 256 or 258. Exact comparison; needs >= 3 ranks
    (with 2 ranks both ways are one correctly rounded addition)."""
    comm = comms(backend)
    n = comm.size
    value = big if comm.rank == 0 else 1.0
    expected = torch.tensor(big + n - 1, dtype=torch.float32).to(dtype)
    t = torch.full((4,), value, dtype=dtype)
    comm.all_reduce(t, ReduceOp.SUM)
    assert torch.equal(t, expected.expand(4)), (t, expected)
    chunks = torch.full((n * 2,), value, dtype=dtype)
    out = torch.empty(2, dtype=dtype)
    comm.reduce_scatter(out, chunks, ReduceOp.SUM)
    assert torch.equal(out, expected.expand(2)), (out, expected)
