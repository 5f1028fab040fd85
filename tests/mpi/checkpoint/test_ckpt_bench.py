"""Smoke run of ``hpctrain-bench ckpt`` on a tiny state (no timing asserted:
benchmarks are not timed tests). What is checked: every rank finishes, rank 0
prints its tables (the local tier's and the --hints contender's too), both formats hold the same tensor
bytes (sizes within 10%: metadata), and only the newest iteration's files are left."""
from __future__ import annotations

import os

import pytest


@pytest.mark.mpi(min_size=2)
def test_ckpt_bench_prints_its_tables_and_keeps_only_the_last_files(world, shared_tmp, capsys):
    from hpctrain.bench import ckpt

    if world.Get_size() > 4:
        pytest.skip("smoke-tested at 2..4 ranks")
    code = ckpt.main(["--iters", "2", "--d-model", "64", "--layers", "1", "--vocab", "512", "--step-s", "0.02",
                      "--dir", shared_tmp, "--hints", "checkpoint.hdf5.alignment=65536",
                      "checkpoint.hdf5.meta_block_size=1048576", "+checkpoint.hdf5.mpiio_hints.cb_nodes=2"])
    out = capsys.readouterr().out
    assert code == 0
    world.Barrier()
    if world.Get_rank() == 0:
        for row in ("save", "load", "async, overlap", "async, blocking", "sync (for reference)", "hpctrain .h5",
                    "DCP directory", "local save + replicate", "local load", "training blocked (host copy + wait)",
                    "Time lost per failure", "hints save", "hints load", "with --hints: hpctrain .h5",
                    "What --hints cannot show"):
            assert any(line.strip().startswith(row) for line in out.splitlines()), row
        sizes = {line.split()[0] + line.split()[1]: int(line.split()[2].replace(",", ""))
                 for line in out.splitlines() if line.startswith(("hpctrain .h5", "DCP directory"))}
        # the same tensor bytes (1.4 MB here); each format's metadata (HDF5 object
        # headers and attributes, DCP's .metadata) is a few percent of so small a state
        assert sizes["hpctrain.h5"] == pytest.approx(sizes["DCPdirectory"], rel=0.10)
        assert sorted(os.listdir(shared_tmp)) == [".hpctrain.lock", "dcp-2", "latest", "ours-2.h5",
                                                  "ours-async-blocking-2.h5", "ours-async-overlap-2.h5",
                                                  "ours-hinted-2.h5"]
