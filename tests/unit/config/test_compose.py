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


SAME_AS_HYDRA = [
    [],
    ["model=tiny-moe", "model.moe.num_experts=8", "parallel.ep=2", "trainer.steps=3"],
    ["trainer.steps=3", "model=llama3-8b", "model.n_layers=2"],  # a value before the preset it changes
    ["experiment=tiny_long", "trainer.steps=7"],  # a preset of the whole config, then a value it set
    ["optim=muon", "optim.outer=diloco", "optim.outer.every=4"],  # the shorthand spells a value
    ["parallel=3d", "parallel.tp=1", "comm=mpi"],  # a plugin's preset
    ["++trainer.steps=9", "+trainer.newkey=1", "trainer.seq_len=${trainer.micro_batch_size}"],
    ["hydra.job.name=x", "trainer.steps=2"],  # Hydra's own keys compose through Hydra
    ["trainer.steps=3", "trainer={steps:5}"],  # a section set whole is applied in order with the values
    ["model.n_layers=3", "model=tiny", "model={n_layers:4}"],
]


@pytest.mark.parametrize("overrides", SAME_AS_HYDRA, ids=lambda o: " ".join(o) or "defaults")
def test_compose_gives_what_hydra_composes_from_the_whole_command_line(pm, overrides):
    """``compose`` keeps Hydra's composition per choice of presets and sets the values
    on a copy: the config must be the one Hydra composes from every override at once."""
    from omegaconf import OmegaConf

    from hpctrain.config.store import _hydra_compose, expand_shorthands

    ours = compose(overrides, pm)
    compose(["model=tiny", "trainer.steps=1"], pm)  # other compositions in between
    again = compose(overrides, pm)
    hydras = _hydra_compose(expand_shorthands(overrides), "train")
    for cfg in (ours, again):
        assert OmegaConf.to_container(cfg) == OmegaConf.to_container(hydras)
        assert OmegaConf.is_struct(cfg) and OmegaConf.is_struct(hydras)


BAD_LIKE_HYDRA = [
    ["trainer.steps=many"],
    ["model=tiny", "trainer.stepz=5"],
    ["model=gpt5"],
    ["+trainer.steps=3"],  # an addition where a value is
    ["~trainer.nokey"],
    ["~trainer.seed"],  # a deletion from a typed section
    ["optim.lr=1e-3,1e-2"],  # a sweep outside --multirun
    ["trainer.steps=[1"],  # does not parse
    ["trainer.stepz=5", "nokey=1"],  # the first of two problems is the one named
    ["trainer.steps=many", "+run_dir={a:1}"],
    ["foo.a=2", "+foo={a:1}"],
]


@pytest.mark.parametrize("overrides", BAD_LIKE_HYDRA, ids=lambda o: " ".join(o))
def test_a_bad_override_fails_as_in_hydras_composition(pm, overrides):
    """The same exception and the same ``hpctrain: error:`` line (``explain``)."""
    from hpctrain.config.store import _hydra_compose, expand_shorthands, explain_error

    with pytest.raises(Exception) as ours:
        compose(overrides, pm)
    with pytest.raises(Exception) as hydras:
        _hydra_compose(expand_shorthands(overrides), "train")
    assert type(ours.value) is type(hydras.value)
    assert explain_error(ours.value, pm) == explain_error(hydras.value, pm) is not None


def test_hydra_composes_once_per_choice_of_presets_and_each_config_is_a_copy(pm, monkeypatch):
    from hpctrain.config import store

    calls = []
    real = store._hydra_compose
    monkeypatch.setattr(store, "_hydra_compose", lambda o, n: calls.append(list(o)) or real(o, n))
    store._COMPOSED.clear()
    first = compose(["model=tiny", "trainer.steps=3"], pm)
    first.trainer.seed = 99
    second = compose(["model=tiny", "trainer.steps=4", "optim.lr=0.01"], pm)
    assert calls == [["model=tiny"]]
    assert (second.trainer.steps, second.optim.lr) == (4, 0.01) and second.trainer.seed != 99
    compose(["model=tiny-moe", "trainer.steps=3"], pm)
    assert calls == [["model=tiny"], ["model=tiny-moe"]]
