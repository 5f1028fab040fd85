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
from typing import Dict, List, Optional

import pluggy

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


def set_manager(pm: Optional[pluggy.PluginManager]) -> None:
    """Replace the process-wide manager (tests register plugins by hand)."""
    global _manager
    _manager = pm


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
        caps = {}
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


def require(pm: pluggy.PluginManager, kind: str, name: str, config_key: str) -> None:
    """Raise a PluginError naming the options if no plugin serves ``name``."""
    served = capabilities(pm).get(kind, [])
    if name not in served:
        blocked = blocked_names()
        hint = f" (blocked by {DISABLE_ENV}: {', '.join(blocked)})" if blocked else ""
        raise PluginError(
            f"{config_key}={name!r} is not provided by any installed plugin{hint}; "
            f"choose one of: {', '.join(served) or '(none installed)'}, or install the plugin that provides it"
        )
