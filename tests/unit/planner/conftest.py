"""Fixtures for the planner tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tiny_trainer(make_config, pm):
    """A real one-process Trainer on the tiny model (CPU, fp32)."""
    def build(*overrides: str):
        from hpctrain.bootstrap import get_runtime
        from hpctrain.run import build_mesh
        from hpctrain.train.trainer import Trainer

        cfg = make_config("model=tiny", "trainer.steps=1", "trainer.global_batch_size=4",
                          "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.progress=off", *overrides)
        return Trainer(cfg, build_mesh(cfg, get_runtime(), pm), pm, torch.device("cpu"), None), cfg
    return build


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny model, materialised on the CPU as the trainer does (no trainer around it)."""
    from omegaconf import OmegaConf

    from hpctrain.config import compose, to_config
    from hpctrain.model.build import build_model, materialize

    cfg = to_config(OmegaConf.to_container(compose(["model=tiny", "trainer.seq_len=32"]), resolve=True))
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), cfg.trainer.seed, cfg.model.init_std, cfg.model.n_layers)
    return model, cfg
