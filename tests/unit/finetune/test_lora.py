"""LoRA in one process: only the adapters train.

After 5 steps of a tiny model with adapters on all seven projections, every
base weight is bit-identical to its initial value and has no gradient; the
optimizer holds state for the adapters and nothing else (counted, for each
core optimizer); the adapters start as PEFT's do (A uniform in
+-1/sqrt(in), B zero) and have moved."""
from __future__ import annotations

import math

import pytest
import torch

from hpctrain.config import compose_resolved
from hpctrain.run import reference_trainer
from hpctrain.shard import get_spec

ALL = "finetune.lora.targets=[q,k,v,o,gate,up,down]"
BASE = ("finetune=lora", "finetune.lora.rank=4", ALL, "optim.warmup_steps=0", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2", "trainer.seq_len=16", "trainer.device=cpu", "trainer.progress=off")


def _trainer(pm, *overrides):
    return reference_trainer(compose_resolved(BASE + overrides, pm), pm)


def test_base_is_frozen_and_adapters_start_as_peft(pm):
    trainer = _trainer(pm)
    named = dict(trainer.model.named_parameters())
    adapters = {n for n in named if ".lora." in n}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert {n for n, p in named.items() if p.requires_grad} == adapters
    for n in adapters:
        p = named[n]
        if n.endswith(".B"):
            assert not p.any()
        else:
            bound = 1 / math.sqrt(p.shape[1])
            assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound and p.std() > 0.5 * bound / math.sqrt(3)
    assert named["layers.0.attn.wq.lora.A"].shape == (4, 64) and named["layers.0.ffn.w2.lora.B"].shape == (64, 4)


@pytest.mark.parametrize("optim", ["adamw", "lamb", "lars", "muon"])
def test_five_steps_change_only_adapters(pm, optim):
    trainer = _trainer(pm, f"optim={optim}", "optim.warmup_steps=0")
    named = dict(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    for _ in range(5 if optim == "adamw" else 2):
        trainer.train_step()
    for n, p in named.items():
        if ".lora." in n:
            assert not torch.equal(p, before[n]), f"{n} did not train"
        else:
            assert torch.equal(p, before[n]) and p.grad is None, f"{n} changed or has a gradient"
    held = {get_spec(p).logical_name for p in trainer.optimizer.state}
    assert held == {n for n in named if ".lora." in n}, sorted(held ^ {n for n in named if ".lora." in n})
    trained = sum(p.numel() for p in named.values() if p.requires_grad)
    state = sum(t.numel() for st in trainer.optimizer.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    assert 0 < state <= 2 * trained  # at most two moments per adapter element, none for the base


def test_full_finetuning_is_the_same_model_without_adapters(pm):
    full = reference_trainer(compose_resolved(BASE[3:], pm), pm)
    lora = _trainer(pm)
    base = {n: p for n, p in lora.model.named_parameters() if ".lora." not in n}
    assert list(base) == [n for n, _ in full.model.named_parameters()]
    assert all(torch.equal(p, base[n]) for n, p in full.model.named_parameters())
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():  # B = 0: a fresh adapter changes nothing
        torch.testing.assert_close(lora.model(ids), full.model(ids), rtol=0, atol=0)


def test_a_lora_run_is_its_own_experiment(make_config):
    from hpctrain.checkpoint import default_checkpoint_dir

    full, lora = (default_checkpoint_dir(make_config(*o), "/launch") for o in ((), ("finetune=lora",)))
    assert full.endswith("/tiny-64a7e0a7")  # as before finetune existed (tests/unit/test_checkpoint_dir_names.py)
    assert lora != full != default_checkpoint_dir(make_config("finetune=lora", "finetune.lora.rank=4"), "/launch")


def test_a_checkpoint_holds_the_adapters_and_resumes(pm, tmp_path):
    """Saved after 2 steps and resumed, the third step's loss is the uninterrupted run's; the checkpoint
    holds the base and the adapters (its config names the base: checkpoint.init_from, for the export)."""
    import h5py

    ck = (f"checkpoint.dir={tmp_path}", "checkpoint.every=1000")
    straight = _trainer(pm, *ck)
    want = [straight.train_step()["loss"] for _ in range(3)]
    first = _trainer(pm, *ck)
    assert [first.train_step()["loss"] for _ in range(2)] == want[:2]
    path = first.save_checkpoint()
    with h5py.File(path) as f:
        assert {"layers.0.attn.wq.weight", "layers.0.attn.wq.lora.A", "layers.1.ffn.w2.lora.B"} <= set(f["model"])
    resumed = _trainer(pm, *ck, f"checkpoint.resume={path}")
    assert resumed.step == 2
    assert resumed.train_step()["loss"] == want[2]
