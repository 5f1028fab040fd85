"""The gradient reducer in one process, against a "mirror" communicator: a
group of ``size`` ranks whose other members hold exactly this rank's data.
The average of identical replicas is the data itself, so results are known
exactly, and the communicator records every call in order.
Multi-rank behaviour (real sums, real backends) is in tests/mpi/test_dp_*.py.
"""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn

from hpctrain.comm.protocol import CompletedWork, ReduceOp
from hpctrain.errors import CommError
from hpctrain_dp.reducer import GradReducer


class MirrorComm:
    backend = "mirror"
    rank = 0

    def __init__(self, size: int = 2):
        self.size = size
        self.calls: List[Tuple[str, int, torch.dtype]] = []
        self._scattered: List[torch.Tensor] = []  # FIFO: gathers follow all_to_alls in order

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        self.calls.append(("all_reduce", tensor.numel(), tensor.dtype))
        if ReduceOp(op) == ReduceOp.SUM:
            tensor.mul_(self.size)
        return CompletedWork()

    def all_to_all(self, output, input, output_splits=None, input_splits=None, async_op=False):
        self.calls.append(("all_to_all", input.numel(), input.dtype))
        rows = input.view(self.size, -1)
        output.view(self.size, -1).copy_(rows[self.rank].expand(self.size, -1))
        self._scattered.append(rows.clone())
        return CompletedWork()

    def all_gather(self, output, input, async_op=False):
        # Only the compressed reduction gathers, after its all_to_all (in the
        # same order): replica j contributes the mean of its chunk j, which
        # for identical replicas is row j of what was scattered. Check ours.
        self.calls.append(("all_gather", input.numel(), input.dtype))
        rows = self._scattered.pop(0)
        assert torch.equal(input.reshape(-1), rows[self.rank])
        output.view(self.size, -1).copy_(rows)
        return CompletedWork()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _loss(model, x):
    return model(x).pow(2).mean()


def _reference_grads(n_micro: int, seed: int = 0):
    model = _model(seed)
    for i in range(n_micro):
        (_loss(model, _batch(i)) / n_micro).backward()
    return [p.grad.clone() for p in model.parameters()]


def _batch(i: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + i))


def _step(model, reducer, n_micro: int):
    for i in range(n_micro):
        reducer.begin_microbatch(i, n_micro)
        (_loss(model, _batch(i)) / n_micro).backward()
    reducer.finish()


@pytest.mark.parametrize("n_micro", [1, 3])
def test_grads_are_views_into_buckets_and_match_plain_backward(n_micro):
    model, comm = _model(), MirrorComm()
    reducer = GradReducer(comm, cap_bytes=400)
    reducer.attach(list(model.parameters()))
    for _ in range(2):  # the second step re-attaches after zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        _step(model, reducer, n_micro)
    for p, ref in zip(model.parameters(), _reference_grads(n_micro)):
        # mirror average of identical replicas = own gradient; fp32 reassociation only
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
    buffers = {b.buffer.data_ptr(): b for b in reducer.buckets}
    for b in reducer.buckets:
        for p, view in zip(b.params, b.views):
            assert p.grad.data_ptr() == view.data_ptr() and view.data_ptr() - b.buffer.data_ptr() < b.buffer.nbytes
    assert len(buffers) == 4
    # one reduction per bucket per step, none during the earlier micro-batches
    assert [c[0] for c in comm.calls] == ["all_reduce"] * 4 * 2  # 2 steps
    assert [x.bucket for x in reducer.trace.launches] == [0, 1, 2, 3]
    assert all(x.microbatch == n_micro - 1 for x in reducer.trace.launches)


