"""Hydra registration and composition.

The schema is the core dataclasses plus every plugin's typed sections
(``hpctrain_config_sections``), built once per set of sections. It is stored in
Hydra's ConfigStore as ``train_schema`` (the first entry of conf/train.yaml's
defaults) and, per group, as ``<group>/<group>_schema`` (the first default
of each preset YAML), so presets and overrides are type-checked.

The YAML presets ship inside the package (``hpctrain/conf/``, package data,
found through ``importlib.resources``), so a wheel or a container image has
them; set ``HPCTRAIN_CONF_DIR`` to use another directory, or add yours with Hydra's
``--config-dir``.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import pickle
from importlib import resources
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hpctrain.bootstrap import idle_wait
from hpctrain.config import schema as S
from hpctrain.config.explain import explain
from hpctrain.errors import ConfigError, HpctrainError, PluginError
from hpctrain.hf.config import apply_hf_config
from hpctrain.plugins import broke_contract, call_each

CONF_DIR = os.environ.get("HPCTRAIN_CONF_DIR") or str(resources.files("hpctrain") / "conf")

GROUPS: Dict[str, type] = {
    "model": S.ModelConfig,
    "parallel": S.ParallelConfig,
    "comm": S.CommConfig,
    "data": S.DataConfig,
    "optim": S.OptimConfig,
    "trainer": S.TrainerConfig,
    "checkpoint": S.CheckpointConfig,
    "cluster": S.ClusterConfig,
    "reliability": S.ReliabilityConfig,
    "debug": S.DebugConfig,
    "logging": S.LoggingConfig,
    "finetune": S.FinetuneConfig,
    "report": S.ReportConfig,
}


def _extend(cls: type, name: str, section: type) -> type:
    """A subclass of dataclass ``cls`` with one more field ``name: section``."""
    return dataclasses.make_dataclass(
        cls.__name__, [(name, section, dataclasses.field(default_factory=section))], bases=(cls,)
    )


def _sections(pm) -> Tuple[Tuple[str, str, Any], ...]:
    """Every plugin's (plugin name, key, section), in hook order (the schema's inputs)."""
    if pm is None:
        return ()

    out = []
    for plugin, sections in call_each(pm, "hpctrain_config_sections"):
        if not isinstance(sections or {}, dict):
            raise broke_contract(plugin, "hpctrain_config_sections", sections, "a dict of key -> dataclass")
        out += [(plugin, key, section) for key, section in (sections or {}).items()]
    return tuple(out)


_schemas: Dict[Tuple[Tuple[str, str, Any], ...], Tuple[type, Dict[str, type]]] = {}
"""build_schema's results per plugin section set: one schema class per set, so
registration and ``to_config`` can tell it is the one they already hold."""


def build_schema(pm=None) -> Tuple[type, Dict[str, type]]:
    """(top-level schema, group name -> group schema) with plugin sections folded in.
    The classes are shared by every call with the same sections: never change them."""
    sections = _sections(pm)
    try:
        known = sections in _schemas
    except TypeError:  # a section that is no class at all: _make_schema says which
        return _make_schema(sections)
    if not known:
        _schemas[sections] = _make_schema(sections)
    top, groups = _schemas[sections]
    return top, dict(groups)


def _check_section(plugin: str, key: str, section: Any, owner: Dict[str, str]) -> None:
    """A plugin's section: a dataclass that can be made from its defaults, under a key no one else has."""
    def refuse(problem: str) -> PluginError:
        return PluginError(f"plugin {plugin!r}: config section {key!r} {problem}; fix the plugin, or block it "
                           f"with HPCTRAIN_DISABLE_PLUGINS={plugin}")

    if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
        raise refuse(f"must be a dataclass, got {section!r}")
    parts = key.split(".")
    if not (len(parts) == 1 or (len(parts) == 2 and parts[0] in GROUPS)):
        raise refuse("must be 'name' or '<core group>.name'")
    if len(parts) == 1 and (key in GROUPS or key in ("run_dir", "hydra")):
        raise refuse("has the name of a core group or key")
    if len(parts) == 2 and parts[1] in {f.name for f in dataclasses.fields(GROUPS[parts[0]])}:
        raise refuse(f"is a core key ({key} is in the core's {GROUPS[parts[0]].__name__}); choose another name")
    if key in owner:
        raise refuse(f"is declared by plugin {owner[key]!r} too; rename one of them")
    try:
        section()
    except TypeError as e:
        raise refuse(f"cannot be made from its defaults ({e}); give every field a default "
                     "(omegaconf.MISSING for one the user must set)") from e
    owner[key] = plugin


