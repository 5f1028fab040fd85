"""The gradient-sync engine in one process, against a "mirror" communicator: a
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
from hpctrain.grad_sync.config import SyncConfig
from hpctrain.grad_sync.engine import GradSync


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

    def reduce_scatter(self, output, input, op=ReduceOp.SUM, async_op=False):
        self.calls.append(("reduce_scatter", input.numel(), input.dtype))
        output.copy_(input.view(self.size, -1)[self.rank] * (self.size if ReduceOp(op) == ReduceOp.SUM else 1))
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
    reducer = GradSync(comm, SyncConfig(cap_bytes=400))
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
    reducer = GradSync(comm, SyncConfig(cap_bytes=400))
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
    reducer = GradSync(comm, SyncConfig(cap_bytes=400, overlap=False))
    reducer.attach(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    _step(model, reducer, 2)
    assert reducer.trace.launched_in_backward == 0 and len(reducer.trace.launches) == 4


def test_unused_parameter_gets_no_grad_and_later_buckets_still_go_out():
    model, comm = _model(), MirrorComm()
    spare = nn.Parameter(torch.ones(3))  # never used by forward
    params = list(model.parameters())
    params.insert(3, spare)  # in the middle of the bucket order
    reducer = GradSync(comm, SyncConfig(cap_bytes=0))  # one bucket per parameter
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
    reducer = GradSync(comm, SyncConfig(cap_bytes=1 << 20))
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
    reducer = GradSync(comm, SyncConfig(cap_bytes=0))
    reducer.attach(list(model.parameters()))
    reducer.begin_microbatch(0, 1)
    _loss(model, _batch(0)).backward()
    with pytest.raises(CommError, match="second gradient"):
        _loss(model, _batch(1)).backward()


@pytest.mark.parametrize("wire,unit_roundoff", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
def test_compressed_reduction_uses_the_wire_dtype_and_rounds_once_each_way(wire, unit_roundoff):
    model, comm = _model(), MirrorComm(size=3)  # 3 does not divide the bucket: exercises padding
    reducer = GradSync(comm, SyncConfig(cap_bytes=400, wire_dtype=wire))
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


def test_no_sync_blocks_accumulate_and_the_next_backward_syncs():
    """A schedule that does not announce micro-batches (a pipeline's) uses no_sync()."""
    model, comm = _model(), MirrorComm()
    engine = GradSync(comm, SyncConfig(cap_bytes=400)).attach(list(model.parameters()))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        comm.calls.clear()
        with engine.no_sync():
            (_loss(model, _batch(0)) / 2).backward()
        assert comm.calls == []  # nothing while accumulating
        (_loss(model, _batch(1)) / 2).backward()
        assert len(comm.calls) == 4  # every bucket went out during the syncing backward
        engine.finish()
    for p, ref in zip(model.parameters(), _reference_grads(2)):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)


def test_mark_ready_launches_a_gradient_written_by_hand():
    """A zero-bubble weight pass accumulates .grad itself, outside autograd's hooks."""
    model, comm = _model(), MirrorComm()
    extra = nn.Parameter(torch.zeros(5))  # no forward uses it: only the hand-written gradient
    params = list(model.parameters()) + [extra]
    engine = GradSync(comm, SyncConfig(cap_bytes=0)).attach(params)  # one bucket each; ``extra``'s is bucket 0
    model.zero_grad(set_to_none=True)
    engine.begin_microbatch(0, 1)
    _loss(model, _batch(0)).backward()
    assert engine.trace.launches == []  # bucket 0 (``extra``) blocks the launch order
    assert extra.grad is None  # no gradient yet: a weight pass assigns or adds, as autograd would
    extra.grad = torch.arange(5.0)
    engine.mark_ready(extra)
    assert [x.bucket for x in engine.trace.launches] == list(range(len(params)))
    engine.finish()
    assert torch.equal(extra.grad, torch.arange(5.0))


class RecordingComm(MirrorComm):
    """A mirror that also keeps a copy of each all-reduced buffer as it was sent."""

    def __init__(self, size: int = 2):
        super().__init__(size)
        self.sent: List[torch.Tensor] = []

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        self.sent.append(tensor.clone())
        return super().all_reduce(tensor, op, async_op)


