"""Multi-token prediction (``model.mtp_depth``) against a reference written
by hand from the equations of the DeepSeek-V3 technical report (section
2.2, eqs. 21-25): the objective's value and the gradient of every weight
(fp32, 1e-6 relative). transformers' DeepseekV3 does not run MTP in its
forward (its ``MtpModel`` drafts tokens for generation), so the loss has no
ecosystem reference; the module's own forward is also compared with
transformers' ``MtpLayer`` (concatenation order, norms), with our block in
its place.

The reference for a batch of tokens t (T positions, targets t shifted by
one): h^0 = the main model's normed final hidden state; for k = 1..D,
h'^k_i = W_k [rms(Emb(t_{i+k})) * e_k ; rms(h^{k-1}_i) * g_k] over the
positions i whose t_{i+k} exists, h^k = norm_k(TRM_k(h'^k)), and
L^k = -(1/T) sum_i log softmax(Head(h^k_i))[t_{i+k+1}] over the positions
whose t_{i+k+1} exists; L = L_main + lambda / D sum_k L^k. It runs module k
over T - k positions, where the model runs all T and masks: equal because
attention is causal. With a loss mask T is the counted targets of the
main loss."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpctrain.model.aux import collect_aux_losses, with_aux
from hpctrain.model.build import build_model, materialize
from hpctrain.model.transformer import rope_tables

BATCH, T, LAMBDA = 2, 12, 0.3


def _model(make_config, pm, *overrides):
    cfg = make_config("model.mtp_loss_weight=0.3", *overrides)
    model = materialize(build_model(cfg, pm), torch.device("cpu"), 7, cfg.model.init_std, cfg.model.n_layers)
    with torch.no_grad():  # norms away from ones, so a norm left out or swapped shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(model, tokens, targets):
    """L_main + lambda / D * sum_k L^k, from the equations (module docstring)."""
    positions = torch.arange(T)
    cos, sin = rope_tables(positions, model.shape.head_dim, model.rope_theta)
    x = model.tok_embeddings.weight[tokens]
    for block in model.layers:
        x = block(x, cos, sin)
    h = _rms(x, model.norm.weight)
    head = model.output.weight
    counted = int((targets >= 0).sum())
    main = F.cross_entropy((h @ head.t()).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    # the stream t_1 .. t_{T+1}: the inputs, then the last target (t_{i+k} for i + k <= T)
    stream = torch.cat([tokens, targets[:, -1:]], dim=1)
    depth, mtp = model.mtp.depth, torch.zeros(())
    for k, module in enumerate(model.mtp.layers.values(), start=1):
        n = T - k  # positions i = 1 .. T - k have t_{i+k} within the T inputs
        e = _rms(model.tok_embeddings.weight[stream[:, k:k + n]], module.enorm.weight)
        h_in = torch.cat([e, _rms(h[:, :n], module.hnorm.weight)], dim=-1) @ module.eh_proj.weight.t()
        h = _rms(module.block(h_in, cos[:n], sin[:n]), module.norm.weight)
        logits = h @ head.t()
        # position i predicts t_{i+k+1} = targets[i + k]: positions whose target lies beyond the sample have none
        ahead = targets[:, k:k + n]
        usable = ahead.shape[1]
        mtp = mtp + F.cross_entropy(logits[:, :usable].flatten(0, 1), ahead.flatten(), ignore_index=-100,
                                    reduction="sum") / counted
    return main / counted + LAMBDA / depth * mtp


def _objective(model, tokens, targets):
    with collect_aux_losses() as aux:
        loss = model(tokens, targets)
    return with_aux(loss, aux), loss, aux


def _grads(model, fn):
    model.zero_grad()
    value = fn()
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("overrides", [
    ("model.mtp_depth=1",),
    ("model.mtp_depth=2",),
    ("model.mtp_depth=1", "model=tiny-moe", "model.moe.router=sigmoid", "model.moe.shared_experts=1",
     "model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0"),
], ids=["depth1", "depth2", "moe-block"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-targets", "loss-mask"])
def test_objective_and_gradients_equal_the_papers_equations(make_config, pm, overrides, masked):
    model = _model(make_config, pm, *overrides)
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, 256, (BATCH, T + 1), generator=g)
    tokens, targets = stream[:, :-1], stream[:, 1:].clone()
    if masked:  # a prompt's targets masked (chat data): the paper's 1/T becomes 1/(counted targets)
        targets[0, :5] = -100
        targets[1, 7:9] = -100
    got, got_grads = _grads(model, lambda: _objective(model, tokens, targets)[0])
    want, want_grads = _grads(model, lambda: _reference(model, tokens, targets))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert set(got_grads) == set(want_grads)
    assert any(n.startswith("mtp.") for n in got_grads)
    for name, ref in want_grads.items():
        torch.testing.assert_close(got_grads[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_logged_loss_stays_the_language_models(make_config, pm):
    model = _model(make_config, pm, "model.mtp_depth=1")
    stream = torch.randint(0, 256, (BATCH, T + 1), generator=torch.Generator().manual_seed(4))
    objective, loss, aux = _objective(model, stream[:, :-1], stream[:, 1:])
    assert set(aux.by_name()) == {"mtp.loss"} and aux.by_name()["mtp.loss"] > 0
    model.mtp = None  # the same model without its MTP module gives the same language-model loss
    torch.testing.assert_close(model(stream[:, :-1], stream[:, 1:]), loss)
    assert float(objective.detach()) == pytest.approx(float(loss.detach()) + aux.by_name()["mtp.loss"], rel=1e-6)


def test_a_loss_weight_weighs_mtp_like_the_main_loss():
    """``with_aux``'s loss weight (a loss mask's, step_runner.weigh_masked) multiplies MTP's term too, not
    an MoE balance loss."""
    from hpctrain.model.aux import add_aux_loss

    with collect_aux_losses() as aux:
        add_aux_loss("mtp.loss", torch.tensor(2.0), like_loss=True)
        add_aux_loss("moe.aux_loss", torch.tensor(5.0))
    assert float(with_aux(torch.tensor(1.0) * 3, aux, 3.0)) == 3 + 6 + 5


def test_mtp_layer_of_transformers_computes_the_same_module(make_config, pm):
    """transformers' MtpLayer (enorm(embedding) first, hnorm(hidden), eh_proj, the block, post_norm) with our
    block in its place gives our module's output."""
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.modeling_layers import MtpLayer
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no MtpLayer")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = _model(make_config, pm, "model.mtp_depth=1")
    ours = model.mtp.layers["2"]
    cos, sin = rope_tables(torch.arange(T), model.shape.head_dim, model.rope_theta)

    class Ours(torch.nn.Module):  # MtpLayer calls its block with keyword arguments of its own
        def forward(self, hidden_states, **kwargs):
            return ours.block(hidden_states, cos, sin)

    cfg = LlamaConfig(hidden_size=64, rms_norm_eps=1e-5, num_attention_heads=4, num_hidden_layers=1)
    theirs = MtpLayer(cfg, lambda config, idx: Ours(), LlamaRMSNorm, 0)
    with torch.no_grad():
        for a, b in ((theirs.enorm, ours.enorm), (theirs.hnorm, ours.hnorm), (theirs.eh_proj, ours.eh_proj),
                     (theirs.post_norm, ours.norm)):
            a.weight.copy_(b.weight)
    emb, hidden = torch.randn(BATCH, T, 64), torch.randn(BATCH, T, 64)
    want = theirs(emb, hidden, position_embeddings=None, attention_mask=None, position_ids=None, cache=None)
    torch.testing.assert_close(ours(emb, hidden, cos, sin), want, rtol=1e-6, atol=1e-6)