def _make_schema(sections: Tuple[Tuple[str, str, Any], ...]) -> Tuple[type, Dict[str, type]]:
    groups = dict(GROUPS)
    extra_top: List[Tuple[str, type]] = []
    owner: Dict[str, str] = {}
    for plugin, key, section in sections:
        _check_section(plugin, key, section, owner)
        parts = key.split(".")
        if len(parts) == 1:
            extra_top.append((parts[0], section))
        else:
            groups[parts[0]] = _extend(groups[parts[0]], parts[1], section)
    top = dataclasses.make_dataclass(
        "TrainConfig",
        [(g, cls, dataclasses.field(default_factory=cls)) for g, cls in groups.items()]
        + [(n, c, dataclasses.field(default_factory=c)) for n, c in extra_top]
        + [("run_dir", Optional[str], None)],
    )
    return top, groups


_registered: Optional[Tuple[Any, ...]] = None
"""What the ConfigStore last received from ``register_configs``: (store, schema,
plugins). Storing is the slowest part of a composition (every dataclass becomes
a config node), and a job composes many times with the same plugins (the
planner, a tune, every test), so the same registration is not repeated."""


def register_configs(pm=None) -> type:
    """Store the schema (and plugin presets) in Hydra's ConfigStore; returns the schema.
    A repeat for the manager (same plugins) the store last received is skipped: code
    that overwrites or removes these entries inside the store must store them again
    itself (nothing in hpctrain does)."""
    global _registered

    cs = ConfigStore.instance()
    top, groups = build_schema(pm)
    key = (cs, top, None if pm is None else frozenset(pm.get_plugins()))
    if _registered == key:
        return top
    _registered = None  # (a failing plugin hook below leaves nothing remembered)
    _COMPOSED.clear()  # (compositions of what the store held before)
    cs.store(name="train_schema", node=top)
    for group, cls in groups.items():
        cs.store(group=group, name=f"{group}_schema", node=cls)
    if pm is not None:
        stored: Dict[Tuple[Optional[str], str], str] = {}
        call_each(pm, "hpctrain_register_configs",
                  per_plugin=lambda plugin: {"config_store": _PluginStore(cs, stored, plugin)})
    _registered = key
    return top


class _PluginStore:
    """The ConfigStore as each plugin's ``hpctrain_register_configs`` sees it: a
    preset another plugin stored under the same group and name is refused
    (the later one would silently win, in install order)."""

    def __init__(self, store: Any, stored: Dict[Tuple[Optional[str], str], str], plugin: str):
        self._store, self._stored, self.plugin = store, stored, plugin

    def store(self, name: str, node: Any, group: Optional[str] = None, **kwargs: Any) -> None:
        where = (group, str(name).removesuffix(".yaml"))
        owner = self._stored.setdefault(where, self.plugin)
        if owner != self.plugin:
            shown = f"{group}={where[1]}" if group else where[1]
            raise PluginError(f"plugins {owner!r} and {self.plugin!r} both store the preset {shown}; the one used "
                              "would depend on the order they were installed in; rename one, or block one with "
                              "HPCTRAIN_DISABLE_PLUGINS=<name>")
        self._store.store(name=name, node=node, group=group, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._store, attr)


SHORTHANDS: Dict[str, str] = {"optim.outer": "optim.outer.name"}
"""Keys that name a section's choice on the command line: ``optim.outer=diloco``
sets ``optim.outer.name`` while ``optim.outer.every=4`` sets a field of the
same section (a config node cannot be both a string and a mapping)."""


