"""Expert parallelism trains the model of one process holding all experts:
the same per-step losses and the same gradient of every parameter (expert
weights assembled from the ep ranks that hold them), dropless at ep 2 and 4,
with data parallelism and tensor parallelism (sequence parallelism on and
off; the shared experts split over tp) and context parallelism around it,
with shared experts, and with the sigmoid router (whose selection biases
move after every step from the world's loads). With a capacity the same
assignments are dropped as in one process; a router that sends every
token to one expert trains (three of four ep ranks receive no token) and
still equals one process.

Tolerances (fp32), as for data parallelism: expert parallelism changes
which rank computes a token's expert and in what order rows are summed,
so losses agree to 1e-6 relative and gradients to 1e-5 relative plus 1e-6
of the largest element at step 1 and ``parity.ADAM_DRIFT`` afterwards. A
global batch of 8 with micro-batches of 1 gives each rank 1 to 4
micro-batches. The routing is a discontinuous function of the weights; at
these tolerances no token of these runs sits near a tie (a flip would show
as a loss difference of 1e-3 or more, not a near miss).
"""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from parity import assert_parity, record, shared_reference, world_trainer

STEPS = 2  # the second step runs on weights the first AdamW step moved
BASE = ("trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "model=tiny-moe")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
SIGMOID = ("model.moe.router=sigmoid", "model.moe.aux_free_bias_rate=0.01")


def one_process(*model_overrides):
    """The one-process run of this model (computed once per job)."""
    return shared_reference(BASE + tuple(model_overrides), STEPS)


def _check(pm, model, *layout):
    trainer = world_trainer(pm, *BASE, *model, *layout)
    assert_parity(record(trainer, STEPS), one_process(*model), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    return trainer


def _experts_per_rank(trainer):
    return trainer.model.layers[0].ffn.experts.w1.shape[0]


@pytest.mark.mpi(min_size=2)
def test_dropless_ep_trains_like_one_process(world, pm):
    """ep 2 and ep 4 (when the world has 4 ranks), the rest data parallel."""
    for ep in (2, 4):
        if ep <= world.Get_size():
            trainer = _check(pm, (), f"parallel.ep={ep}")
            assert _experts_per_rank(trainer) == 4 // ep


@pytest.mark.mpi(min_size=4)
def test_ep2_with_data_parallelism(world, pm):
    trainer = _check(pm, (), "parallel.ep=2", "parallel.dp=-1")
    assert trainer.mesh.size("dp") == world.Get_size() // 2


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_ep2_with_tensor_parallel_attention(world, pm, sequence_parallel):
    trainer = _check(pm, ("model.moe.shared_experts=1",), "parallel.ep=2", "parallel.tp=2",
                     f"parallel.sequence_parallel={str(sequence_parallel).lower()}")
    block = trainer.model.layers[0]
    # attention and the shared experts split over tp (their projections' seam filled by tensor parallelism),
    # the routed experts over ep
    assert type(block.attn.linears).__name__ == "TensorParallelLinears"
    assert type(block.ffn.shared.linears).__name__ == "TensorParallelLinears"
    assert block.ffn.shared.w1.weight.shape[0] == 64 // 2
    assert _experts_per_rank(trainer) == 2


@pytest.mark.mpi(min_size=2)
def test_shared_experts(world, pm):
    trainer = _check(pm, ("model.moe.shared_experts=1",), "parallel.ep=2")
    assert trainer.model.layers[0].ffn.shared is not None


@pytest.mark.mpi(min_size=2)
def test_sigmoid_router_and_its_bias_updates(world, pm):
    trainer = _check(pm, SIGMOID, "parallel.ep=2")
    # the biases moved (the loads were uneven) and are the same on every rank
    bias = trainer.model.layers[0].ffn.router.expert_bias
    assert float(bias.abs().sum()) > 0
    everyone = world.allgather(bias.tolist())
    assert all(b == everyone[0] for b in everyone)


@pytest.mark.mpi(min_size=2)
def test_every_other_block(world, pm):
    trainer = _check(pm, ("model.n_layers=4", "model.moe.every=2"), "parallel.ep=2")
    kinds = [type(b.ffn).__name__ for b in trainer.model.layers]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU", "MoE"]


class _KeepTap:
    """Each MoE forward's (layer, input, kept assignments)."""

    def __init__(self, model):
        self.seen = []
        self.handles = [block.ffn.register_forward_hook(self._hook(int(name)))
                        for name, block in model.layers.named_children() if type(block.ffn).__name__ == "MoE"]

    def _hook(self, layer):
        def hook(module, args, out):
            self.seen.append((layer, args[0].detach().reshape(-1).clone(), module.last_keep.clone()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.mpi(min_size=2)
def test_capacity_drops_the_assignments_one_process_drops(world, pm):
    """Step 1 (same weights): every micro-batch's kept assignments at ep 2
    equal those of the one-process micro-batch with the same input; then the
    runs stay equal (losses, gradients, dropped fraction)."""
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    model = ("model.moe.capacity_factor=0.75",)
    trainer = world_trainer(pm, *BASE, *model, "parallel.ep=2")
    alone = reference_trainer(compose_resolved(BASE + model, pm), pm)
    taps = _KeepTap(trainer.model), _KeepTap(alone.model)
    got_metrics, want_metrics = trainer.train_step(), alone.train_step()
    for t in taps:
        t.remove()
    mine = world.allgather(taps[0].seen)
    found = [x for per_rank in mine for x in per_rank]
    reference = taps[1].seen
    assert len(found) == len(reference)
    dropped = 0
    for layer, x, keep in found:
        match = [k for (l2, x2, k) in reference
                 if l2 == layer and x2.shape == x.shape and torch.allclose(x2, x, atol=1e-5)]
        assert len(match) == 1, f"layer {layer}: no unique one-process micro-batch with this input"
        assert torch.equal(keep, match[0])
        dropped += int((~keep).sum())
    assert dropped > 0  # the capacity bit
    assert got_metrics["moe.dropped_fraction"] == want_metrics["moe.dropped_fraction"] > 0
    assert abs(got_metrics["loss"] - want_metrics["loss"]) <= LOSS_RTOL * want_metrics["loss"]
    _check(pm, model, "parallel.ep=2")


@pytest.mark.mpi(min_size=4)
def test_capacity_with_sequence_parallel_tensor_parallelism(world, pm):
    """Under sequence parallelism each tp rank routes a shard of the
    micro-batch; the capacity's priority order still runs over the whole
    micro-batch (the expert choices are gathered along the sequence)."""
    trainer = _check(pm, ("model.moe.capacity_factor=0.75",), "parallel.ep=2", "parallel.tp=2",
                     "parallel.sequence_parallel=true")
    assert trainer.metrics["moe.dropped_fraction"] > 0


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("capacity", [None, 0.75], ids=["dropless", "capacity"])
def test_ep2_with_context_parallelism(world, pm, capacity):
    """cp 2 splits every sequence into zigzag chunks: the balance loss (not
    linear in the tokens) is formed from the whole micro-batch's statistics,
    and a capacity's priority order runs over the true positions."""
    model = () if capacity is None else (f"model.moe.capacity_factor={capacity}",)
    trainer = _check(pm, model, "parallel.ep=2", "parallel.cp=2", "parallel.dp=-1")
    if capacity is not None:
        assert trainer.metrics["moe.dropped_fraction"] > 0


def _force_expert_zero(trainer):
    for block in trainer.model.layers:
        block.ffn.router.expert_bias.copy_(torch.tensor([1e6, 0.0, 0.0, 0.0]))


@pytest.mark.mpi(min_size=4)
def test_every_token_to_one_expert(world, pm):
    """Top-1 sigmoid routing whose bias picks expert 0 for every token: at
    ep 4 ranks 1-3 receive nothing, and the run still equals one process."""
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    model = ("model.moe.router=sigmoid", "model.moe.aux_free_bias_rate=0", "model.moe.top_k=1")
    trainer = world_trainer(pm, *BASE, *model, "parallel.ep=4")
    alone = reference_trainer(compose_resolved(BASE + model, pm), pm)
    _force_expert_zero(trainer)
    _force_expert_zero(alone)
    received = []
    experts = trainer.model.layers[0].ffn.experts
    handle = experts.register_forward_hook(lambda m, args, out: received.append(args[0].shape[0]))
    got, want = record(trainer, 2), record(alone, 2, MPI.COMM_SELF)
    handle.remove()
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    rank = trainer.mesh.rank("ep")
    assert (sum(received) > 0) == (rank == 0), (rank, received)
    assert trainer.metrics["moe.tokens_per_expert_max"] == 8 * 32  # all of a step's tokens, per layer
    for step in got:  # experts 1-3 got no token, so no gradient anywhere
        for name in ("w1", "w3", "w2"):
            assert float(step.grads[f"layers.0.ffn.experts.{name}"][1:].abs().max()) == 0.0


@pytest.mark.mpi(min_size=2)
def test_metrics_report_load_and_balance(world, pm):
    trainer = world_trainer(pm, *BASE, "parallel.ep=2")
    m = trainer.train_step()
    tokens = 8 * 32
    assert m["moe.tokens_per_expert_mean"] == pytest.approx(tokens * 2 / 4)
    assert m["moe.tokens_per_expert_max"] >= m["moe.tokens_per_expert_mean"]
    max_over_mean = m["moe.tokens_per_expert_max"] / m["moe.tokens_per_expert_mean"]
    assert m["moe.load_max_over_mean"] == pytest.approx(max_over_mean)
    assert m["moe.dropped_fraction"] == 0.0
    assert 0.9 < m["moe.aux_loss"] < 4.0 and m["moe.z_loss"] > 0


@pytest.mark.mpi(min_size=2)
def test_planner_model_states_equal_the_run_at_ep2(world, pm):
    """The planner's weight, gradient and optimizer bytes for tiny-moe at
    ep 2 are what a rank holds after a step (counted tensor by tensor)."""
    from hpctrain.planner.arch import Arch
    from hpctrain.planner.estimate import Workload, memory_per_gpu
    from hpctrain.planner.layouts import Layout
    from hpctrain.planner.memory import HPCTRAIN

    for model in ((), ("model.moe.shared_experts=1", "model.n_layers=4", "model.moe.every=2")):
        trainer = world_trainer(pm, *BASE, *model, "parallel.ep=2")
        trainer.train_step()
        params = list(trainer.model.parameters())

        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts)

        held = (nbytes(params), nbytes(p.grad for p in params if p.grad is not None),
                nbytes(t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)))
        cfg = trainer.cfg
        arch = Arch.from_model_config(cfg.model)
        work = Workload(cfg.trainer.global_batch_size, cfg.trainer.seq_len, "fp32", HPCTRAIN)
        dp = world.Get_size() // 2
        mem = memory_per_gpu(arch, Layout(tp=1, cp=1, ep=2, dp=dp, pp=1, micro_batch=1), work)
        assert (mem.weights, mem.grads, mem.optimizer) == held, model
