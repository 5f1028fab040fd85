"""Collective time with an alpha-beta model and nccl-tests' bus-bandwidth factors.

A collective over n ranks moving ``nbytes`` (the tensor size, as nccl-tests
counts it) takes

    t = steps(n) * alpha + nbytes * factor(n) / busbw

where busbw is the per-GPU bus bandwidth of the link it crosses and
factor(n) is nccl-tests' algbw-to-busbw factor: 2(n-1)/n for all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for point-to-point.
The latency term counts ring steps: 2(n-1) for all-reduce, n-1 for the others.

Hierarchy: with the default rank order a group's members are spread over
``n_in`` GPUs per node and ``n_out`` nodes. When both exceed 1, all-reduce
runs as reduce-scatter inside the node, all-reduce of the 1/n_in shard
between nodes (every GPU uses its own NIC, in parallel), and all-gather inside
the node; reduce-scatter and all-gather use the matching halves. All-to-all
and point-to-point use the slowest link they cross.
"""
from __future__ import annotations

from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class Link:
    """Per-GPU bus bandwidth (bytes/s) and per-step latency (s) of one level."""

    busbw: float
    alpha: float


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {kind!r} (known: {', '.join(COLLECTIVES)})")


def latency_steps(kind: str, n: int) -> int:
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "p2p":
        return 1
    return n - 1


def flat_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """One collective over n ranks on a single link level."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return latency_steps(kind, n) * link.alpha + nbytes * bus_factor(kind, n) / link.busbw


def group_time(kind: str, nbytes: float, n_in: int, n_out: int, intra: Link, inter: Link) -> float:
    """One collective over a group of ``n_in`` GPUs per node on ``n_out`` nodes."""
    n = n_in * n_out
    if n <= 1 or nbytes <= 0:
        return 0.0
    if n_out == 1:
        return flat_time(kind, nbytes, n_in, intra)
    if n_in == 1 or kind in ("all_to_all", "p2p"):
        return flat_time(kind, nbytes, n, inter)
    shard = nbytes / n_in
    if kind == "all_reduce":
        return (flat_time("reduce_scatter", nbytes, n_in, intra) + flat_time("all_reduce", shard, n_out, inter)
                + flat_time("all_gather", nbytes, n_in, intra))
    # reduce-scatter / all-gather: one intra-node and one inter-node phase
    return flat_time(kind, nbytes, n_in, intra) + flat_time(kind, shard, n_out, inter)


def placement(stride: int, size: int, gpus_per_node: int) -> "tuple[int, int]":
    """(members per node, nodes) of a group whose consecutive members are
    ``stride`` ranks apart, with ranks filling nodes in order."""
    if size <= 1:
        return 1, 1
    if stride >= gpus_per_node:
        return 1, size
    per_node = max(1, min(size, gpus_per_node // stride))
    return per_node, -(-size // per_node)
