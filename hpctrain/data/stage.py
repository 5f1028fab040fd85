"""Data staging: the shards a node's ranks read, copied to node-local disk
before step 1 (``data.stage.dir``), so that training reads local files
instead of the shared file system.

**Who copies what.** One copier per node, the node's lowest rank (nodes as
the runtime knows them: ``Runtime.rank_nodes``, emulated ones included).
It copies the ``.bin`` (and a chat shard's ``.mask``) of every shard its
node's ranks read during ``trainer.steps`` (``needed_shards``: their
samples, as the cursor hands them out, mapped to the documents and shards
they span; the validation documents' shards too), or every shard with
``data.stage.all=true``. A shard staged on a node is read from there by
that node's ranks; any other shard is still read from its shared path, so
a shard this rule missed costs speed, never correctness. The ``.idx`` files
are not copied: rank 0 alone reads them, to build the index.

**Where.** ``<data.stage.dir>/<node>/`` (the node as the local checkpoint
tier names it: ``SLURMD_NODENAME`` or the host name; ``node_<i>`` for
emulated nodes), a file per shard under a directory named for the hash of
its shared directory (two shards of one name in different directories stay
apart), and ``stage.json``: per staged file its source, size, modification
time and BLAKE2b digest (16 bytes, computed while copying).

**Reuse and checksums.** A file already staged is reused when its source is
unchanged (size and modification time as recorded) and the staged copy's
digest equals the recorded one (read again, locally, every launch); a
source that changed is copied again, and a staged copy whose digest differs
(a damaged local disk) is copied again and counted as ``recopied``.

**Fallback.** When ``data.stage.dir`` does not exist on a node (hpctrain
makes only its own subdirectory in it), is not a writable directory, or its
file system has not the room for what must be copied (``shutil.disk_usage``,
less ``FREE_MARGIN``), or a copy fails, that node reads the shared paths:
rank 0 says so in one line per reason, and the run goes on.

**Reported.** Rank 0 shows the copy's progress (every ``PROGRESS_S``) and one
line at the end (files copied, reused, recopied, bytes, seconds, per the
job); the trainer adds ``data_stage_s`` (rank 0's wall time of the whole
staging, the slowest node included), ``data_stage_bytes`` (staged on all
nodes) and ``data_stage_copied_bytes`` to the first step's metrics.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np

from hpctrain.data.blend import assign
from hpctrain.data.cursor import SampleOrder
from hpctrain.data.streams import DocumentStream, Shard
from hpctrain.localckpt.store import node_dir
from hpctrain.log import log_rank0

MANIFEST = "stage.json"
CHUNK = 8 << 20
"""Bytes per read while copying and hashing."""
FREE_MARGIN = 64 << 20
"""Room left free on the local file system after staging (bytes)."""
PROGRESS_S = 5.0
"""Seconds between rank 0's progress lines."""
SCAN_LIMIT = 50_000_000
"""Samples scanned at most to find a node's shards; beyond, every shard of a source is needed."""


# -- which shards a node reads ---------------------------------------------------

