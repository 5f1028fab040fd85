"""Building a HierCommunicator: the sub-groups and their communicators.

Every rank calls ``build_hier`` for every group of a partition at the same
point (the mesh does that), reaches the same ``PartitionPlan`` from the same
node table, and so asks the backend plugins for the same sub-groups in the
same order: flat group, then intra-node groups, then inter-node groups.
Creating them may be collective over the world (MPI ``Split``, torch
``new_group``), so that order matters.
"""
from __future__ import annotations

from typing import Any

from hpctrain.bootstrap import get_runtime
from hpctrain.comm.protocol import Communicator, LocalCommunicator
from hpctrain.errors import CommError, ConfigError, PluginError
from hpctrain.log import get_logger
from hpctrain.mesh import Group
from hpctrain.plugins import get_manager
from hpctrain.run import resolve_backend_name

from hpctrain_comm_hier.communicator import HierCommunicator
from hpctrain_comm_hier.layout import Partition, plan_partition

log = get_logger(__name__)


def _resolve(name: str, role: str, device: Any, pm: Any) -> str:
    resolved = resolve_backend_name(name, device, pm)
    if resolved == "hier":
        raise ConfigError(f"comm.hier.{role}=hier would nest the hierarchical backend in itself")
    return resolved


def _make(pm: Any, name: str, role: str, group: Group, partition: Partition, cfg: Any) -> Communicator:
    """The ``name`` backend for ``group``; local when every group of its partition is one rank
    (the same decision on every rank, so creation stays collective)."""
    if all(len(ranks) == 1 for ranks in partition):
        return LocalCommunicator()
    comm = pm.hook.hpctrain_make_backend(name=name, group=group, cfg=cfg)
    if comm is None:
        raise PluginError(f"comm.hier.{role}={name!r}: no installed plugin made a communicator for {group.name}")
    return comm


def _subgroup(parent: Group, suffix: str, ranks: tuple, partition: Partition, me: int) -> Group:
    return Group(name=f"{parent.name}.{suffix}", ranks=ranks, rank=ranks.index(me), partition=partition)


def build_hier(group: Group, cfg: Any, opts: Any) -> HierCommunicator:
    rt = get_runtime()
    if len(rt.rank_nodes) != rt.world_size:
        raise CommError("comm.backend=hier needs the node of every rank (Runtime.rank_nodes) from the bootstrap")
    pm = get_manager()
    intra_name = _resolve(opts.intra, "intra", rt.device, pm)
    inter_name = _resolve(opts.inter, "inter", rt.device, pm)
    plan = plan_partition(group.partition, rt.rank_nodes)
    if plan.mode == "uneven":
        detail = f"group {group.name}: {plan.uneven_example()}"
        if opts.uneven == "error":
            raise CommError(f"comm.backend=hier cannot split {detail}; give every node the same number of the "
                            "group's ranks, or set comm.hier.uneven=flat to use one flat communicator")
        if rt.world_rank == 0:
            log.warning("comm.backend=hier: %s; using a flat %s communicator for %s groups", detail, inter_name,
                        group.name)
    flat_name = intra_name if plan.mode == "one-node" else inter_name
    flat = _make(pm, flat_name, "intra" if plan.mode == "one-node" else "inter", group, group.partition, cfg)
    if plan.mode != "hier":
        return HierCommunicator(group, plan.mode, flat)

    me = rt.world_rank
    split = plan.split_of(group.ranks)
    intra_group = _subgroup(group, "intra", split.intra_of(me), plan.intra_partition, me)
    inter_group = _subgroup(group, "inter", split.inter_of(me), plan.inter_partition, me)
    intra = _make(pm, intra_name, "intra", intra_group, plan.intra_partition, cfg)
    inter = _make(pm, inter_name, "inter", inter_group, plan.inter_partition, cfg)
    log.debug("hier %s: %d nodes x %d ranks (intra %s, inter %s)", group.name, split.nodes, split.per_node[0],
              intra_name, inter_name)
    return HierCommunicator(group, plan.mode, flat, intra, inter, split.slots(), check_shapes=opts.check_shapes)
