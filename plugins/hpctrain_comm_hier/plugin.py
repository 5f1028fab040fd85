"""Plugin registration for the hierarchical backend (``comm.backend=hier``).

The intra- and inter-node communicators come from whichever plugins serve
``comm.hier.intra`` and ``comm.hier.inter``, asked through the plugin
manager's ``hpctrain_make_backend`` hook with sub-``Group``s built here from
node membership (``Runtime.rank_nodes``; ``HPCTRAIN_RANKS_PER_NODE=k``
emulates nodes of k ranks). This plugin never imports another one.

Groups whose nodes hold different numbers of their ranks cannot use the
two-level algorithms; ``comm.hier.uneven`` chooses between the flat path (one
communicator over the whole group with the inter backend, logged once) and a
CommError at start-up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

from hpctrain import hookimpl
from hpctrain.plugins import capabilities, get_manager

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.comm.protocol import Communicator
    from hpctrain.mesh import Group

NAME = "hier"
UNEVEN_CHOICES = ("flat", "error")


@dataclass
class HierConfig:
    """Settings of the hierarchical backend."""

    intra: str = "mpi"
    """Backend between ranks of one node (any comm.backend name except hier; auto = nccl on GPU, else mpi)."""
    inter: str = "mpi"
    """Backend between nodes (any comm.backend name except hier; auto as for intra)."""
    uneven: str = "flat"
    """A group with different rank counts on its nodes: flat (one communicator over the group, inter backend)
    or error."""
    check_shapes: bool = False
    """Before each two-level collective, all-gather every rank's element count, dtype and op and raise a
    CommError if they disagree (debugging; sub-backends have their own switch, e.g. comm.mpi.check_shapes)."""


def options(cfg: Any) -> HierConfig:
    """``cfg.comm.hier``, or the defaults when the config was built without this plugin."""
    section = getattr(cfg.comm, "hier", None) if cfg is not None else None
    if section is None:
        return HierConfig()
    return HierConfig(intra=str(section.intra), inter=str(section.inter), uneven=str(section.uneven),
                      check_shapes=bool(section.check_shapes))


def _uses_hier(cfg: Any) -> bool:
    return cfg.comm.backend == NAME or NAME in dict(cfg.comm.per_axis).values()


@hookimpl
def hpctrain_capabilities():
    return {"comm.backend": [NAME]}


@hookimpl
def hpctrain_config_sections():
    return {"comm.hier": HierConfig}


@hookimpl
def hpctrain_register_configs(config_store):
    config_store.store(group="comm", name=NAME, node={"backend": NAME})


@hookimpl
def hpctrain_validate(cfg, world_size) -> Optional[List[str]]:
    if not _uses_hier(cfg):
        return None

    opts, problems = options(cfg), []
    served = capabilities(get_manager()).get("comm.backend", [])
    for role in ("intra", "inter"):
        name = getattr(opts, role)
        if name == NAME:
            problems.append(f"comm.hier.{role}=hier would nest the hierarchical backend in itself; "
                            f"choose one of: {', '.join(n for n in served if n != NAME)}, or auto")
        elif name != "auto" and name not in served:
            problems.append(f"comm.hier.{role}={name!r} is not provided by any installed plugin; "
                            f"choose one of: {', '.join(n for n in served if n != NAME)}, or auto")
    if opts.uneven not in UNEVEN_CHOICES:
        problems.append(f"comm.hier.uneven={opts.uneven!r} must be one of {', '.join(UNEVEN_CHOICES)}")
    return problems or None


@hookimpl
def hpctrain_make_backend(name: str, group: Group, cfg: Any) -> Optional[Communicator]:
    if name != NAME:
        return None
    from hpctrain_comm_hier.build import (
        build_hier,  # heavy (hpctrain.run): when a backend is made, not at plugin loading
    )

    return build_hier(group, cfg, options(cfg))
