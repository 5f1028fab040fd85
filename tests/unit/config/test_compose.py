import dataclasses

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from hpctrain.config.store import build_schema, compose


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "llama3-8b", "llama3-70b", "llama3-405b"])
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


@pytest.mark.parametrize("preset,sizes,model", [
    ("3d", {"tp": 2, "cp": 1, "ep": 1, "dp": -1, "pp": 2}, "tiny"),
    ("4d", {"tp": 2, "cp": 2, "ep": 1, "dp": -1, "pp": 2}, "tiny"),
    ("5d-moe", {"tp": 2, "cp": 1, "ep": 2, "dp": -1, "pp": 2}, "tiny-moe"),
])
def test_layout_presets_compose_and_validate_at_eight_ranks(make_config, pm, preset, sizes, model):
    from hpctrain.config.validate import validate

    cfg = make_config(f"parallel={preset}")
    assert {a: cfg.parallel[a] for a in sizes} == sizes
    assert cfg.parallel.zero.stage == 1 and cfg.parallel.pipeline.schedule == "1f1b"
    assert cfg.model.name == model
    assert validate(cfg, 8, pm) == []
    if preset == "5d-moe":  # a model= on the command line still wins over the preset's
        assert make_config(f"parallel={preset}", "model=tiny").model.name == "tiny"


def test_optim_outer_names_the_outer_optimizer_and_its_fields_stay_settable(pm):
    """``optim.outer=diloco`` (the issue's spelling) selects the outer optimizer
    while ``optim.outer.every=4`` sets a field of the same section, in either order."""
    from hpctrain.config import compose_resolved
    from hpctrain.config.store import expand_shorthands

    for overrides in (["optim.outer=diloco", "optim.outer.every=4"], ["optim.outer.every=4", "optim.outer=diloco"]):
        outer = compose_resolved(overrides, pm).optim.outer
        assert (outer.name, outer.every, outer.lr, outer.nesterov) == ("diloco", 4, 0.7, True)
    assert compose_resolved([], pm).optim.outer.name == "none"
    assert expand_shorthands(["optim.outer=none,diloco", "optim.outer.lr=1", "+x=1"]) == \
        ["optim.outer.name=none,diloco", "optim.outer.lr=1", "+x=1"]


def test_the_same_plugins_are_registered_once_and_new_ones_again(pm, monkeypatch):
    """Registration (the slowest part of a composition) is skipped for the
    plugins the ConfigStore already holds, and done again when they change."""
    from hydra.core.config_store import ConfigStore

    from hpctrain import hookimpl

    compose(["model=tiny"], pm)
    stored = []
    real = ConfigStore.store

    def counting(self, *args, **kwargs):
        stored.append(kwargs.get("name"))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(ConfigStore, "store", counting)
    assert compose(["model=tiny"], pm).model.name == "tiny"
    assert stored == []

    @dataclasses.dataclass
    class Late:
        every: int = 4

    class LatePlugin:
        @hookimpl
        def hpctrain_config_sections(self):
            return {"late": Late}

    pm.register(LatePlugin())
    assert compose(["late.every=6"], pm).late.every == 6
    assert "train_schema" in stored


def test_typing_a_config_leaves_the_schema_defaults_alone(pm):
    from hpctrain.config.store import to_config

    default = to_config({}, pm).trainer.steps
    changed = to_config({"trainer": {"steps": default + 5}}, pm)
    changed.trainer.seed = 123
    assert changed.trainer.steps == default + 5
    again = to_config({}, pm)
    assert again.trainer.steps == default and again.trainer.seed != 123


@pytest.mark.parametrize("section", [{"every": 3}, 3])
def test_a_section_that_is_no_dataclass_is_named(section):
    """Also one that cannot be a key of the schemas built so far (a dict)."""
    from hpctrain import hookimpl
    from hpctrain.errors import PluginError
    from hpctrain.plugins import create_manager

    class Plugin:
        @hookimpl
        def hpctrain_config_sections(self):
            return {"extra": section}

    pm = create_manager(load_entry_points=False)
    pm.register(Plugin())
    with pytest.raises(PluginError, match="config section 'extra' must be a dataclass"):
        build_schema(pm)


def test_compose_agreed_alone_is_compose_resolved_with_its_errors_as_config_errors(pm):
    from omegaconf import OmegaConf

    from hpctrain.config import compose_agreed, compose_resolved
    from hpctrain.errors import ConfigError

    got = compose_agreed(["model=tiny", "trainer.seed=5"], pm)
    assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(compose_resolved(["model=tiny", "trainer.seed=5"], pm))
    with pytest.raises(ConfigError, match="trainer.no_such_key"):
        compose_agreed(["trainer.no_such_key=1"], pm)
