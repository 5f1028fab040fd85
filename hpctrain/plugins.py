"""The plugin manager: loads the ``hpctrain`` entry-point group.

Built-in plugins (``plugins/hpctrain_*``) register through our own
pyproject's entry points, exactly as a third-party package does. Set
``HPCTRAIN_DISABLE_PLUGINS=name1,name2`` to block plugins by entry-point name
(for example to replace a built-in backend with your own).
"""
from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import pluggy
from omegaconf import OmegaConf

from hpctrain import hookspecs
from hpctrain.errors import HpctrainError, PluginError
from hpctrain.hf import source as hf_source
from hpctrain.log import get_logger

ENTRY_POINT_GROUP = "hpctrain"
DISABLE_ENV = "HPCTRAIN_DISABLE_PLUGINS"

_manager: Optional[pluggy.PluginManager] = None


@dataclass
class PluginInfo:
    name: str
    module: str
    distribution: str
    version: str
    capabilities: Dict[str, List[str]]


def blocked_names() -> List[str]:
    return [n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()]


def blocked_hint() -> str:
    """'' unless ``HPCTRAIN_DISABLE_PLUGINS`` blocks an installed plugin; else
    a clause naming the variable, what it blocks and how to unblock. Every
    message about something no plugin provides ends with it: a blocked
    plugin is invisible (its capabilities, axes and config keys are gone), so
    without it the user is told to install what is installed."""
    installed = {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
    blocked = [n for n in blocked_names() if n in installed]
    if not blocked:
        return ""
    return (f"blocked by {DISABLE_ENV}: {', '.join(blocked)}; to unblock, unset {DISABLE_ENV} "
            "or remove the plugin's name from it")


def create_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the specs and (by default) every installed plugin.

    A plugin that cannot be loaded (its import raises, a hook function with a
    misspelt name or argument, an entry-point name two distributions use) is
    a PluginError naming it and the fix, never a bare traceback."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = blocked_names()
    for name in blocked:
        pm.set_blocked(name)
    if not pm.is_blocked(hf_source.NAME):
        pm.register(hf_source, name=hf_source.NAME)  # the core's own weight source (checkpoint.init_from=hf:DIR)
    if load_entry_points:
        _load_installed(pm)
        known = {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
        for name in blocked:
            if name not in known:
                get_logger(__name__).warning("%s names %r, which is not an installed plugin (installed: %s)",
                                             DISABLE_ENV, name, ", ".join(sorted(known)))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        name = pm.get_name(e.plugin) or repr(e.plugin)
        raise PluginError(f"plugin {name!r}: {e}; name each hook function after a hook of hpctrain/hookspecs.py "
                          f"(docs/plugins.md lists them), or block the plugin with {DISABLE_ENV}={name}") from e
    return pm


def _distribution(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"


def installed_entry_points() -> Dict[str, md.EntryPoint]:
    """{entry-point name: its entry point} of the ``hpctrain`` group. Two
    distributions using one name is an error naming both: the plugin loaded
    would otherwise depend on the order of ``sys.path`` (unless the name is
    blocked: neither is loaded)."""
    found: Dict[str, md.EntryPoint] = {}
    blocked = set(blocked_names())
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):  # (one distribution shadowed by another copy: once)
        if ep.name in found and _distribution(found[ep.name]) != _distribution(ep) and ep.name not in blocked:
            raise PluginError(f"two installed distributions register the hpctrain plugin {ep.name!r}: "
                              f"{_distribution(found[ep.name])} and {_distribution(ep)}; uninstall one, or rename "
                              f"its entry point in its pyproject.toml")
        found.setdefault(ep.name, ep)
    return found


def _load_installed(pm: pluggy.PluginManager) -> None:
    for name, ep in installed_entry_points().items():
        if pm.is_blocked(name) or pm.has_plugin(name):
            continue
        fix = f"fix or reinstall {_distribution(ep)}, or block it with {DISABLE_ENV}={name}"
        try:
            plugin = ep.load()
        except Exception as e:  # a broken third-party plugin must not look like our bug
            raise PluginError(f"plugin {name!r} ({ep.value}) cannot be imported: {type(e).__name__}: {e}; "
                              f"{fix}") from e
        try:
            pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:  # a hook function whose arguments no spec has
            raise PluginError(f"plugin {name!r}: {e}; {fix}") from e


def get_manager() -> pluggy.PluginManager:
    """The process-wide manager (created on first use)."""
    global _manager
    if _manager is None:
        _manager = create_manager()
    return _manager


def call_each(pm: pluggy.PluginManager, hook: str, name_errors: bool = True,
              per_plugin: Optional[Callable[[str], Dict[str, Any]]] = None, **kwargs: Any) -> List[Tuple[str, Any]]:
    """[(plugin name, its answer)] of every implementation of ``hook``, in the
    order pluggy calls them (``per_plugin(name)``: arguments of that plugin's
    call on top of ``kwargs``). With ``name_errors``, an exception other than
    hpctrain's own is a PluginError naming the plugin and the hook (a plugin's
    bug is not ours); without, it propagates as raised (a hook inside a step,
    where one rank's exception must end in a traceback and an MPI abort)."""
    out: List[Tuple[str, Any]] = []
    for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            continue
        given = {**kwargs, **(per_plugin(impl.plugin_name) if per_plugin is not None else {})}
        try:
            answer = impl.function(**{a: given[a] for a in impl.argnames})
        except HpctrainError:
            raise
        except Exception as e:
            if not name_errors:
                raise
            raise PluginError(f"plugin {impl.plugin_name!r} raised in {hook}: {type(e).__name__}: {e}; fix the "
                              f"plugin, or block it with {DISABLE_ENV}={impl.plugin_name}") from e
        out.append((impl.plugin_name, answer))
    return out


def broke_contract(plugin: str, hook: str, answer: Any, wanted: str) -> PluginError:
    return PluginError(f"plugin {plugin!r}: {hook} returned {type(answer).__name__} {answer!r:.60}, not {wanted} "
                       f"(hpctrain/hookspecs.py); fix the plugin, or block it with {DISABLE_ENV}={plugin}")


def capabilities_by_plugin(pm: pluggy.PluginManager) -> List[Tuple[str, Dict[str, List[str]]]]:
    """[(plugin name, {kind: names it serves})], each answer checked."""
    out = []
    for plugin, caps in call_each(pm, "hpctrain_capabilities"):
        caps = caps or {}
        if not (isinstance(caps, dict) and all(isinstance(k, str) and isinstance(v, (list, tuple))
                                               and all(isinstance(n, str) for n in v) for k, v in caps.items())):
            raise broke_contract(plugin, "hpctrain_capabilities", caps, "a dict of kind -> list of names")
        out.append((plugin, {k: list(v) for k, v in caps.items()}))
    return out


SHARED_KINDS = ("parallel",)
"""Kinds of capability several plugins may serve under one name: an axis goes
to the plugin the config chooses (``axis_plugin``). Any other name is made by
a first-result hook, so two plugins serving it would leave the choice to the
order they were installed in."""


def capabilities(pm: pluggy.PluginManager) -> Dict[str, List[str]]:
    """Every name served, by kind, over all loaded plugins."""
    merged: Dict[str, List[str]] = {}
    server: Dict[Tuple[str, str], str] = {}
    for plugin, caps in capabilities_by_plugin(pm):
        for kind, names in caps.items():
            merged.setdefault(kind, [])
            for n in names:
                other = server.setdefault((kind, n), plugin)
                if other != plugin and kind not in SHARED_KINDS:
                    raise PluginError(f"plugins {other!r} and {plugin!r} both serve {kind} {n!r}, and which one is "
                                      f"used would depend on the order they were installed in; block one with "
                                      f"{DISABLE_ENV}=<name>")
            merged[kind] += [n for n in names if n not in merged[kind]]
    return merged


def describe(pm: pluggy.PluginManager) -> List[PluginInfo]:
    eps = installed_entry_points()
    served = dict(capabilities_by_plugin(pm))
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        dist = getattr(eps.get(name), "dist", None)
        out.append(PluginInfo(
            name=name,
            module=getattr(plugin, "__name__", type(plugin).__name__),
            distribution=dist.metadata["Name"] if dist is not None else "-",
            version=dist.version if dist is not None else "-",
            capabilities=served.get(name, {}),
        ))
    return sorted(out, key=lambda p: p.name)


def axis_plugins(pm: pluggy.PluginManager) -> Dict[str, List[str]]:
    """{axis: names of the plugins whose capabilities list it under ``parallel``}."""
    served = dict(capabilities_by_plugin(pm))
    out: Dict[str, List[str]] = {}
    for name, _ in pm.list_name_plugin():  # in the order the plugins were registered
        for axis in served.get(name, {}).get("parallel", []):
            out.setdefault(axis, []).append(name)
    return out


def axis_claims(pm: pluggy.PluginManager, cfg: Any, axis: str) -> Dict[str, Optional[bool]]:
    """{plugin name: its ``hpctrain_claim_axis`` answer}, asked only of plugins serving ``axis`` (plugins
    without the hook are absent)."""
    out: Dict[str, Optional[bool]] = {}
    serving = set(axis_plugins(pm).get(axis, []))
    for impl in pm.hook.hpctrain_claim_axis.get_hookimpls():
        if impl.plugin_name not in serving:
            continue
        given = {"axis": axis, "cfg": cfg}
        # pluggy types a hook function's result as object; this spec answers Optional[bool]
        out[impl.plugin_name] = cast(Optional[bool], impl.function(**{a: given[a] for a in impl.argnames}))
    return out


def axis_plugin(pm: pluggy.PluginManager, cfg: Any, axis: str) -> Optional[str]:
    """The plugin that implements ``axis``, decided by the config, never by
    the order plugins happen to be installed in:

    1. ``parallel.impl.<axis>`` when set;
    2. else the one serving plugin that claims the axis for this config
       (``hpctrain_claim_axis`` True, e.g. ZeRO at ``parallel.zero.stage > 0``);
    3. else the one serving plugin that does not decline it (False).

    Two candidates at step 2 or 3 are an error naming both. None when no
    installed plugin serves the axis."""
    served = axis_plugins(pm).get(axis, [])
    chosen = OmegaConf.select(cfg, f"parallel.impl.{axis}", default=None)
    if chosen:
        if chosen not in served:
            raise PluginError(f"parallel.impl.{axis}={chosen!r} is not an installed plugin serving axis {axis!r}; "
                              f"choose one of: {', '.join(served) or '(none installed)'}")
        return str(chosen)
    claims = axis_claims(pm, cfg, axis)
    wanted = [n for n in served if claims.get(n) is True]
    candidates = wanted or [n for n in served if claims.get(n) is not False]
    if len(candidates) > 1:
        how = "claim" if wanted else "parallelise"
        raise PluginError(f"plugins {' and '.join(repr(s) for s in candidates)} both {how} axis {axis!r}; "
                          f"choose one with parallel.impl.{axis}=<name>")
    return candidates[0] if candidates else None


def parallelize_caller(pm: pluggy.PluginManager, name: str):
    """``hpctrain_parallelize`` of plugin ``name`` alone (other plugins' answers are never asked)."""
    others = [p for n, p in pm.list_name_plugin() if n != name and p is not None]
    return pm.subset_hook_caller("hpctrain_parallelize", remove_plugins=others)


def require(pm: pluggy.PluginManager, kind: str, name: str, config_key: str) -> None:
    """Raise a PluginError naming the options if no plugin serves ``name``."""
    served = capabilities(pm).get(kind, [])
    if name not in served:
        hint = blocked_hint()
        options = ", ".join(served) or "(none installed)"
        raise PluginError(
            f"{config_key}={name!r} is not provided by any loaded plugin ({hint}); choose one of: {options}"
            if hint else f"{config_key}={name!r} is not provided by any installed plugin; "
            f"choose one of: {options}, or install the plugin that provides it"
        )
