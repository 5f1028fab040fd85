"""A broken plugin is one ``hpctrain: error:`` line naming the plugin and the fix, exit status 2, never a
bare traceback: one that cannot be imported, misspells a hook or its arguments, shares its entry-point name
with another distribution, declares a config section someone else has, raises in a hook, or answers a hook
with the wrong type. The installed plugins are real distributions (a dist-info directory with its
entry_points.txt on sys.path), found by importlib.metadata as pip-installed ones are."""
import importlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from hpctrain import hookimpl
from hpctrain.config import compose_resolved
from hpctrain.config.store import build_schema
from hpctrain.config.validate import validate
from hpctrain.errors import PluginError
from hpctrain.plugins import capabilities, create_manager, describe


def _install(site, dist: str, name: str, code: str, version: str = "0.0.1") -> None:
    """A distribution ``dist`` whose module ``<dist>_plugin`` is the hpctrain plugin ``name``."""
    module = dist.replace("-", "_") + "_plugin"
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[hpctrain]\n{name} = {module}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [m for m in sys.modules if m.endswith("_plugin") and m.startswith("hpw_")]:
        del sys.modules[name]


GOOD = """
    from hpctrain import hookimpl

    @hookimpl
    def hpctrain_capabilities():
        return {"logging.backend": ["mine"]}
"""

LOADING = {
    "import-error": ("raise RuntimeError('boom at import')",
                     "plugin 'broken' (hpw_broken_plugin) cannot be imported: RuntimeError: boom at import; "
                     "fix or reinstall hpw-broken 0.0.1, or block it with HPCTRAIN_DISABLE_PLUGINS=broken"),
    "misspelt-hook": ("from hpctrain import hookimpl\n\n@hookimpl\ndef hpctrain_on_stepend(state, step):\n"
                      "    pass\n",
                      "plugin 'broken': unknown hook 'hpctrain_on_stepend' in plugin"),
    "wrong-argument": ("from hpctrain import hookimpl\n\n@hookimpl\ndef hpctrain_on_step_end(state, step_num):\n"
                       "    pass\n",
                       "plugin 'broken': Plugin 'broken' for hook 'hpctrain_on_step_end'"),
}


@pytest.mark.parametrize("case", list(LOADING))
def test_a_plugin_that_cannot_load_is_named(site, case):
    code, message = LOADING[case]
    _install(site, "hpw-broken", "broken", code)
    with pytest.raises(PluginError) as e:
        create_manager()
    assert str(e.value).startswith(message), str(e.value)
    assert "HPCTRAIN_DISABLE_PLUGINS=broken" in str(e.value)


def test_blocking_the_broken_plugin_is_the_way_out(site, monkeypatch):
    _install(site, "hpw-broken", "broken", LOADING["import-error"][0])
    monkeypatch.setenv("HPCTRAIN_DISABLE_PLUGINS", "broken")
    assert "broken" not in {p.name for p in describe(create_manager())}


def test_two_distributions_with_one_plugin_name_are_refused(site):
    _install(site, "hpw-first", "mine", GOOD)
    _install(site, "hpw-second", "mine", GOOD, version="2.0")
    with pytest.raises(PluginError, match="two installed distributions register the hpctrain plugin 'mine': "
                                          "hpw-(first 0.0.1|second 2.0) and hpw-(second 2.0|first 0.0.1)"):
        create_manager()


def test_blocking_a_name_two_distributions_use_loads_neither(site, monkeypatch):
    _install(site, "hpw-first", "mine", GOOD)
    _install(site, "hpw-second", "mine", GOOD, version="2.0")
    monkeypatch.setenv("HPCTRAIN_DISABLE_PLUGINS", "mine")
    assert "mine" not in {p.name for p in describe(create_manager())}


def test_an_installed_plugin_is_listed_with_its_distribution(site):
    _install(site, "hpw-good", "mine", GOOD, version="1.2")
    pm = create_manager()
    row = next(p for p in describe(pm) if p.name == "mine")
    assert (row.distribution, row.version, row.capabilities) == ("hpw-good", "1.2", {"logging.backend": ["mine"]})
    assert "mine" in capabilities(pm)["logging.backend"]


