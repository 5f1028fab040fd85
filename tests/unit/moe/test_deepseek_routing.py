"""The MoE layer with DeepSeek-V3's routing (sigmoid scores, the expert
score-correction bias that selects but does not weigh, group-limited top-k,
norm_topk_prob, the routed scaling factor) and shared experts equals
transformers' own ``DeepseekV3MoE`` module with the same weights: output and
input gradient within 1e-5 relative (fp32), and the weights' gradients too.

The bias is set so that it changes which experts are chosen (checked: the
choices differ from the unbiased ones), and the groups so that the limit
excludes experts a plain top-k would take (checked likewise), so a layer
that used the bias in the weights, or ignored it or the groups, fails."""
from __future__ import annotations

import pytest
import torch

from hpctrain_moe.config import MoEConfig
from hpctrain_moe.layer import MoE
from hpctrain_moe.router import route

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402

D, H, E, K, GROUPS, TOPK_GROUPS, SHARED, SCALE = 32, 16, 8, 3, 4, 2, 2, 2.5


def _pair(norm_topk_prob: bool):
    hf_cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=H, n_routed_experts=E, num_experts_per_tok=K,
                              n_group=GROUPS, topk_group=TOPK_GROUPS, n_shared_experts=SHARED,
                              routed_scaling_factor=SCALE, norm_topk_prob=norm_topk_prob, hidden_act="silu")
    torch.manual_seed(0)
    hf = DeepseekV3MoE(hf_cfg).float()
    ours = MoE(D, 4 * H, MoEConfig(num_experts=E, top_k=K, ffn_hidden=H, router="sigmoid", expert_groups=GROUPS,
                                   topk_groups=TOPK_GROUPS, routed_scaling_factor=SCALE, shared_experts=SHARED,
                                   norm_topk_prob=norm_topk_prob, aux_loss_coef=0.0, z_loss_coef=0.0))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        # a bias large enough to move choices (DeepSeek-V3's are of the scores' order)
        hf.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E)[torch.randperm(E)])
        ours.router.weight.copy_(hf.gate.weight)
        assert ours.router.expert_bias is not None
        ours.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)  # (E, 2H, D): gate rows, then up rows
        ours.experts.w1.copy_(gate)
        ours.experts.w3.copy_(up)
        ours.experts.w2.copy_(hf.experts.down_proj)
        assert ours.shared is not None
        ours.shared.w1.weight.copy_(hf.shared_experts.gate_proj.weight)
        ours.shared.w3.weight.copy_(hf.shared_experts.up_proj.weight)
        ours.shared.w2.weight.copy_(hf.shared_experts.down_proj.weight)
    return hf, ours


def _run(module, x, upstream):
    x = x.clone().requires_grad_()
    out = module(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad


def _close(got, want, what):
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalised", "raw-scores"])
def test_layer_equals_transformers_deepseek_v3_moe(norm_topk_prob):
    hf, ours = _pair(norm_topk_prob)
    x = torch.randn(3, 7, D)
    upstream = torch.randn(3, 7, D)
    want_out, want_dx = _run(hf, x, upstream)
    got_out, got_dx = _run(ours, x, upstream)
    _close(got_out, want_out, "output")
    _close(got_dx, want_dx, "input gradient")
    gate, up = hf.experts.gate_up_proj.grad.chunk(2, dim=1)
    for got, want, what in ((ours.router.weight.grad, hf.gate.weight.grad, "router"),
                            (ours.experts.w1.grad, gate, "experts' gate"), (ours.experts.w3.grad, up, "experts' up"),
                            (ours.experts.w2.grad, hf.experts.down_proj.grad, "experts' down"),
                            (ours.shared.w1.weight.grad, hf.shared_experts.gate_proj.weight.grad, "shared gate"),
                            (ours.shared.w2.weight.grad, hf.shared_experts.down_proj.weight.grad, "shared down")):
        _close(got, want, what)


def test_the_bias_and_the_groups_change_the_choice_here():
    """The comparison above would not notice a router that ignored the bias or the group limit unless they
    move choices on its tokens: they do."""
    hf, ours = _pair(True)
    x = torch.randn(3 * 7, D)
    logits = ours.router.logits(x, ours.router.weight)
    bias = ours.router.expert_bias
    full = route(logits, K, "sigmoid", bias, True, GROUPS, TOPK_GROUPS, SCALE).experts.sort(-1).values
    no_bias = route(logits, K, "sigmoid", None, True, GROUPS, TOPK_GROUPS, SCALE).experts.sort(-1).values
    no_groups = route(logits, K, "sigmoid", bias, True, 1, 1, SCALE).experts.sort(-1).values
    _, _, hf_experts = hf.gate(x)
    assert torch.equal(full, hf_experts.sort(-1).values)
    assert not torch.equal(full, no_bias) and not torch.equal(full, no_groups)
    # every token's experts lie in at most topk_groups groups
    for row in full // (E // GROUPS):
        assert len(set(row.tolist())) <= TOPK_GROUPS


def test_given_weights_fill_the_selection_bias(make_config, pm):
    """``checkpoint.init_from`` sources fill persistent buffers they hold (the selection bias: an imported
    DeepSeek-V3's e_score_correction_bias), named as checkpoints name them; the others stay zero."""
    from hpctrain.model.build import build_model, materialize

    cfg = make_config("model=tiny-moe", "model.moe.router=sigmoid")
    given = torch.tensor([0.5, -0.25, 0.0, 1.0])

    def source(spec, box):
        return given[box[0][0]:box[0][1]] if spec.logical_name == "layers.0.ffn.router.expert_bias" else None

    model = materialize(build_model(cfg, pm), torch.device("cpu"), 0, 0.02, 2, source=source)
    assert torch.equal(model.layers[0].ffn.router.expert_bias, given)
    assert torch.equal(model.layers[1].ffn.router.expert_bias, torch.zeros(4))


def test_an_export_takes_the_selection_bias_from_the_checkpoint(tmp_path):
    """``hpctrain-ckpt export`` hands the checkpoint's persistent buffers (``/buffers``) to the writer beside
    its weights, in Hugging Face's order, checksums verified: a DeepSeek-V3 export writes its expert bias."""
    import h5py
    import numpy as np

    from hpctrain_h5ckpt import checksum
    from hpctrain_h5ckpt.export import _entries, _with_buffers

    path = str(tmp_path / "step.h5")
    bias = np.array([0.5, -0.25, 0.0, 1.0], dtype=np.float32)
    with h5py.File(path, "w") as f:
        for group, name, value in (("model", "norm.weight", np.ones(2, np.float32)),
                                   ("model", "layers.0.ffn.router.weight", np.ones((4, 2), np.float32)),
                                   ("buffers", "layers.0.ffn.router.expert_bias", bias)):
            f.require_group(group).create_dataset(name, data=value).attrs["checksum"] = checksum.whole(value)
    with h5py.File(path, "r") as f:
        entries = _with_buffers(path, f, _entries(path, f))
        assert [e.logical for e in entries] == ["layers.0.ffn.router.expert_bias", "layers.0.ffn.router.weight",
                                                "norm.weight"]
        assert torch.equal(entries[0].read(), torch.from_numpy(bias))
