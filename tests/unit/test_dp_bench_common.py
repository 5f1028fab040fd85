"""Benchmark helpers (hpctrain.bench.common, comm's sizing and bus factors): pure logic."""
from __future__ import annotations

import pytest
import torch

from hpctrain.bench.comm import bus_factor, make_buffers
from hpctrain.bench.common import Column, Table, Timing, format_size, parse_size, size_ladder


def test_sizes_parse_and_print_in_binary_units():
    assert parse_size("4096") == 4096 and parse_size("1K") == 1024 and parse_size("256M") == 256 << 20
    assert parse_size("1GiB") == 1 << 30 and parse_size("0.5M") == 512 << 10
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("12 parsecs")
    assert [format_size(n) for n in (1024, 3 << 20, 1 << 30, 1000)] == ["1 KiB", "3 MiB", "1 GiB", "1000 B"]


def test_size_ladder_includes_both_ends():
    assert size_ladder(1024, 256 << 20, 4)[0] == 1024 and size_ladder(1024, 256 << 20, 4)[-1] == 256 << 20
    assert len(size_ladder(1 << 10, 256 << 20)) == 19  # 1 KiB .. 256 MiB by 2
    with pytest.raises(ValueError):
        size_ladder(10, 5)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 8) == 1.0


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"])
def test_buffers_hold_whole_chunks_and_report_total_bytes(op):
    b = make_buffers(op, 1000, 3, torch.float32)  # 250 floats -> 249, a multiple of 3
    assert b.nbytes == 249 * 4
    big = b.inp if op == "reduce_scatter" else b.out
    assert big.numel() == 249
    if op == "all_gather":
        assert b.inp.numel() == 83
    if op == "reduce_scatter":
        assert b.out.numel() == 83


def test_table_text_and_markdown():
    t = Table([Column("impl", "{}", "<"), Column("GB/s", "{:.2f}"), Column("ratio", "{:.2f}")])
    t.add("raw", 1.234, None)
    t.add("ours", float("nan"), 0.5)
    lines = t.text().splitlines()
    assert lines[0].split() == ["impl", "GB/s", "ratio"] and lines[2].split() == ["raw", "1.23", "-"]
    assert lines[3].split() == ["ours", "n/a", "0.50"]
    md = t.markdown().splitlines()
    assert md[1] == "|:---|---:|---:|" and md[2] == "| raw | 1.23 | - |"
    with pytest.raises(ValueError):
        t.add("too", "few")


def test_timing_median_is_robust_to_one_slow_sample():
    assert Timing([1.0, 1.1, 0.9, 50.0, 1.05]).median == 1.05


class _OneRank:
    """The few MPI calls the timing helpers make, for a world of one rank."""

    def Barrier(self):
        return None

    def allreduce(self, value, op=None):
        return value

    def allgather(self, value):
        return [value]


def test_interleaved_timing_rotates_so_each_contender_follows_each_other_equally():
    from hpctrain.bench.common import time_interleaved

    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    timings = time_interleaved(fns, _OneRank(), warmup=0, iters=6)
    assert [len(t.samples) for t in timings] == [6, 6, 6]
    rounds = [calls[k * 3:(k + 1) * 3] for k in range(6)]
    assert rounds[:3] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    follows = {}
    for a, b in zip(calls, calls[1:]):
        follows[(a, b)] = follows.get((a, b), 0) + 1
    assert {pair for pair in follows if pair[0] != pair[1]} == {(0, 1), (1, 2), (2, 0), (0, 2), (1, 0), (2, 1)}


def test_comm_bench_times_each_peer_with_its_own_backends():
    from types import SimpleNamespace

    from hpctrain.bench.comm import _time_by_family

    calls = []
    impls = [("raw-mpi4py", lambda: calls.append("raw-mpi4py"), None),
             ("raw-gloo", lambda: calls.append("raw-gloo"), None),
             ("torch(gloo)", lambda: calls.append("torch(gloo)"), "raw-gloo"),
             ("mpi", lambda: calls.append("mpi"), "raw-mpi4py"),
             ("nccl", None, "raw-mpi4py")]
    timings = _time_by_family(impls, _OneRank(), SimpleNamespace(warmup=0, iters=4, budget=None))
    assert set(timings) == {"raw-mpi4py", "raw-gloo", "torch(gloo)", "mpi"}
    mpi_family = [c for c in calls if c in ("raw-mpi4py", "mpi")]
    assert calls[:len(mpi_family)] == mpi_family  # one family is finished before the other starts
