"""Muon against torch's own (``torch.optim.Muon``): the same Newton-Schulz
iteration bit for bit, and, in one process, the same step on a hidden
matrix with Moonshot's learning-rate adjustment (torch's
``adjust_lr_fn="match_rms_adamw"``)."""
from __future__ import annotations

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from hpctrain.mesh import Mesh
from hpctrain.optimizers.muon import Muon
from hpctrain.optimizers.newton_schulz import COEFFICIENTS, EPS, orthogonalize
from hpctrain.shard import replicated_spec, set_spec


def test_newton_schulz_is_torchs_bit_for_bit():
    torch.manual_seed(0)
    for shape in ((48, 16), (16, 48), (32, 32)):
        g = torch.randn(shape)
        assert torch.equal(orthogonalize(g, 5, torch.bfloat16), _zeropower_via_newtonschulz(g, COEFFICIENTS, 5, EPS))


def test_one_process_step_is_torch_muons(make_config):
    cfg = make_config("optim=muon", "optim.ns_dtype=bf16").optim
    torch.manual_seed(1)
    init = torch.randn(24, 40) * 0.02
    ours = torch.nn.Parameter(init.clone())
    set_spec(ours, replicated_spec("layers.0.ffn.w1.weight", (24, 40)))
    theirs = torch.nn.Parameter(init.clone())
    mesh = Mesh({"tp": 1, "cp": 1, "ep": 1, "dp": 1, "pp": 1}, 0, 1)
    opt = Muon([ours], cfg, mesh)
    ref = torch.optim.Muon([theirs], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        g = torch.randn(24, 40)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-7)
    assert opt.owned() == [0]