def expand_shorthands(overrides: Sequence[str]) -> List[str]:
    """``overrides`` with each shorthand key (``SHORTHANDS``) spelt in full."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        full = SHORTHANDS.get(key.lstrip("+~")) if eq else None
        out.append(f"{key[:len(key) - len(key.lstrip('+~'))]}{full}={value}" if full else o)
    return out


def compose(overrides: Sequence[str] = (), pm=None, config_name: str = "train") -> DictConfig:
    """Compose the run config without starting an app (tests, planner, tools).

    Hydra reads, copies and merges every preset and schema node at each
    composition (0.3-0.5 s), and a process that composes many configs (the
    tests, the planner, ``hpctrain-tune``) mostly changes values, not presets.
    So Hydra composes the overrides that choose presets, once per choice in a
    process (``_COMPOSED``), and the overrides of dotted keys are applied to a
    copy by Hydra's own last step of a composition (Hydra too applies them
    after composing, in command-line order), with the same errors. A command
    line with an override Hydra applies in order with those (``trainer={...}``,
    an undotted key that is no group) or of Hydra's own keys (``hydra.*``: the
    search path, the environment) is composed by Hydra whole, every time.
    Presets are read once per process: one stored again under the same name
    in the ConfigStore, or edited on disk, is not seen by later compositions."""
    register_configs(pm)
    full = expand_shorthands(overrides)
    parsed = OverridesParser.create().parse_overrides(full)
    groups = _group_names()
    if not all(_sets_a_value(o) or _chooses_a_preset(o, groups) for o in parsed):
        return _hydra_compose(full, config_name)
    values: List[Any] = []
    choices: List[Any] = []
    for o in parsed:
        (values if _sets_a_value(o) else choices).append(o)
    key = (_registered, config_name, tuple(str(o.input_line) for o in choices))
    if key not in _COMPOSED:
        if len(_COMPOSED) >= _COMPOSED_KEPT:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        _COMPOSED[key] = _hydra_compose(list(key[2]), config_name)
    cfg = copy.deepcopy(_COMPOSED[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as e:  # as Hydra's composition raises it
        raise ConfigCompositionException() from e
    return cfg


_COMPOSED: Dict[Tuple[Any, ...], DictConfig] = {}
"""Hydra's compositions by (registration, config name, overrides choosing presets),
oldest first; never changed (``compose`` returns copies)."""

_COMPOSED_KEPT = 64
"""How many compositions ``_COMPOSED`` keeps (the 2-rank test session chooses presets 9 ways)."""


def _sets_a_value(override: Any) -> bool:
    """Whether Hydra applies ``override`` to the composed config (a dotted key of the
    run config: set, added, deleted) rather than to the choice of presets."""
    key = override.key_or_group
    return ("." in key and not key.startswith("hydra.") and override.package is None
            and not override.is_sweep_override())


def _chooses_a_preset(override: Any, groups: frozenset) -> bool:
    """Whether ``override`` names a preset of a config group (``model=tiny``,
    ``+experiment=x``, ``~model``): Hydra reads these to choose what to compose."""
    return (override.key_or_group in groups and override.package is None and not override.is_sweep_override()
            and (override.is_delete() or isinstance(override.value(), str)))


def _group_names() -> frozenset:
    """The config groups a composition can choose from: the preset directories and
    the groups in Hydra's ConfigStore (the schema's, the plugins')."""
    found = {d for d in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, d))}
    found.update(name for name, node in ConfigStore.instance().repo.items() if isinstance(node, dict))
    return frozenset(found)


