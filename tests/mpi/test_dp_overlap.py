"""Bucket reductions start during backward, and not before the last micro-batch.

Evidence from two sides, neither based on wall-clock time:
- a spy wrapped around the dp group's communicator records each call with
  the micro-batch announced to the data axes' handle (``before_backward``),
  and a test hook on the token embedding (the parameter whose gradient
  backward produces last) records how many calls had been made by then;
- the plugin's own trace (bucket order, hooks fired before each launch).
"""
from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch

from hpctrain.comm.protocol import ReduceOp


class SpyComm:
    """Forwards to a real communicator and records (op, phase, numel, dtype)."""

    def __init__(self, inner):
        self.inner, self.backend, self.rank, self.size = inner, inner.backend, inner.rank, inner.size
        self.phase: Any = None
        self.calls: List[Tuple[str, Any, int, Any]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        self.calls.append(("all_reduce", self.phase, tensor.numel(), tensor.dtype))
        return self.inner.all_reduce(tensor, op, async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, async_op=False):
        self.calls.append(("all_to_all", self.phase, input.numel(), input.dtype))
        return self.inner.all_to_all(output, input, output_splits, input_splits, async_op)

    def all_gather(self, output, input, async_op=False):
        self.calls.append(("all_gather", self.phase, input.numel(), input.dtype))
        return self.inner.all_gather(output, input, async_op)


def record_phases(data, spy: SpyComm) -> None:
    """Tell the spy which micro-batch's backward is running: the data axes'
    handle is told before each backward (``before_backward``) and once they
    are all done (``reduce_gradients``); the spy hears it first."""
    before, reduce = data.before_backward, data.reduce_gradients

    def before_backward(microbatch, num_microbatches):
        spy.phase = microbatch
        before(microbatch, num_microbatches)

    def reduce_gradients():
        spy.phase = "after"
        reduce()

    data.before_backward, data.reduce_gradients = before_backward, reduce_gradients


@pytest.mark.mpi(min_size=2)
def test_buckets_go_out_during_the_last_backward_only(world, make_config, pm):
    from hpctrain.bootstrap import with_device
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    n = world.Get_size()
    cfg = make_config("trainer.micro_batch_size=1", f"trainer.global_batch_size={3 * n}", "trainer.seq_len=32",
                      "trainer.device=cpu", "trainer.progress=off", "comm.bucket_mb=0.02")
    rt = with_device("cpu")
    configure_torch(cfg, rt)
    mesh = build_mesh(cfg, rt, pm)
    spy = SpyComm(mesh.group("dp").communicator())
    mesh.group("dp").comm = spy  # the engine takes its communicators when it attaches, in Trainer()
    trainer = Trainer(cfg, mesh, pm, rt.device)
    record_phases(trainer.data_handle, spy)

    last_grad: List[int] = []
    embedding = trainer.model.tok_embeddings.weight
    embedding.register_post_accumulate_grad_hook(lambda p: last_grad.append(len(spy.calls)) if spy.phase == 2 else None)

    for _ in range(2):  # the second step runs on re-attached gradient views
        spy.calls.clear()
        last_grad.clear()
        trainer.train_step()
        reducer = trainer.data_handle.engine
        n_buckets = len(reducer.buckets)
        assert n_buckets >= 4
        grads = [c for c in spy.calls if c[3] == torch.float32]  # the float64 one is the trainer's loss and norm
        assert not [c for c in spy.calls if c[1] in (0, 1)], "communication during a no-sync micro-batch"
        assert len(grads) == n_buckets and all(c[0] == "all_reduce" for c in grads)
        in_last_backward = [c for c in grads if c[1] == 2]
        assert in_last_backward, "no bucket was launched during backward"
        assert last_grad and last_grad[0] >= 1, "the first bucket went out only after backward had finished"

        trace = reducer.trace
        assert trace.num_microbatches == 3
        assert [x.bucket for x in trace.launches] == list(range(n_buckets))
        assert all(x.microbatch == 2 for x in trace.launches)
        first = trace.launches[0]
        assert first.in_backward and first.hooks_before < trace.hooks_fired == len(trainer.params)
        assert trace.launched_in_backward == len(in_last_backward)
