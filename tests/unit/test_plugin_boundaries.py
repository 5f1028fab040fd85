"""Plugins know only the core: read every plugin package's source (AST) and
fail on

- an import of another plugin's package;
- a reference to another plugin's config section (a string such as
  ``"parallel.zero.stage"`` or an attribute chain such as
  ``cfg.parallel.zero.stage``; each plugin's sections are what its
  ``hpctrain_config_sections`` returns);
- a private attribute set on or read from a model object (``setattr(model,
  "_x", ...)``, ``getattr(model, "_x")``, ``model._x = ...``, ``model._x``):
  per-run state lives in the plugin's handle;
- the trainer: a name or argument ``trainer`` (a hook or a checkpointer
  receives the run's ``TrainState``, never the trainer), an import of
  ``hpctrain.train.trainer`` or ``Trainer``/``reference_trainer``. A
  plugin's benchmark modules (``bench.py``, reached through
  ``hpctrain_benchmarks``) are exempt: they drive whole runs as a user's
  script does.

torch's own module storage (``module._parameters``, ``_buffers``,
``_modules``) is torch's API for replacing a parameter, not plugin state.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from hpctrain.config.schema import TrainerConfig

ROOT = Path(__file__).resolve().parents[2] / "plugins"
MODEL_NAMES = {"model", "staged", "module", "block", "chunk", "layer", "part", "m"}
TORCH_STORAGE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
TRAINER_KEYS = {f.name for f in dataclasses.fields(TrainerConfig)}
"""The keys of the config's ``trainer`` section (``cfg.trainer.steps`` reads config, not the trainer)."""
TRAINER_NAMES = {"trainer", "Trainer", "reference_trainer", "prepare_run"}
"""What hands a plugin the trainer (``hpctrain.train.trainer``, ``hpctrain.run``)."""


def plugin_packages() -> Dict[str, Path]:
    """Top-level package name -> its directory, for every plugin in plugins/ (examples too)."""
    found = {p.name: p for p in ROOT.glob("hpctrain_*") if (p / "__init__.py").exists()}
    for example in (ROOT / "examples").glob("*"):
        for pkg in example.glob("hpctrain_*"):
            if (pkg / "__init__.py").exists() and "build" not in pkg.parts:
                found[pkg.name] = pkg
    return found


def sections_by_package(pm) -> Dict[str, List[str]]:
    """The config sections each plugin package registers."""
    out: Dict[str, List[str]] = {}
    for _, plugin in pm.list_name_plugin():
        impl = getattr(plugin, "hpctrain_config_sections", None)
        if impl is None:
            continue
        package = getattr(plugin, "__name__", type(plugin).__module__).split(".")[0]
        out.setdefault(package, []).extend((impl() or {}).keys())
    return out


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_model(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in MODEL_NAMES


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__") and name not in TORCH_STORAGE


def violations(package: str, directory: Path, others: Set[str], foreign_sections: List[Tuple[str, str]]
               ) -> Iterator[str]:
    for path in sorted(directory.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        _mark_parents(tree)
        # module-level string constants (STATE_ATTR = "_hpctrain_x"), so a name stands for its value
        constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                     and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                     for t in n.targets if isinstance(t, ast.Name)}
        where = str(path.relative_to(ROOT.parent)) if ROOT.parent in path.parents else path.name
        if path.name != "bench.py":
            yield from _trainer_uses(tree, where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in others:
                        yield f"{where}:{node.lineno}: imports {alias.name}"
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in others:
                    yield f"{where}:{node.lineno}: imports from {node.module}"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                for section, owner in foreign_sections:
                    if node.value == section or node.value.startswith(section + "."):
                        yield f"{where}:{node.lineno}: names {owner}'s config section {node.value!r}"
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                chain = _dotted(node)
                for section, owner in foreign_sections:
                    if f".{section}." in f".{chain}." and not isinstance(getattr(node, "parent", None), ast.Attribute):
                        yield f"{where}:{node.lineno}: reads {owner}'s config section through {chain}"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("setattr", "getattr")):
                name = node.args[1] if len(node.args) >= 2 else None
                value = name.value if isinstance(name, ast.Constant) else \
                    constants.get(name.id) if isinstance(name, ast.Name) else None
                if _is_model(node.args[0]) and _private(value):
                    yield f"{where}:{node.lineno}: {node.func.id} of private {value!r} on a model"
            if isinstance(node, ast.Attribute) and _is_model(node.value) and _private(node.attr):
                yield f"{where}:{node.lineno}: private attribute {node.attr!r} of a model"


def _trainer_uses(tree: ast.AST, where: str) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "hpctrain.train.trainer":
                yield f"{where}:{node.lineno}: imports from hpctrain.train.trainer"
            for alias in node.names:
                if alias.name in TRAINER_NAMES:
                    yield f"{where}:{node.lineno}: imports {alias.name} (the trainer)"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "hpctrain.train.trainer":
                    yield f"{where}:{node.lineno}: imports hpctrain.train.trainer"
        elif isinstance(node, ast.arg) and node.arg == "trainer":
            yield f"{where}:{node.lineno}: takes the trainer as argument 'trainer'"
        elif isinstance(node, ast.Name) and node.id == "trainer":
            yield f"{where}:{node.lineno}: uses the trainer ('trainer')"
        elif isinstance(node, ast.Attribute) and node.attr == "trainer":
            parent = getattr(node, "parent", None)
            if isinstance(parent, ast.Attribute) and parent.attr in TRAINER_KEYS:
                continue  # <config>.trainer.<key>: the trainer's config section, core keys
            if {"cfg", "config"} & set(_dotted(node).split(".")):
                continue  # cfg.trainer: the section itself
            yield f"{where}:{node.lineno}: reaches the trainer through {_dotted(node)}"


def _mark_parents(tree: ast.AST) -> None:
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]


