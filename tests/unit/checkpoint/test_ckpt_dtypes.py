"""Every stored dtype survives host copy -> file -> read -> tensor bit for bit,
bfloat16 included (stored as its 16-bit pattern), with checksums verified."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from hpctrain_h5ckpt.layout import DatasetDecl, full_box, gather_plan
from hpctrain_h5ckpt.options import IOOptions
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.snapshot import TORCH_TO_NUMPY, dtype_name, from_numpy, host_copy
from hpctrain_h5ckpt.writer import write_file


@pytest.mark.parametrize("parallel", [True, False], ids=["mpio", "serial"])
def test_every_dtype_round_trips_bit_exactly(tmp_path, parallel):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in TORCH_TO_NUMPY:
        base = torch.randn(6, 5, generator=g) * 100
        tensors[f"/model/{dtype_name(dtype)}"] = base.to(dtype) if dtype != torch.bool else base > 0
    decls = [DatasetDecl(p, (6, 5), TORCH_TO_NUMPY[t.dtype], (("torch_dtype", dtype_name(t.dtype)),))
             for p, t in sorted(tensors.items())]
    comm = MPI.COMM_SELF
    plan = gather_plan(comm, decls, {p: [full_box((6, 5))] for p in tensors}, {})
    owned = {p: [(full_box((6, 5)), host_copy(t))] for p, t in tensors.items()}
    opts = IOOptions(parallel=parallel, collective_min_bytes=0, alignment=0, fsync=False, verify=True)
    path = str(tmp_path / "dtypes.h5")
    write_file(path, plan, owned, {"format": "hpctrain-h5ckpt", "format_version": 1}, comm, opts)
    with CheckpointReader(path, comm, opts) as r:
        got = r.read({p: [full_box((6, 5))] for p in tensors})
        for p, t in tensors.items():
            back = from_numpy(got[p][0], r.index[p].attrs["torch_dtype"])
            assert back.dtype == t.dtype and torch.equal(back, t), p
