"""Cross-rank argument checks, and MPI errors as CommErrors.

A collective whose ranks disagree on sizes does not always fail in MPI: a
receiver expecting more than was sent gets a short message and garbage in the
rest, and differing counts in a reduction may hang. Finding that out needs
the other ranks' arguments, which costs one small allgather per operation, so
it is a debug switch: ``comm.mpi.check_shapes=true``. Every rank then
gathers what each rank passed (dtype, element counts, splits) and, if they
disagree, every rank raises the same CommError naming the ranks: no hang, no
silent wrong sum. Off by default (it adds a latency per call); the local
checks in ``hpctrain.comm.protocol`` always run.

Point-to-point sizes are not checked (that would need a handshake per
message); a receive larger than the send leaves its tail unwritten, a smaller
one fails with MPI's truncation error, reported as a CommError.
"""
from __future__ import annotations

from typing import Any, List, Literal, Optional, Sequence

from mpi4py import MPI

from hpctrain.errors import CommError


def _describe(values: List[Any]) -> str:
    groups: dict = {}
    for rank, v in enumerate(values):
        groups.setdefault(repr(v), []).append(rank)
    return "; ".join(f"ranks {ranks}: {v}" for v, ranks in groups.items())


def check_same(comm: Any, what: str, group_name: str, **fields: Any) -> None:
    """Every rank passed the same ``fields`` (e.g. dtype, numel, op)."""
    everyone = comm.allgather(fields)
    if any(f != everyone[0] for f in everyone):
        raise CommError(f"{what} on group {group_name}: ranks disagree on {', '.join(fields)}: {_describe(everyone)}")


def check_all_to_all(comm: Any, what: str, group_name: str, dtype: str, row: int,
                     input_splits: Sequence[int], output_splits: Sequence[int], equal: bool = False) -> None:
    """Rank i sends rank j exactly what rank j expects from rank i, in rows
    of one size, and either every rank or none passed no splits (``equal``:
    those ranks call MPI_Alltoall, the others MPI_Alltoallv)."""
    everyone = comm.allgather((dtype, row, list(input_splits), list(output_splits), equal))
    check = [(d, r) for d, r, _, _, _ in everyone]
    if any(c != check[0] for c in check):
        raise CommError(f"{what} on group {group_name}: ranks disagree on (dtype, row size): {_describe(check)}")
    unsplit = [e for *_, e in everyone]
    if any(e != unsplit[0] for e in unsplit):
        shown = _describe(["no splits (equal)" if e else "splits" for e in unsplit])
        raise CommError(f"{what} on group {group_name}: some ranks passed splits and others None ({shown}); "
                        "pass splits on every rank or on none")
    bad = [(i, j, everyone[i][2][j], everyone[j][3][i])
           for i in range(len(everyone)) for j in range(len(everyone))
           if everyone[i][2][j] != everyone[j][3][i]]
    if bad:
        shown = "; ".join(f"rank {i} sends {s} rows to rank {j}, which expects {e}" for i, j, s, e in bad[:4])
        raise CommError(f"{what} on group {group_name}: input_splits and output_splits do not match "
                        f"across ranks: {shown}")


class mpi_errors:
    """``with mpi_errors("all_reduce", "dp"):`` re-raises an MPI error as a
    CommError naming the operation and group. (A class, not a generator
    context manager: it wraps every call, so it should cost next to nothing.)"""

    __slots__ = ("what", "group_name", "hint")

    def __init__(self, what: str, group_name: str, hint: Optional[str] = None):
        self.what, self.group_name, self.hint = what, group_name, hint

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> Literal[False]:
        if kind is not None and issubclass(kind, MPI.Exception):
            raise as_comm_error(self.what, self.group_name, error, self.hint) from error
        return False


def as_comm_error(what: str, group_name: str, error: Any, hint: Optional[str] = None) -> CommError:
    """The CommError for an MPI error raised by ``what`` on ``group_name``."""
    tip = hint or "sizes may differ across ranks; rerun with comm.mpi.check_shapes=true to find out"
    return CommError(f"{what} on group {group_name} failed in MPI: {error.Get_error_string().strip()} ({tip})")
