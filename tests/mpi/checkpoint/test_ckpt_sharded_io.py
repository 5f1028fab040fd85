"""The format with genuinely split tensors, ahead of the TP/PP/ZeRO plugins:
write a file from hyperslabs split one way (rows, flat ZeRO ranges, column
halves replicated over rank pairs) and read it back split another way on
every smaller world (sub-communicators), through MPI-IO (independent and
collective) and the serial fallback. Any world size >= 2."""
from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain_h5ckpt import store
from hpctrain_h5ckpt.layout import DatasetDecl, flat_range_boxes, full_box, gather_plan
from hpctrain_h5ckpt.options import IOOptions
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.writer import write_file

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.every_size]  # the world size changes what is tested
SHAPE = (12, 8)
LOGICAL = {name: (np.arange(math.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * (k + 1) - 7.5)
           for k, name in enumerate(("/model/rows", "/model/flat", "/model/cols"))}


def _slab(a, box):
    return a[tuple(slice(x, y) for x, y in box)]


def _save_boxes(rank: int, size: int):
    """Rows split over all ranks; flat ZeRO ranges; column halves replicated over pairs."""
    n = math.prod(SHAPE)
    rows = SHAPE[0] // size if SHAPE[0] % size == 0 else None
    boxes = {
        "/model/rows": [((rank * rows, (rank + 1) * rows), (0, SHAPE[1]))] if rows else [full_box(SHAPE)],
        "/model/flat": flat_range_boxes(SHAPE, rank * n // size, (rank + 1) * n // size),
        "/model/cols": [((0, SHAPE[0]), ((rank % 2) * 4, (rank % 2) * 4 + 4))],
    }
    return {p: b for p, b in boxes.items() if b}


def _load_boxes(rank: int, size: int):
    """Split the other way: columns over ranks, rows for the flat one, whole for one rank."""
    cols = SHAPE[1] // size
    return {
        "/model/rows": [((0, SHAPE[0]), (rank * cols, (rank + 1) * cols))],
        "/model/flat": [((rank * SHAPE[0] // size, (rank + 1) * SHAPE[0] // size), (0, SHAPE[1]))],
        "/model/cols": [full_box(SHAPE)] if rank == 0 else [],
    }


def _opts(parallel: bool, collective_min_bytes: int) -> IOOptions:
    return IOOptions(parallel=parallel, collective_min_bytes=collective_min_bytes, alignment=0, fsync=False,
                     verify=True)


@pytest.mark.parametrize("parallel,collective_min_bytes", [(True, 1 << 30), (True, 0), (False, 0)],
                         ids=["mpio-independent", "mpio-collective", "serial"])
def test_split_one_way_read_another_on_every_smaller_world(shared_tmp, parallel, collective_min_bytes):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    path = f"{shared_tmp}/{store.checkpoint_name(1)}"
    held = _save_boxes(rank, size)
    decls = [DatasetDecl(p, SHAPE, "<f4", (("kind", "param"),)) for p in sorted(held)]
    plan = gather_plan(comm, decls, held, {"step": 1})
    mine = plan.owned_by(rank)
    assert len(plan.owners["/model/cols"]) == 2  # each replicated column half has one writer
    owned = {p: [(b, _slab(LOGICAL[p], b)) for b in boxes] for p, boxes in mine.items()}
    attrs = {"format": "hpctrain-h5ckpt", "format_version": 1}
    write_file(path, plan, owned, attrs, comm, _opts(parallel, collective_min_bytes))
    for k in (s for s in range(1, size + 1) if size % s == 0 and SHAPE[1] % s == 0 and SHAPE[0] % s == 0):
        sub = comm.Split(rank // k, rank)
        wants = {p: b for p, b in _load_boxes(sub.Get_rank(), k).items() if b}
        with CheckpointReader(path, sub, _opts(parallel, collective_min_bytes)) as r:
            got = r.read(wants, {p: SHAPE for p in wants})
        for p, boxes in wants.items():
            for b, arr in zip(boxes, got[p]):
                np.testing.assert_array_equal(arr, _slab(LOGICAL[p], b))
        sub.Free()