def test_a_step_without_a_gradient_sends_zeros_not_the_last_steps_gradient():
    """Buckets are not zeroed when a step starts (each first gradient is copied
    into its view): a parameter this rank gives no gradient must still go out
    as zeros with its flag 0, not as what its view held from the step before."""
    model, comm = _model(), RecordingComm()
    spare = nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [spare]
    engine = GradSync(comm, SyncConfig(cap_bytes=1 << 20)).attach(params)  # one bucket for everything
    (bucket,) = engine.buckets
    slot = {id(q): i for i, q in enumerate(bucket.params)}
    s = slot[id(spare)]
    offset = bucket.plan.offsets[s]
    for use_spare in (True, False):
        model.zero_grad(set_to_none=True)
        spare.grad = None
        engine.begin_microbatch(0, 1)
        loss = _loss(model, _batch(0)) + (spare.sum() * 2.0 if use_spare else 0.0)
        loss.backward()
        engine.finish()
    first, second = comm.sent
    assert torch.equal(first[offset:offset + 3], torch.full((3,), 2.0))
    assert torch.equal(second[offset:offset + 3], torch.zeros(3))  # not the first step's 2s
    assert second[bucket.grads_numel + s] == 0  # "not used on this rank"
    assert spare.grad is None  # and no replica used it: as in one process
    for p, ref in zip(model.parameters(), _reference_grads(1)):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
        assert p.grad.data_ptr() == bucket.views[slot[id(p)]].data_ptr()


class PeerComm(MirrorComm):
    """Two ranks: this one and a peer whose all-reduce input the test sets (``peer``)."""

    def __init__(self):
        super().__init__(2)
        self.peer: torch.Tensor = torch.empty(0)

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        self.calls.append(("all_reduce", tensor.numel(), tensor.dtype))
        tensor.add_(self.peer)
        if ReduceOp(op) == ReduceOp.AVG:
            tensor.div_(2)
        return CompletedWork()


def test_a_parameter_only_another_rank_used_gets_the_average_as_its_grad():
    """This rank produced no gradient for ``spare`` (its ``.grad`` stayed None
    all step); the peer did: after ``finish`` its ``.grad`` is the bucket's
    view holding the average, as on the peer."""
    model, comm = _model(), PeerComm()
    spare = nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [spare]
    engine = GradSync(comm, SyncConfig(cap_bytes=1 << 20)).attach(params)
    (bucket,) = engine.buckets
    s = [id(q) for q in bucket.params].index(id(spare))
    offset = bucket.plan.offsets[s]
    comm.peer = torch.zeros_like(bucket.buffer)
    comm.peer[offset:offset + 3] = 4.0  # the peer's gradient of ``spare``
    comm.peer[bucket.grads_numel + s] = 1.0  # and its "used" flag
    model.zero_grad(set_to_none=True)
    spare.grad = None
    engine.begin_microbatch(0, 1)
    _loss(model, _batch(0)).backward()
    engine.finish()
    assert spare.grad is not None and spare.grad.data_ptr() == bucket.views[s].data_ptr()
    assert torch.equal(spare.grad, torch.full((3,), 2.0))  # (0 + 4) / 2


def test_mark_ready_without_a_gradient_sends_zeros():
    """A parameter marked ready with ``.grad`` still None counts as a zero
    gradient: its view is zeroed, not sent with the step before's values."""
    model, comm = _model(), RecordingComm()
    extra = nn.Parameter(torch.zeros(4))
    engine = GradSync(comm, SyncConfig(cap_bytes=1 << 20)).attach(list(model.parameters()) + [extra])
    for step in range(2):
        model.zero_grad(set_to_none=True)
        extra.grad = None
        engine.begin_microbatch(0, 1)
        if step == 0:
            extra.grad = torch.full((4,), 7.0)
        _loss(model, _batch(0)).backward()
        engine.mark_ready(extra)
        engine.finish()
    assert torch.equal(extra.grad, torch.zeros(4))


