import dataclasses

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from hpctrain.config.store import build_schema, compose


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "llama3-8b"])
def test_every_model_preset_composes(preset, make_config):
    cfg = make_config(f"model={preset}")
    assert cfg.model.name == preset


def test_fixed_keys_exist(make_config):
    cfg = make_config()
    for key in ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.order",
                "comm.backend", "trainer.steps", "trainer.global_batch_size", "trainer.micro_batch_size",
                "trainer.seq_len", "trainer.seed", "trainer.log_every", "trainer.precision", "optim.lr",
                "optim.weight_decay", "optim.warmup_steps", "optim.grad_clip", "checkpoint.dir",
                "checkpoint.every", "checkpoint.resume"):
        section, name = key.split(".")
        assert name in cfg[section], key


def test_overrides_are_typed(pm):
    with pytest.raises((ValidationError, ConfigCompositionException)):
        compose(["trainer.steps=many"], pm)
    with pytest.raises((ConfigKeyError, ConfigCompositionException)):
        compose(["trainer.stepz=5"], pm)


def test_unknown_preset_lists_the_options(pm):
    with pytest.raises(ConfigCompositionException) as e:
        compose(["model=gpt5"], pm)
    assert "tiny" in str(e.value) and "llama3-8b" in str(e.value)


def test_experiment_preset_applies_globally(make_config):
    cfg = make_config("experiment=tiny_long")
    assert cfg.trainer.steps == 300 and cfg.optim.warmup_steps == 20


def test_plugin_sections_fold_into_the_schema():
    import pluggy

    from hpctrain import hookimpl
    from hpctrain.plugins import create_manager

    @dataclasses.dataclass
    class Zero:
        stage: int = 0

    @dataclasses.dataclass
    class Extra:
        every: int = 3

    class Plugin:
        @hookimpl
        def hpctrain_config_sections(self):
            return {"parallel.zero": Zero, "extra": Extra}

    pm = create_manager(load_entry_points=False)
    pm.register(Plugin())
    top, groups = build_schema(pm)
    inst = top()
    assert inst.parallel.zero.stage == 0 and inst.extra.every == 3 and inst.parallel.dp == -1
    cfg = compose(["parallel.zero.stage=2", "extra.every=5"], pm)
    assert cfg.parallel.zero.stage == 2 and cfg.extra.every == 5
