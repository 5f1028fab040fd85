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
