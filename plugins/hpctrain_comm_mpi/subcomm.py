"""One MPI communicator per group, split from the world.

``COMM_WORLD.Split`` is collective over the world: every rank calls it once
per partition (all groups of one set of axes), in the same order, with the
index of its own group as colour and its group rank as key, so the new
communicator's ranks are the group ranks. The result is cached by partition:
building the same mesh again (tests, several meshes in one process) reuses it
instead of leaking communicators, and the cache is the only module state.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from hpctrain.errors import CommError
from hpctrain.mesh import Group

Partition = Tuple[Tuple[int, ...], ...]

_SUBCOMMS: Dict[Tuple[int, Partition], Any] = {}


def mpi_comm_for(group: Group, world: Any) -> Any:
    """The MPI communicator of ``group`` (collective over ``world`` on first use)."""
    key = (world.py2f(), group.partition)
    if key not in _SUBCOMMS:
        if group.ranks not in group.partition:
            raise CommError(f"group {group.name} ranks {list(group.ranks)} are not one of its partition's groups")
        covered = sorted(r for ranks in group.partition for r in ranks)
        if covered != list(range(world.Get_size())):
            raise CommError(f"the partition of group {group.name} does not cover the world of "
                            f"{world.Get_size()} ranks exactly once: {group.partition}")
        comm = world.Split(color=group.partition.index(group.ranks), key=group.rank)
        comm.Set_name(f"hpctrain:{group.name}")
        _SUBCOMMS[key] = comm
    comm = _SUBCOMMS[key]
    if (comm.Get_rank(), comm.Get_size()) != (group.rank, group.size):
        raise CommError(f"MPI communicator for group {group.name} has rank {comm.Get_rank()} of {comm.Get_size()}, "
                        f"expected {group.rank} of {group.size}")
    return comm