def test_sparse_gradients_are_summed_into_their_views():
    """A sparse embedding's gradient has no storage to compare or copy: the
    hook sums it into the zeroed view, and later micro-batches add to it."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    ref = nn.Embedding(10, 4)
    ref.weight.data.copy_(emb.weight.data)
    engine = GradSync(MirrorComm(), SyncConfig(cap_bytes=1 << 20)).attach([emb.weight])
    batches = [torch.tensor([1, 2, 2]), torch.tensor([2, 7])]
    for _ in range(2):  # the second step starts from set_to_none again
        emb.zero_grad(set_to_none=True)
        for i, ids in enumerate(batches):
            engine.begin_microbatch(i, len(batches))
            emb(ids).pow(2).sum().backward()
        engine.finish()
    for ids in batches:
        ref(ids).pow(2).sum().backward()
    assert not emb.weight.grad.is_sparse
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-7)


def test_reduce_scatter_mode_keeps_this_ranks_shard_of_each_bucket():
    model, comm = _model(), MirrorComm(size=3)  # 3 divides no bucket: exercises the padding
    engine = GradSync(comm, SyncConfig(cap_bytes=400, reduce_scatter=True)).attach(list(model.parameters()))
    model.zero_grad(set_to_none=True)
    _step(model, engine, 2)
    refs = dict(zip(map(id, model.parameters()), _reference_grads(2)))
    assert [c[0] for c in comm.calls] == ["reduce_scatter", "all_reduce"] * len(engine.buckets)
    for bucket in engine.buckets:
        flat = torch.zeros(bucket.grads_numel)  # flags travel apart in reduce-scatter mode
        for p, off in zip(bucket.params, bucket.plan.offsets):
            flat[off:off + p.numel()] = refs[id(p)].reshape(-1)
        assert flat.numel() % 3 == 0 and bucket.shard.numel() == flat.numel() // 3
        torch.testing.assert_close(bucket.shard, flat.view(3, -1)[comm.rank], rtol=1e-6, atol=1e-7)


def test_parameters_of_different_groups_never_share_a_bucket():
    model = _model()
    a, b = MirrorComm(size=2), MirrorComm(size=4)
    params = list(model.parameters())
    expert = {id(p) for p in params[2:4]}  # the middle layer stands for expert weights
    engine = GradSync(lambda p: b if id(p) in expert else a, SyncConfig(cap_bytes=1 << 20)).attach(params)
    assert [len(x.params) for x in engine.buckets] == [4, 2]  # launch order: the last layers' group first
    assert {id(p) for p in engine.buckets[1].params} == expert and engine.buckets[1].comm is b
    model.zero_grad(set_to_none=True)
    _step(model, engine, 1)
    assert [c[0] for c in a.calls] == ["all_reduce"] and [c[0] for c in b.calls] == ["all_reduce"]
    for p, ref in zip(model.parameters(), _reference_grads(1)):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)


def test_a_group_of_one_is_left_alone():
    model = _model()
    params = list(model.parameters())
    comm = MirrorComm()
    engine = GradSync(lambda p: None if p is params[0] else comm, SyncConfig(cap_bytes=1 << 20)).attach(params)
    assert all(p is not params[0] for bucket in engine.buckets for p in bucket.params)


def _flat_reference(engine, n_micro, size):
    """Per bucket: this rank's chunk of the padded flat reference gradients."""
    out = []
    refs = dict(zip(map(id, engine._params), _reference_grads(n_micro)))
    for bucket in engine.buckets:
        flat = torch.zeros(bucket.grads_numel)
        for p, off in zip(bucket.params, bucket.plan.offsets):
            flat[off:off + p.numel()] = refs[id(p)].reshape(-1)
        out.append(flat.view(size, -1)[0])
    return out