def test_the_command_says_it_in_one_line_with_status_2(site):
    _install(site, "hpw-broken", "broken", LOADING["import-error"][0])
    env_path = f"{site}:{':'.join(p for p in sys.path if p)}"
    for args in (["trainer.steps=1"], ["--plugins"]):
        r = subprocess.run([sys.executable, "-m", "hpctrain", *args], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": env_path})
        assert r.returncode == 2 and r.stderr.splitlines() == ["hpctrain: error: " + LOADING["import-error"][1]], \
            r.stderr


# -- contracts of a loaded plugin's hooks (registered in-process: the same manager code) --------------

@dataclass
class Section:
    level: int = 1
    """A field."""


@dataclass
class Required:
    level: int
    """No default: the section cannot be made."""


def _manager(*plugins):
    pm = create_manager()
    for name, plugin in plugins:
        pm.register(plugin, name=name)
    return pm


class Sections:
    def __init__(self, sections):
        self.sections = sections

    @hookimpl
    def hpctrain_config_sections(self):
        return self.sections


SECTIONS = {
    "twice": ([("a", Sections({"logging.mine": Section})), ("b", Sections({"logging.mine": Section}))],
              "plugin 'a': config section 'logging.mine' is declared by plugin 'b' too"),
    "twice-at-the-top": ([("a", Sections({"mine": Section})), ("b", Sections({"mine": Section}))],
                         "config section 'mine' is declared by plugin"),
    "a-core-key": ([("a", Sections({"logging.name": Section}))],
                   "plugin 'a': config section 'logging.name' is a core key (logging.name is in the core's "
                   "LoggingConfig); choose another name"),
    "a-core-group": ([("a", Sections({"trainer": Section}))],
                     "plugin 'a': config section 'trainer' has the name of a core group or key"),
    "the-run-dir": ([("a", Sections({"run_dir": Section}))], "config section 'run_dir' has the name of a core"),
    "no-default": ([("a", Sections({"mine": Required}))],
                   "plugin 'a': config section 'mine' cannot be made from its defaults"),
    "not-a-dataclass": ([("a", Sections({"mine": dict}))], "plugin 'a': config section 'mine' must be a dataclass"),
    "not-a-dict": ([("a", Sections([Section]))], "plugin 'a': hpctrain_config_sections returned list"),
}


@pytest.mark.parametrize("case", list(SECTIONS))
def test_a_config_section_that_cannot_be_is_named(case):
    plugins, message = SECTIONS[case]
    with pytest.raises(PluginError) as e:
        build_schema(_manager(*plugins))
    assert message in str(e.value), str(e.value)


class Capabilities:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def hpctrain_capabilities(self):
        return self.answer


class Validates:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def hpctrain_validate(self, cfg, world_size):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_capabilities_of_the_wrong_type_are_named():
    pm = _manager(("caps", Capabilities(["observer"])))
    with pytest.raises(PluginError, match="plugin 'caps': hpctrain_capabilities returned list"):
        capabilities(pm)


@pytest.mark.parametrize("answer,message", [
    ("set foo.bar", "plugin 'checks': hpctrain_validate returned str 'set foo.bar', not a list of problems"),
    (RuntimeError("boom"), "plugin 'checks' raised in hpctrain_validate: RuntimeError: boom; fix the plugin"),
])
def test_a_validate_hook_that_breaks_its_contract_is_named(answer, message):
    pm = _manager(("checks", Validates(answer)))
    with pytest.raises(PluginError, match=message):
        validate(compose_resolved([], pm), 1, pm)


def test_a_validate_hooks_problems_are_reported():
    pm = _manager(("checks", Validates(["mine.level=0: must be >= 1"])))
    assert validate(compose_resolved([], pm), 1, pm) == ["mine.level=0: must be >= 1"]


def test_a_plugins_optimizer_under_zero_is_refused_before_the_run():
    """ZeRO builds the optimizer of its flat shards itself (the core's four); a plugin's optimizer with it
    used to pass validation and fail on every rank when the shards' optimizer was made."""
    pm = _manager(("signsgd", Capabilities({"optim": ["signsgd"]})))
    base = ["optim.name=signsgd", "parallel.dp=2", "trainer.global_batch_size=8"]
    assert validate(compose_resolved(base, pm), 2, pm) == []
    problems = validate(compose_resolved(base + ["parallel.zero.stage=1"], pm), 2, pm)
    assert problems == ["optim.name='signsgd' (a plugin's optimizer) with parallel.zero.stage=1: ZeRO builds the "
                        "optimizer of its shards itself and knows adamw, lamb, lars, muon; use one of those, or "
                        "parallel.zero.stage=0 (the plugin's optimizer over whole tensors)"]


def test_one_name_served_by_two_plugins_is_refused():
    pm = _manager(("a", Capabilities({"logging.backend": ["mine"]})),
                  ("b", Capabilities({"logging.backend": ["mine"]})))
    with pytest.raises(PluginError, match="plugins '[ab]' and '[ab]' both serve logging.backend 'mine'"):
        capabilities(pm)


class MakesLogger:
    @hookimpl
    def hpctrain_capabilities(self):
        return {"logging.backend": ["mine"]}

    @hookimpl
    def hpctrain_make_logger(self, name, cfg, run_dir):
        return object() if name == "mine" else None


def test_a_logger_without_its_methods_is_named_and_the_others_closed(tmp_path):
    from hpctrain.errors import ConfigError
    from hpctrain.train.loggers import open_loggers

    pm = _manager(("mine", MakesLogger()))
    cfg = compose_resolved(["logging.backends=[jsonl,mine]"], pm)
    with pytest.raises(ConfigError, match="the 'mine' logger its plugin made has no log, flush, close method"):
        open_loggers(cfg, pm, str(tmp_path))


def test_a_plugin_optimizer_that_is_not_made_is_named():
    from types import SimpleNamespace

    from hpctrain.optimizers.build import build_optimizer

    with pytest.raises(PluginError, match="optim.name='myopt': the plugin that lists it under 'optim'"):
        build_optimizer([], SimpleNamespace(name="myopt"), None)


class StoresPreset:
    @hookimpl
    def hpctrain_register_configs(self, config_store):
        config_store.store(group="optim", name="test_twice", node={"name": "adamw"})


def test_one_preset_stored_by_two_plugins_is_refused():
    from hydra.core.config_store import ConfigStore

    from hpctrain.config.store import register_configs

    try:
        with pytest.raises(PluginError, match="plugins '[ab]' and '[ab]' both store the preset optim=test_twice; the "
                                              "one used would depend on the order they were installed in"):
            register_configs(_manager(("a", StoresPreset()), ("b", StoresPreset())))
    finally:  # (the first plugin's preset reached the process-wide store)
        ConfigStore.instance().repo["optim"].pop("test_twice.yaml", None)