def _spans(order: SampleOrder, indices: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Token spans ``[start, stop)`` of the samples ``indices`` of ``order`` (vectorised window_start/span)."""
    epoch, pos = np.divmod(indices, order.num_windows)
    starts, stops = np.empty(len(indices), np.int64), np.empty(len(indices), np.int64)
    for e in np.unique(epoch):
        here = epoch == e
        k = order._perm(int(e))[pos[here]]
        if order.packed:
            packing = order.packing  # type: ignore[attr-defined]  # PackedOrder's
            starts[here], stops[here] = packing.start[k], packing.stop[k]
        else:
            starts[here] = k.astype(np.int64) * order.seq_len
            stops[here] = starts[here] + order.seq_len + 1
    return starts, stops


def shards_of_spans(stream: DocumentStream, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Which of ``stream``'s shards the token spans touch (bool per shard). A
    source's documents are in shard order, so a span's shards are the range
    from its first document's shard to its last's."""
    hit = np.zeros(len(stream.shards) + 1, np.int64)
    if not len(starts):
        return hit[:-1] > 0
    first = np.searchsorted(stream.ends, starts, side="right")
    last = np.searchsorted(stream.ends, np.maximum(stops, starts + 1) - 1, side="right")
    last = np.minimum(last, len(stream.ends) - 1)
    lo, hi = stream.table.shard[first], stream.table.shard[last]
    np.add.at(hit, lo, 1)
    np.add.at(hit, hi + 1, -1)
    return np.cumsum(hit)[:-1] > 0


def node_samples(first_sample: int, count: int, global_batch: int, sample_size: int,
                 sample_ranks: Set[int]) -> np.ndarray:
    """Which of the global stream's samples ``[first_sample, first_sample + count)`` go to the
    sample ranks ``sample_ranks`` (each step's batch is cut into ``sample_size`` contiguous slices,
    ``DataCursor.prepare``)."""
    g = np.arange(first_sample, first_sample + count, dtype=np.int64)
    owner = (g % global_batch) // (global_batch // sample_size)
    return g[np.isin(owner, list(sample_ranks))]


def needed_shards(train: Sequence[SampleOrder], weights: Sequence[float], valid: Sequence[SampleOrder],
                  steps: int, global_batch: int, sample_size: int, sample_ranks: Set[int]) -> List[np.ndarray]:
    """Per training source then per validation source, the shards (bool per shard of its
    stream) that the ranks of ``sample_ranks`` read in ``steps`` steps from step 0; a
    validation source's: every shard holding one of its documents. Scans at most
    ``SCAN_LIMIT`` samples (a run that long reads every shard anyway), stopping once
    every shard is hit."""
    streams = [o.source.tokens for o in train]
    hits = [np.zeros(len(s.shards), bool) for s in streams]
    total = steps * global_batch
    chunk = max(global_batch, (1 << 20) // global_batch * global_batch)
    counts = [0] * len(train)
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    for first in range(0, min(total, SCAN_LIMIT), chunk):
        n = min(chunk, total - first)
        if len(train) == 1:
            src, local = np.zeros(n, np.int64), np.arange(counts[0], counts[0] + n, dtype=np.int64)
            counts = [counts[0] + n]
        else:
            src, local, counts = assign(w, counts, n)
        mine = node_samples(first, n, global_batch, sample_size, sample_ranks) - first
        for k, (order, stream) in enumerate(zip(train, streams)):
            picked = local[mine][src[mine] == k]
            if len(picked) and not hits[k].all():
                hits[k] |= shards_of_spans(stream, *_spans(order, picked))
        if all(h.all() for h in hits):
            break
    else:
        if total > SCAN_LIMIT:
            hits = [np.ones_like(h) for h in hits]
    for order in valid:
        stream = order.source.tokens
        hit = np.zeros(len(stream.shards), bool)
        hit[np.unique(stream.table.shard)] = True
        hits.append(hit)
    return hits


def files_of(streams: Iterable[DocumentStream], hits: Iterable[np.ndarray]) -> List[str]:
    """The files to stage for the shards hit: each ``.bin`` and its ``.mask``, in order, once."""
    out: Dict[str, None] = {}
    for stream, hit in zip(streams, hits):
        for shard, wanted in zip(stream.shards, hit):
            if wanted:
                out[shard.bin_path] = None
                if shard.mask_path:
                    out[shard.mask_path] = None
    return list(out)


# -- copying with checksums ------------------------------------------------------

def digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_hashed(src: str, dst: str, on_bytes: Callable[[int], None] = lambda n: None) -> str:
    """Copy ``src`` to ``dst`` (through ``dst.tmp``, renamed when whole); its BLAKE2b digest."""
    h = hashlib.blake2b(digest_size=16)
    tmp = dst + ".tmp"
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(CHUNK):
                h.update(chunk)
                fout.write(chunk)
                on_bytes(len(chunk))
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return h.hexdigest()


def local_name(src: str) -> str:
    """A staged file's path inside the node directory."""
    where = hashlib.blake2b(os.path.dirname(os.path.abspath(src)).encode(), digest_size=6).hexdigest()
    return os.path.join(where, os.path.basename(src))


def read_manifest(root: str) -> Dict[str, dict]:
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            files = json.load(f).get("files", {})
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def write_manifest(root: str, files: Dict[str, dict]) -> None:
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": files}, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(root, MANIFEST))


@dataclass
class NodeResult:
    """What a node's copier did (plain data: gathered to every rank)."""

    node: int
    root: str
    paths: Dict[str, str] = field(default_factory=dict)
    """Shared path -> staged path, for every file staged on the node."""
    fallback: Optional[str] = None
    """Why the node reads the shared paths (None: it staged)."""
    copied: int = 0
    reused: int = 0
    recopied: int = 0
    """Files staged again because the staged copy's digest differed from the recorded one."""
    bytes: int = 0
    copied_bytes: int = 0
    seconds: float = 0.0


def _usable_dir(base: str) -> Optional[str]:
    """None when ``base`` is a directory hpctrain can write in, else why not."""
    if not os.path.isdir(base):
        return "does not exist" if not os.path.exists(base) else "is not a directory"
    if not os.access(base, os.W_OK | os.X_OK):
        return "is not writable"
    return None


class _Progress:
    """Rank 0's progress lines while its node copies."""

    def __init__(self, show: bool, total: int, files: int):
        self.show, self.total, self.files = show, total, files
        self.done, self.t0, self.last = 0, time.perf_counter(), time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.show and now - self.last >= PROGRESS_S:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            log_rank0("data.stage: node 0: %.1f of %.1f MiB copied (%.0f MiB/s, %d files)", self.done / 2**20,
                      self.total / 2**20, rate / 2**20, self.files)


def stage_node(base: str, node: int, emulated: bool, files: Sequence[str], show_progress: bool = False,
               disk_usage: Callable[[str], Any] = shutil.disk_usage) -> NodeResult:
    """Stage ``files`` (shared paths) under ``base`` for ``node`` (the copier's work; no collective)."""
    t0 = time.perf_counter()
    root = node_dir(base, node, emulated)
    out = NodeResult(node, root)
    why = _usable_dir(base)
    if why:
        out.fallback = f"data.stage.dir={base} {why} on this node"
        return out
    try:
        os.makedirs(root, exist_ok=True)
        manifest = read_manifest(root)
        sources = {src: os.stat(src) for src in files}
        plan: List[Tuple[str, str, bool]] = []  # (source, staged path, staged before but damaged)
        for src, st in sources.items():
            name = local_name(src)
            dst = os.path.join(root, name)
            rec = manifest.get(name)
            fresh = (rec is not None and rec.get("source") == os.path.abspath(src) and rec.get("size") == st.st_size
                     and rec.get("mtime_ns") == st.st_mtime_ns and os.path.isfile(dst)
                     and os.path.getsize(dst) == st.st_size)
            if fresh and rec is not None and digest(dst) == rec.get("blake2b"):
                out.reused += 1
                out.paths[src] = dst
                continue
            plan.append((src, dst, fresh))
        need = sum(sources[s].st_size for s, _, _ in plan)
        free = disk_usage(root).free + sum(os.path.getsize(d) for _, d, _ in plan if os.path.isfile(d))
        if need + FREE_MARGIN > free:
            out.paths.clear()
            out.fallback = (f"data.stage.dir={base} has {free / 2**20:.0f} MiB free on this node, "
                            f"{(need + FREE_MARGIN) / 2**20:.0f} MiB needed")
            return out
        progress = _Progress(show_progress, need, len(plan))
        for src, dst, damaged in plan:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            st = sources[src]
            manifest.pop(local_name(src), None)
            manifest[local_name(src)] = {"source": os.path.abspath(src), "size": st.st_size,
                                         "mtime_ns": st.st_mtime_ns, "blake2b": copy_hashed(src, dst, progress.add)}
            write_manifest(root, manifest)  # after each file: an interrupted staging keeps what it copied
            out.paths[src] = dst
            out.recopied += int(damaged)
            out.copied += int(not damaged)
            out.copied_bytes += st.st_size
        write_manifest(root, manifest)
        out.bytes = sum(sources[s].st_size for s in out.paths)
    except OSError as e:
        out.paths.clear()
        out.fallback = f"data.stage.dir={base}: staging failed on this node ({e.strerror or e})"
    out.seconds = time.perf_counter() - t0
    return out


# -- the job ----------------------------------------------------------------------

@dataclass
class StageReport:
    """The job's staging, for the start-up line and the first step's metrics."""

    seconds: float = 0.0
    bytes: int = 0
    copied_bytes: int = 0
    results: List[NodeResult] = field(default_factory=list)

    def metrics(self) -> Dict[str, float]:
        return {"data_stage_s": self.seconds, "data_stage_bytes": float(self.bytes),
                "data_stage_copied_bytes": float(self.copied_bytes)}


def copier(rank_nodes: Sequence[int], rank: int) -> bool:
    """Whether ``rank`` is its node's lowest rank."""
    return rank_nodes.index(rank_nodes[rank]) == rank


def repoint(stream: DocumentStream, paths: Dict[str, str]) -> None:
    """Read ``stream``'s staged shards from their staged paths (before its first read)."""
    stream.shards = [replace(s, bin_path=paths.get(s.bin_path, s.bin_path),
                             mask_path=paths.get(s.mask_path, s.mask_path) if s.mask_path else None)
                     for s in stream.shards]
    stream.close()


def streams_of(orders: Any) -> List[DocumentStream]:
    """Every document stream the orders read: tokens, and a chat source's loss mask."""
    out: List[DocumentStream] = []
    for o in [*orders.train, *orders.valid]:
        out.append(o.source.tokens)
        if getattr(o, "mask", None) is not None:
            out.append(o.mask)
    return out


def summary(report: StageReport, base: str) -> List[str]:
    """Rank 0's lines: the staging in one line, then one per fallback reason (nodes named)."""
    staged = [r for r in report.results if r.fallback is None]
    lines = []
    if staged:
        lines.append(f"data.stage: {len(staged)} of {len(report.results)} node(s) staged "
                     f"{sum(len(r.paths) for r in staged)} file(s) ({report.bytes / 2**20:.1f} MiB) in {base} in "
                     f"{report.seconds:.2f} s: {sum(r.copied for r in staged)} copied, "
                     f"{sum(r.reused for r in staged)} reused, {sum(r.recopied for r in staged)} recopied (checksum "
                     f"mismatch), {report.copied_bytes / 2**20:.1f} MiB copied")
    reasons: Dict[str, List[int]] = {}
    for r in report.results:
        if r.fallback is not None:
            reasons.setdefault(r.fallback, []).append(r.node)
    for why, nodes in reasons.items():
        lines.append(f"{why}: node(s) {', '.join(map(str, nodes))} read the shared paths")
    return lines


def stage(orders: Any, data: Any, steps: int, global_batch: int, sample_size: int, sample_rank: int,
          runtime: Any) -> StageReport:
    """Stage the shards this job's nodes read and repoint each rank's streams at its node's
    copies (collective over ``runtime.mpi_comm``: every rank calls it, after the orders exist)."""
    t0 = time.perf_counter()
    comm, rank = runtime.mpi_comm, runtime.world_rank
    nodes = tuple(runtime.rank_nodes) or (0,) * runtime.world_size
    alone = runtime.world_size == 1
    sample_ranks = [sample_rank] if alone else comm.allgather(sample_rank)
    streams = streams_of(orders)
    result = None
    if copier(nodes, rank):
        node = nodes[rank]
        mine = {sample_ranks[r] for r in range(len(nodes)) if nodes[r] == node}
        if data.stage.all:
            hits = [np.ones(len(s.shards), bool) for s in streams]
        else:
            found = needed_shards(orders.train, orders.weights, orders.valid, steps, global_batch, sample_size, mine)
            by_order = dict(zip([id(o.source.tokens) for o in [*orders.train, *orders.valid]], found))
            hits = [by_order.get(id(s), np.zeros(len(s.shards), bool)) for s in streams]
            for o in [*orders.train, *orders.valid]:  # a chat source's mask: the shards of its tokens
                if getattr(o, "mask", None) is not None:
                    hits[streams.index(o.mask)] = by_order[id(o.source.tokens)]
        files = files_of(streams, hits)
        result = stage_node(str(data.stage.dir), node, bool(runtime.emulated_nodes), files,
                            show_progress=rank == 0)
    results = [result] if alone else comm.allgather(result)
    mine_result = next(r for r in results if r is not None and r.node == nodes[rank])
    for s in streams:
        repoint(s, mine_result.paths)
    done = [r for r in results if r is not None]
    report = StageReport(time.perf_counter() - t0, sum(r.bytes for r in done), sum(r.copied_bytes for r in done),
                         done)
    for line in summary(report, str(data.stage.dir)):
        log_rank0("%s", line)
    return report


def stageable(data: Any) -> bool:
    """Whether the run has shards to stage (``data.stage.dir`` set, Megatron shards)."""
    return bool(data.stage.dir) and data.source == "indexed"


__all__ = ["stage", "stageable", "needed_shards", "stage_node", "StageReport", "NodeResult", "Shard"]
