"""The planner's predictions for OUR tiny model against what a real run holds.

Model states: parameter, gradient and optimizer bytes after a real training
step must equal the prediction exactly (counted tensor by tensor).
Activations: the per-layer prediction must be within 10% of the bytes torch
saves for backward, measured with saved-tensor hooks (in practice it is
exact up to the RoPE tables, which layer 0 is charged for).
"""
from __future__ import annotations

import pytest
import torch

from hpctrain.planner import activations as act
from hpctrain.planner.arch import Arch
from hpctrain.planner.estimate import Workload, memory_per_gpu
from hpctrain.planner.layouts import Layout
from hpctrain.planner.memory import HPCTRAIN

from planner_probe import measure_saved, tensor_bytes

ACTIVATION_TOLERANCE = 0.10  # the bound; the fp32 prediction is exact to the byte per layer >= 1


@pytest.mark.parametrize("model", [("model.tie_embeddings=false",), ("model.tie_embeddings=true",),
                                   ("model=tiny-moe",), ("model=tiny-moe", "model.moe.shared_experts=1")],
                         ids=["untied", "tied", "moe", "moe-shared"])
def test_model_state_bytes_equal_a_real_step(tiny_trainer, model):
    trainer, cfg = tiny_trainer(*model)
    trainer.train_step()
    params = list(trainer.model.parameters())
    held_weights = tensor_bytes(params)
    held_grads = tensor_bytes(p.grad for p in params if p.grad is not None)
    held_optim = tensor_bytes(t for state in trainer.optimizer.state.values() for t in state.values()
                              if isinstance(t, torch.Tensor))

    arch = Arch.from_model_config(cfg.model)
    work = Workload(cfg.trainer.global_batch_size, cfg.trainer.seq_len, "fp32", HPCTRAIN)
    mem = memory_per_gpu(arch, Layout(tp=1, cp=1, ep=1, dp=1, pp=1, micro_batch=2), work)
    assert (mem.weights, mem.grads, mem.optimizer) == (held_weights, held_grads, held_optim)
    assert held_weights == 4 * arch.total_params  # and the count itself comes from ModelShape


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_bytes_per_layer_match_saved_tensors(tiny_model, precision):
    model, cfg = tiny_model
    mb, s = 2, cfg.trainer.seq_len
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (mb, s), generator=g)
    targets = torch.randint(0, cfg.model.vocab_size, (mb, s), generator=g)
    measured = measure_saved(model, tokens, targets, autocast=precision == "bf16")

    arch = Arch.from_model_config(cfg.model)
    per_layer = act.layer_bytes(arch, precision, mb, s)
    for i in range(arch.n_layers):
        got = measured[f"layer{i}"]
        assert abs(got - per_layer) <= ACTIVATION_TOLERANCE * got, (i, got, per_layer)
    # everything outside the blocks (token ids, final norm, log-softmax, targets, RoPE tables)
    extra = act.stage_extra_bytes(arch, precision, mb, s, tp=1, cp=1, sp=False, first=True, last=True)
    total_measured = sum(v for k, v in measured.items() if k != "weight_copies")
    assert abs(total_measured - (arch.n_layers * per_layer + extra)) <= ACTIVATION_TOLERANCE * total_measured
    # bf16 autocast keeps one bf16 copy of every matrix it cast (not the embedding table)
    copies = measured.get("weight_copies", 0)
    if precision == "bf16":
        matrices = arch.total_params - arch.embedding_params - arch.n_layers * arch.norm_params - arch.final_norm_params
        assert copies == 2 * matrices
    else:
        assert copies == 0


def test_fp32_layer_formula_is_exact_for_later_layers(tiny_model):
    """Layer 1 is charged nothing shared, so the derivation must match to the byte."""
    model, cfg = tiny_model
    tokens = torch.zeros(2, cfg.trainer.seq_len, dtype=torch.long)
    measured = measure_saved(model, tokens, tokens)
    assert measured["layer1"] == act.layer_bytes(Arch.from_model_config(cfg.model), "fp32", 2, cfg.trainer.seq_len)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_bytes_per_layer_with_recompute(tiny_model, precision, recompute):
    """``model.recompute`` keeps what the planner's formula says, per layer:
    selective drops the attention core's log-sum-exp (the checkpoint keeps q,
    k, v), full keeps only the block input. Layer 1 is compared (layer 0 is
    charged the shared RoPE tables); in fp32 the match is to the byte, which
    also tells selective from none (a difference of 4 bytes per head and
    token)."""
    from hpctrain.model.recompute import set_recompute

    model, cfg = tiny_model
    mb, s = 2, cfg.trainer.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (mb, s), generator=torch.Generator().manual_seed(0))
    set_recompute(model, recompute)
    try:
        measured = measure_saved(model, tokens, tokens, autocast=precision == "bf16")
    finally:
        set_recompute(model, "none")
    predicted = act.layer_bytes(Arch.from_model_config(cfg.model), precision, mb, s, recompute=recompute)
    got = measured["layer1"]
    assert abs(got - predicted) <= ACTIVATION_TOLERANCE * got, (got, predicted)
    if precision == "fp32":
        assert got == predicted