def _hydra_compose(overrides: List[str], config_name: str) -> DictConfig:
    """Hydra's own composition of all of ``overrides`` (its compose API)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


def compose_resolved(overrides: Sequence[str] = (), pm=None) -> DictConfig:
    """The typed, resolved run config for ``overrides``: what every rank of a
    job receives from rank 0 (tests, benchmarks, tools). A composition error
    (a value of the wrong type, an unknown key or preset) is a ConfigError
    with the one line ``hpctrain-train`` prints for it."""
    try:
        cfg = to_config(OmegaConf.to_container(compose(list(overrides), pm=pm), resolve=True), pm)
        # model.hf_dir's shape, as hpctrain-train fills it (validation reports problems)
        apply_hf_config(cfg, [o.lstrip("+").split("=", 1)[0] for o in overrides])
        return cfg
    except ConfigError:
        raise
    except Exception as e:
        _reraise_explained(e, pm)
        raise


def compose_agreed(overrides: Sequence[str], pm, mpi_comm: Any = None) -> DictConfig:
    """``compose_resolved`` on rank 0 of ``mpi_comm`` (an mpi4py communicator;
    None: this process alone), its result on every rank, as a job's ranks
    receive it: the ranks cannot disagree, and the others skip Hydra's
    composition (most of its cost), waiting with sleeps (``idle_wait``) so
    ranks sharing cores leave them to rank 0. Collective. A composition
    error (``HpctrainError``) is raised as a ConfigError with its message on
    every rank; any other failure is raised on rank 0 and as a RuntimeError
    naming it on the others, so none waits for a config that never comes."""
    many = mpi_comm is not None and mpi_comm.Get_size() > 1
    cfg: Optional[DictConfig] = None
    failure: Optional[BaseException] = None
    message: Any = None
    if not many or mpi_comm.Get_rank() == 0:
        try:
            cfg = compose_resolved(overrides, pm)
            # pickled here, so a value that cannot be (a plugin's Enum defined in a function)
            # fails inside this try and reaches every rank; plain containers are cheaper to
            # send and to type than YAML
            message = ("ok", pickle.dumps(OmegaConf.to_container(cfg, resolve=True)) if many else None)
        except HpctrainError as e:
            failure, message = e, ("error", str(e))
        except BaseException as e:  # noqa: BLE001 - raised again below, after the others hear of it
            failure, message = e, ("failed", f"{type(e).__name__}: {e}")
    if many:
        idle_wait(mpi_comm)
        message = mpi_comm.bcast(message, root=0)
    kind, payload = message
    if kind == "error":
        raise ConfigError(payload) from failure
    if failure is not None:
        raise failure
    if kind == "failed":
        raise RuntimeError(f"rank 0 could not compose the config: {payload}")
    return cfg if cfg is not None else to_config(pickle.loads(payload), pm)


def explain_error(e: BaseException, pm=None) -> Optional[str]:
    """The one ``hpctrain: error:`` line for a composition error ``e`` against the
    schema of ``pm``'s plugins (``config.explain``), or None if it is not one."""
    return explain(e, build_schema(pm)[0])


def _reraise_explained(e: Exception, pm) -> None:
    """Raise ``e`` as a ConfigError when it is a composition error; else return."""
    message = explain_error(e, pm)
    if message is not None:
        raise ConfigError(message) from e


RESOLVED_FILE = "resolved_config.yaml"
"""In a run directory, beside ``.hydra/``: the config the run trained with, as
every rank received it. ``.hydra/config.yaml`` is Hydra's composition, written
before ``model.vocab_size=auto`` and ``model.hf_dir``'s shape are filled in."""


def run_config_path(run_dir: str) -> Optional[str]:
    """The config a run trained with (``RESOLVED_FILE``; Hydra's for runs older
    than it), or None when the directory holds neither."""
    for path in (os.path.join(run_dir, RESOLVED_FILE), os.path.join(run_dir, ".hydra", "config.yaml")):
        if os.path.isfile(path):
            return path
    return None


def to_config(data: Any, pm=None) -> DictConfig:
    """A typed DictConfig from a plain dict or YAML string (rank 0's resolved
    config, as received by the other ranks)."""
    base = _structured(build_schema(pm)[0])
    # (casts: OmegaConf types create() and merge() for lists too; a config is a mapping)
    raw = cast(DictConfig, OmegaConf.create(data) if isinstance(data, str) else OmegaConf.create(dict(data)))
    if "hydra" in raw:
        raw.pop("hydra")
    try:
        cfg = cast(DictConfig, OmegaConf.merge(base, raw))  # (a copy: merge leaves base as it is)
    except Exception as e:  # a key Hydra let through (+trainer.newkey=1): the same one line on every rank
        _reraise_explained(e, pm)
        raise
    OmegaConf.set_readonly(cfg, False)
    return cfg


_bases: Dict[type, DictConfig] = {}


def _structured(top: type) -> DictConfig:
    """The defaults of schema ``top`` as a config, built once per schema (never
    changed: ``to_config`` merges into a copy)."""
    if top not in _bases:
        _bases[top] = OmegaConf.structured(top)
    return _bases[top]
