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
from typing import Any, Dict, List, Optional, cast

import pluggy
from omegaconf import OmegaConf

from hpctrain import hookspecs
from hpctrain.errors import PluginError
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
    """A fresh manager with the specs and (by default) every installed plugin."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    blocked = blocked_names()
    for name in blocked:
        pm.set_blocked(name)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as e:  # a broken third-party plugin must not look like our bug
            raise PluginError(f"loading an '{ENTRY_POINT_GROUP}' entry point failed: {e}; "
                              f"block it with {DISABLE_ENV}=<name> or fix its installation") from e
        known = {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
        for name in blocked:
            if name not in known:
                get_logger(__name__).warning("%s names %r, which is not an installed plugin (installed: %s)",
                                             DISABLE_ENV, name, ", ".join(sorted(known)))
    pm.check_pending()
    return pm


def get_manager() -> pluggy.PluginManager:
    """The process-wide manager (created on first use)."""
    global _manager
    if _manager is None:
        _manager = create_manager()
    return _manager


def capabilities(pm: pluggy.PluginManager) -> Dict[str, List[str]]:
    """Every name served, by kind, over all loaded plugins."""
    merged: Dict[str, List[str]] = {}
    for caps in pm.hook.hpctrain_capabilities():
        for kind, names in (caps or {}).items():
            merged.setdefault(kind, [])
            merged[kind] += [n for n in names if n not in merged[kind]]
    return merged


def describe(pm: pluggy.PluginManager) -> List[PluginInfo]:
    dists = {id(p): d for p, d in pm.list_plugin_distinfo()}
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        dist = dists.get(id(plugin))
        caps: Dict[str, List[str]] = {}
        impl = getattr(plugin, "hpctrain_capabilities", None)
        if impl is not None:
            caps = impl() or {}
        out.append(PluginInfo(
            name=name,
            module=getattr(plugin, "__name__", type(plugin).__name__),
            distribution=dist.project_name if dist else "-",
            version=dist.version if dist else "-",
            capabilities=caps,
        ))
    return sorted(out, key=lambda p: p.name)


def axis_plugins(pm: pluggy.PluginManager) -> Dict[str, List[str]]:
    """{axis: names of the plugins whose capabilities list it under ``parallel``}."""
    out: Dict[str, List[str]] = {}
    for name, plugin in pm.list_name_plugin():
        impl = getattr(plugin, "hpctrain_capabilities", None) if plugin is not None else None
        if impl is None:
            continue
        for axis in (impl() or {}).get("parallel", []):
            out.setdefault(axis, []).append(name)
    return out


def axis_claims(pm: pluggy.PluginManager, cfg: Any, axis: str) -> Dict[str, Optional[bool]]:
    """{plugin name: its ``hpctrain_claim_axis`` answer} (plugins without the hook are absent)."""
    out: Dict[str, Optional[bool]] = {}
    for impl in pm.hook.hpctrain_claim_axis.get_hookimpls():
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
