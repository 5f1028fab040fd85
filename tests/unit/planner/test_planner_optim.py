"""The planner knows each optimizer's state: the bytes per parameter it
plans equal what the trainer's optimizer holds after a step, Muon's share of
matrices is the one its optimizer decides on, and ``hpctrain-plan`` pins the
optimizer (``--pin optim=NAME`` or the ``optim=NAME`` override)."""
from __future__ import annotations

import pytest

from hpctrain.optimizers.kinds import OPTIMIZERS, state_bytes_per_element
from hpctrain.planner.cli import main
from hpctrain.planner.plan import make_plan

LLAMA_64 = ["model=llama3-8b", "cluster=h100-80gb", "cluster.gpus=64", "trainer.global_batch_size=512",
            "trainer.seq_len=8192", "--pin", "zero=1"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_bytes_are_what_the_optimizer_holds(tiny_trainer, name):
    from hpctrain.planner.arch import Arch
    from hpctrain.planner.memory import optimizer_profile

    trainer, cfg = tiny_trainer(f"optim={name}")
    trainer.train_step()
    held = sum(t.numel() * t.element_size() for st in trainer.optimizer.state.values()
               for t in st.values() if t.dim() > 0)
    params = sum(p.numel() for p in trainer.params)
    share = Arch.from_model_config(cfg.model).muon_share
    assert held / params == pytest.approx(state_bytes_per_element(name, share), rel=1e-12)
    assert optimizer_profile(name, share).optimizer == state_bytes_per_element(name, share)


def test_muon_share_is_the_optimizers_choice_of_matrices(make_config):
    from hpctrain.model.build import build_model
    from hpctrain.optimizers.kinds import muon_matrix
    from hpctrain.planner.arch import Arch
    from hpctrain.shard import get_spec

    for model in ("model=tiny", "model=gpt2-124m", "model=llama3-8b"):
        cfg = make_config(model, "optim=muon")
        specs = [get_spec(p) for p in build_model(cfg).parameters()]
        numel = lambda s: __import__("math").prod(s.global_shape)  # noqa: E731
        share = sum(numel(s) for s in specs if muon_matrix(s, list(cfg.optim.adamw_params))) / sum(map(numel, specs))
        assert Arch.from_model_config(cfg.model).muon_share == pytest.approx(share, rel=1e-12), model


def test_plan_pins_the_optimizer():
    from hpctrain.planner.estimate import estimate

    adamw_plan = make_plan(LLAMA_64[:5], knob_pins={"zero": 1})
    lars_plan = make_plan(LLAMA_64[:5], knob_pins={"zero": 1, "optim": "lars"})
    adamw = adamw_plan[0].best
    # the same layout under LARS holds half of AdamW's optimizer state (LARS's smaller state may let another
    # layout fit and win, so the comparison is at AdamW's best layout)
    arch, work, cluster = lars_plan[1], lars_plan[2], lars_plan[3]
    lars = estimate(arch, adamw.layout, work, cluster)
    assert lars.memory.optimizer == pytest.approx(adamw.memory.optimizer / 2, rel=1e-3)
    by_override = make_plan(LLAMA_64[:5] + ["optim=lars"], knob_pins={"zero": 1})[0].best
    assert by_override.memory.optimizer == lars_plan[0].best.memory.optimizer


def test_a_bad_optimizer_pin_is_one_line(capsys):
    assert main(LLAMA_64[:5] + ["--pin", "optim=sgd"]) == 2
    err = capsys.readouterr().err
    assert "hpctrain: error: --pin optim=sgd: use" in err and "optim=adamw|lamb|lars|muon" in err
