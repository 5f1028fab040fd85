"""Plugin registration for the recording backend (``comm.backend=record``).

Served as a ``comm.backend`` (any group's communicator) and listed under the
``comm.dry_run`` capability, which is how ``hpctrain.dry_run`` finds a
backend that records instead of moving data (the core names no plugin).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from hpctrain import hookimpl

from hpctrain_comm_record.communicator import RecordingCommunicator

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.comm.protocol import Communicator
    from hpctrain.mesh import Group

NAME = "record"


@hookimpl
def hpctrain_capabilities():
    return {"comm.backend": [NAME], "comm.dry_run": [NAME]}


@hookimpl
def hpctrain_make_backend(name: str, group: Group, cfg: Any) -> Optional[Communicator]:
    if name != NAME:
        return None
    return RecordingCommunicator(group)