@pytest.mark.parametrize("every_microbatch", [False, True], ids=["stage1-like", "stage2-like"])
def test_copy_in_mode_keeps_no_full_gradients(every_microbatch):
    """ZeRO: .grad is dropped once added into its bucket; buffers live only while in flight."""
    model, comm = _model(), MirrorComm(size=2)
    params = list(model.parameters())
    layers = [params[0:2], params[2:4], params[4:6]]
    engine = GradSync(comm, SyncConfig(cap_bytes=0, reduce_scatter=True, keep_grads=False,
                                       every_microbatch=every_microbatch))
    engine.attach(params, buckets=list(reversed(layers)))  # launch order: last layer first
    assert [b.params for b in engine.buckets] == list(reversed(layers))
    n_micro = 3
    for _ in range(2):  # a second step starts the shards afresh
        model.zero_grad(set_to_none=True)
        comm.calls.clear()
        for i in range(n_micro):
            engine.begin_microbatch(i, n_micro)
            if every_microbatch and i > 0:  # the previous micro-batch was completed and its buffers released
                assert all(b.buffer is None for b in engine.buckets)
            (_loss(model, _batch(i)) / n_micro).backward()
            assert all(p.grad is None for p in params)
        engine.finish()
        syncs = n_micro if every_microbatch else 1
        assert [c[0] for c in comm.calls] == ["reduce_scatter", "all_reduce"] * 3 * syncs
        assert all(b.buffer is None for b in engine.buckets)
        for bucket, want in zip(engine.buckets, _flat_reference(engine, n_micro, 2)):
            torch.testing.assert_close(bucket.shard, want, rtol=1e-6, atol=1e-7)
            assert bucket.used_anywhere == [True, True]


def test_copy_in_mode_reduces_in_its_own_dtype_and_tells_unused_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    spare = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    comm = MirrorComm(size=2)
    engine = GradSync(comm, SyncConfig(cap_bytes=1 << 20, reduce_scatter=True, keep_grads=False, dtype=torch.float32))
    engine.attach(list(model.parameters()) + [spare])
    engine.begin_microbatch(0, 1)
    model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    engine.finish()
    (bucket,) = engine.buckets
    assert bucket.shard.dtype == torch.float32 and comm.calls[0][2] == torch.float32
    assert bucket.used_anywhere == [s is not spare for s in bucket.params]


def test_given_buckets_are_checked():
    from hpctrain.grad_sync.buckets import given_buckets

    a, b, c = (torch.zeros(2), torch.zeros(3), torch.zeros(4))
    plans = given_buckets([a, b, c], [[c], [a, b]])
    assert [p.indices for p in plans] == [(2,), (0, 1)] and plans[1].offsets == (0, 2)
    with pytest.raises(ValueError, match="in buckets 0 and 1"):
        given_buckets([a, b], [[a], [a, b]])
    with pytest.raises(ValueError, match="in no bucket"):
        given_buckets([a, b, c], [[a, b]])
    with pytest.raises(ValueError, match="mixes"):
        given_buckets([a, b], [[a, b]], groups=["x", "y"])


def test_copy_in_buffers_exist_only_while_in_flight_unless_kept():
    model, comm = _model(), MirrorComm(size=2)  # its collectives finish at once
    params = list(model.parameters())
    layers = [params[4:6], params[2:4], params[0:2]]
    sizes = [4 * (sum(p.numel() for p in layer) + sum(p.numel() for p in layer) % 2) for layer in layers]
    released = GradSync(comm, SyncConfig(cap_bytes=0, reduce_scatter=True, keep_grads=False,
                                         every_microbatch=True)).attach(params, layers)
    kept = GradSync(MirrorComm(size=2), SyncConfig(cap_bytes=0, reduce_scatter=True, keep_grads=False,
                                                   release_buffers=False))
    model2 = _model()
    params2 = list(model2.parameters())
    kept.attach(params2, [params2[4:6], params2[2:4], params2[0:2]])
    for engine, m in ((released, model), (kept, model2)):
        for i in range(2):
            engine.begin_microbatch(i, 2)
            (_loss(m, _batch(i)) / 2).backward()
        engine.finish()
    two_largest = sum(sorted(sizes)[-2:])
    assert released.buffer_bytes == 0 and released.peak_buffer_bytes <= two_largest < sum(sizes)
    assert kept.buffer_bytes == kept.peak_buffer_bytes == sum(sizes)  # stage 1: full gradients between steps
    for a, b in zip(released.buckets, kept.buckets):
        torch.testing.assert_close(a.shard, b.shard, rtol=1e-6, atol=1e-7)