def test_every_plugin_package_is_found():
    assert {"hpctrain_dp", "hpctrain_zero", "hpctrain_tp", "hpctrain_pp", "hpctrain_moe", "hpctrain_cp",
            "hpctrain_h5ckpt", "hpctrain_comm_mpi", "hpctrain_comm_torch", "hpctrain_comm_hier",
            "hpctrain_example_metrics"} <= set(plugin_packages())


@pytest.mark.parametrize("package", sorted(plugin_packages()))
def test_a_plugin_knows_only_the_core(package, pm):
    packages = plugin_packages()
    others = set(packages) - {package}
    foreign = [(s, owner) for owner, keys in sections_by_package(pm).items() if owner != package for s in keys]
    found = list(violations(package, packages[package], others, foreign))
    assert not found, "\n".join(found)


def test_the_check_catches_each_kind_of_crossing(tmp_path):
    """The rules fire on a plugin written to break each of them."""
    bad = tmp_path / "hpctrain_bad"
    bad.mkdir()
    (bad / "__init__.py").write_text("")
    (bad / "plugin.py").write_text(
        "import hpctrain_zero.plugin\n"
        "STATE = '_hpctrain_zero'\n"
        "from hpctrain_pp.executor import PipelineRunner\n"
        "def f(model, cfg):\n"
        "    setattr(model, '_ties', True)\n"
        "    x = getattr(model, STATE, None)\n"
        "    model._state = 1\n"
        "    stage = cfg.parallel.zero.stage\n"
        "    sel = 'parallel.zero.stage'\n"
        "    keep = model._parameters\n"
        "    steps = cfg.trainer.steps\n"
        "from hpctrain.run import reference_trainer\n"
        "def hpctrain_on_step_end(trainer, step, metrics):\n"
        "    trainer.step = 3\n"
        "def peek(state, cfg):\n"
        "    return state.trainer.step, cfg.trainer.seq_len, state.cfg.trainer\n")
    found = list(violations("hpctrain_bad", bad, {"hpctrain_zero", "hpctrain_pp"},
                            [("parallel.zero", "hpctrain_zero")]))
    text = "\n".join(found)
    for expected in ("imports hpctrain_zero.plugin", "imports from hpctrain_pp.executor", "setattr of private '_ties'",
                     "getattr of private '_hpctrain_zero'", "private attribute '_state'",
                     "reads hpctrain_zero's config section through cfg.parallel.zero.stage",
                     "names hpctrain_zero's config section 'parallel.zero.stage'",
                     "imports reference_trainer (the trainer)", "takes the trainer as argument 'trainer'",
                     "uses the trainer ('trainer')", "reaches the trainer through state.trainer"):
        assert expected in text, text
    assert "_parameters" not in text and "cfg.trainer" not in text