def test_first_bucket_is_launched_while_backward_still_runs():
    model, comm = _model(), MirrorComm()
    reducer = GradReducer(comm, cap_bytes=400)
    reducer.attach(list(model.parameters()))
    first = model[0].weight  # registered first, so its gradient is produced last
    seen_at_last_grad = []
    first.register_post_accumulate_grad_hook(lambda p: seen_at_last_grad.append(len(comm.calls)))
    model.zero_grad(set_to_none=True)
    _step(model, reducer, 1)
    # buckets 0..2 went out before the last gradient of backward existed
    assert seen_at_last_grad and seen_at_last_grad[0] >= 1
    trace = reducer.trace
    assert trace.launches[0].in_backward and trace.launches[0].hooks_before < trace.hooks_fired
    assert trace.launched_in_backward == 4 and trace.hooks_fired == 6


def test_overlap_off_launches_everything_after_backward():
    model, comm = _model(), MirrorComm()
    reducer = GradReducer(comm, cap_bytes=400, overlap=False)
    reducer.attach(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    _step(model, reducer, 2)
    assert reducer.trace.launched_in_backward == 0 and len(reducer.trace.launches) == 4


def test_unused_parameter_gets_no_grad_and_later_buckets_still_go_out():
    model, comm = _model(), MirrorComm()
    spare = nn.Parameter(torch.ones(3))  # never used by forward
    params = list(model.parameters())
    params.insert(3, spare)  # in the middle of the bucket order
    reducer = GradReducer(comm, cap_bytes=0)  # one bucket per parameter
    reducer.attach(params)
    model.zero_grad(set_to_none=True)
    _step(model, reducer, 1)
    assert spare.grad is None  # no replica used it: as in one process
    blocked = next(b for b, bucket in enumerate(reducer.buckets) if bucket.params[0] is spare)
    launches = reducer.trace.launches
    assert [x.bucket for x in launches] == list(range(len(params)))
    assert all(x.in_backward for x in launches[:blocked]) and not any(x.in_backward for x in launches[blocked:])
    for p, ref in zip(model.parameters(), _reference_grads(1)):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)


def test_without_before_backward_the_grads_are_still_reduced():
    model, comm = _model(), MirrorComm(size=4)
    reducer = GradReducer(comm, cap_bytes=1 << 20)
    reducer.attach(list(model.parameters()))
    (_loss(model, _batch(0))).backward()  # a schedule that never announced its micro-batches
    reducer.finish()
    assert [c[0] for c in comm.calls] == ["all_reduce"]
    for p, ref in zip(model.parameters(), _reference_grads(1)):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
    bucket = reducer.buckets[0]
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(bucket.params, bucket.views))


def test_second_backward_in_the_last_microbatch_is_an_error():
    model, comm = _model(), MirrorComm()
    reducer = GradReducer(comm, cap_bytes=0)
    reducer.attach(list(model.parameters()))
    reducer.begin_microbatch(0, 1)
    _loss(model, _batch(0)).backward()
    with pytest.raises(CommError, match="second gradient"):
        _loss(model, _batch(1)).backward()


@pytest.mark.parametrize("wire,unit_roundoff", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
def test_compressed_reduction_uses_the_wire_dtype_and_rounds_once_each_way(wire, unit_roundoff):
    model, comm = _model(), MirrorComm(size=3)  # 3 does not divide the bucket: exercises padding
    reducer = GradReducer(comm, cap_bytes=400, wire_dtype=wire)
    reducer.attach(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    _step(model, reducer, 2)
    kinds = [c[0] for c in comm.calls]
    assert kinds == ["all_to_all"] * 4 + ["all_gather"] * 4
    assert all(c[2] == wire for c in comm.calls)
    for p, ref in zip(model.parameters(), _reference_grads(2)):
        # identical replicas: mean(round(g)) = round(g) exactly in fp32, then one more
        # rounding of an already-representable value; so the result is round(g)
        # (up to fp32 reassociation of the reference, hence the small slack)
        assert p.grad.dtype == torch.float32
        err = (p.grad - ref).abs()
        assert bool((err <= unit_roundoff * ref.abs() * 1.01 + 1e-7).all()), float(err.max())
    assert any(bool((p.grad != r).any()) for p, r in zip(model.parameters(), _reference_grads(2)))
