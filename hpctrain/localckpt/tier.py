"""``LocalTier``: save every ``checkpoint.local.every`` steps to node-local
storage with copies on partner nodes, and resume from the newest step that
the surviving nodes hold in full.

Save (``save``, at the step boundary): what the next step changes before
its optimizer step (random state, cursor, step) is taken at once
(``state.capture_meta``); a background thread copies the parameters,
optimizer state and buffers to host memory while the next forward and
backward run (``state.capture_tensors``; ``before_update``, which the trainer
calls right before the optimizer step, waits for that copy: all the step
ever waits for), then encodes the state, writes this rank's file, sends it to its partners and receives its
sources' copies (MPI point-to-point on the tier's own duplicate of the
world communicator; mpi4py runs MPI with ``MPI_THREAD_MULTIPLE``, and below
that level the thread's work runs in the call instead), writes its manifest
last, and prunes all but the two newest steps. The next save, and the end
of the run, wait for it first. Two are kept because a node lost while
writing step N leaves N incomplete there; N - every is complete
everywhere (every rank passes a collective between its saves).

Partners: the rank with the same place on node ``n + k`` (k = 1..replicas,
nodes in a ring) holds this rank's k-th copy. ``replicas`` must be below
the number of nodes (checked before any collective).

Resume (``agree`` then ``load``): every rank lists what its node directory
holds (``store.held``); one allgather shares it; every rank computes the
same answer: the newest step for which every rank's file, written by this
layout and experiment (``state.signature``), is on some live rank's node.
Then each rank whose own copy is gone receives it from a holder (the lowest
rank holding it), every rank checks what it got (magic, checksum) and the
ranks agree on it before any state changes: when every copy is sound, every
rank restores its own state; when one is damaged (a flipped bit, a
truncated file), nothing is restored and ``load`` raises ``DamagedCopies``
on every rank, naming them, and ``without(damaged)`` decides again without
those copies (a partner's copy of the same step, else an older step, else
nothing: the caller's persistent checkpoint). Files another layout wrote
are not used (the caller falls back to the persistent checkpoint and the
log says so).

A save that fails (a full or broken node-local disk) removes its temporary
files and is kept as this rank's failure; ``agree_failures`` (collective)
reports every rank's at a step boundary, so the ranks decide together what
the run does next (``hpctrain.train.checkpointing``).
"""
from __future__ import annotations

import errno
import getpass
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from hpctrain.localckpt import reshard, store
from hpctrain.localckpt.state import (
    LocalStateError,
    capture_meta,
    capture_tensors,
    decode,
    encode,
    family,
    layout,
    restore,
    signature,
)
from hpctrain.log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState

log = get_logger(__name__)

KEEP = 2
"""Step directories kept per node (see the module docstring)."""
TAG = 3417
"""Message tag of the tier's sends (its communicator is its own, so any tag would do)."""


def default_dir(checkpoint_dir: Optional[str]) -> str:
    """``/dev/shm/hpctrain-<user>-<job>`` (``$TMPDIR`` without /dev/shm): the SLURM job id when there is one (the
    same for every ``srun`` of one allocation), else a hash of the persistent checkpoint directory (the same for
    every relaunch of one experiment)."""

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        job = "ck" + hashlib.sha256(os.path.abspath(checkpoint_dir or ".").encode()).hexdigest()[:8]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    return os.path.join(base, f"hpctrain-{getpass.getuser()}-{job}")


def partners(rank_nodes: Tuple[int, ...], rank: int, replicas: int) -> List[int]:
    """The ranks holding ``rank``'s copies: the same place on the next ``replicas`` nodes of the ring."""
    nodes: Dict[int, List[int]] = {}
    for r, n in enumerate(rank_nodes):
        nodes.setdefault(n, []).append(r)
    order = sorted(nodes)
    here = order.index(rank_nodes[rank])
    place = nodes[rank_nodes[rank]].index(rank)
    out = []
    for k in range(1, replicas + 1):
        there = nodes[order[(here + k) % len(order)]]
        out.append(there[place % len(there)])
    return out


@dataclass(frozen=True)
class Damaged:
    """One rank's file of one step, as read from one node, that failed its check."""

    step: int
    rank: int
    """The rank whose state the file holds (the writing layout's rank)."""
    node: int
    """The node whose directory it was read from."""
    why: str


class DamagedCopies(LocalStateError):
    """Copies ``load`` found damaged, the same on every rank; nothing was restored."""

    def __init__(self, damaged: List[Damaged]):
        self.damaged = damaged
        super().__init__("; ".join(f"rank {d.rank}'s state of step {d.step} on node {d.node}: {d.why}"
                                   for d in damaged))


@dataclass
class Found:
    """What ``agree`` settled, the same on every rank."""

    step: Optional[int]
    """The newest step every rank's state is held for (None: none)."""
    holders: Dict[int, int]
    """rank -> the rank that sends it its file (absent: its own copy is on its node)."""
    other_layout: Optional[int] = None
    """The newest step held only in files another layout or experiment wrote."""
    lost: int = 0
    """Ranks whose own copy is gone at ``step`` (fetched from partners); resharded, ranks that receive some file."""
    sources: Dict[int, int] = field(default_factory=dict)
    """rank -> the rank of the writing layout whose state it loads (absent: its own; ``trainer.elastic``)."""
    resharded_from: Optional[Dict[str, Any]] = None
    """The layout that wrote ``step`` when it differs from this one in dp only (``hpctrain.localckpt.reshard``)."""
    refused: Optional[str] = None
    """With elastic: why the newest step another layout of this experiment wrote cannot be resharded."""
    shards: Dict[int, List[Tuple[int, int]]] = field(default_factory=dict)
    """With elastic, when the writing layout split state over dp (ZeRO): rank -> ``[(old rank, holder)]``, every
    old data-parallel rank whose file it reads to assemble its shards (``reshard.gather``; holder = the rank
    itself: on its node)."""


class LocalTier:
    def __init__(self, cfg: Any, mesh: Any, runtime: Any):
        lc = cfg.checkpoint.local
        self.every, self.replicas = int(lc.every), int(lc.replicas)
        self.base = str(lc.dir) if lc.dir else default_dir(cfg.checkpoint.dir)
        self.rank, self.size = mesh.world_rank, mesh.world_size
        nodes = runtime.rank_nodes or tuple(range(self.size))
        self.root = store.node_dir(self.base, runtime.node_rank, runtime.emulated_nodes)
        self.local_leader = runtime.local_rank == 0
        self.comm = runtime.mpi_comm.Dup() if self.size > 1 else None
        self.threads = self.comm is not None and _threads_ok()
        self.rank_nodes = nodes
        """Each rank's node."""
        self.targets = partners(nodes, self.rank, self.replicas) if self.replicas else []
        self.sources = [r for r in range(self.size) if r != self.rank and self.rank in
                        (partners(nodes, r, self.replicas) if self.replicas else [])]
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._staged = threading.Event()
        """Set once the save in flight has its tensors on the host (set when none is in flight)."""
        self._staged.set()
        self._hooked: List[Any] = []
        self.stats: List[Dict[str, float]] = []
        """Per save: blocking_s (in the step), write_s (file), replicate_s (sends and receives), bytes."""
        self._sig: Optional[str] = None
        self._listed: Optional[Tuple[List[Dict[int, Dict[str, List[int]]]], str, Optional[Replica]]] = None
        """What ``agree`` decided from (every rank's listing, the signature, the reshard), for ``without``."""
        self._failed: Optional[str] = None
        """This rank's failed save, not yet reported (``agree_failures``)."""
        self.inject: Optional[Callable[[int], bool]] = None
        """``debug.fault=local_save_error``: whether this rank's save of a step is to fail (the trainer's
        ``FaultInjector.save_error``); None: never."""
        os.makedirs(self.root, exist_ok=True)

    # -- saving --------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, train_state: "TrainState") -> float:
        """Start saving ``trainer``'s state now; returns the seconds the step was blocked (the
        host copy's remainder, if any, is waited for in ``before_update``)."""
        t0 = time.perf_counter()
        self.wait()
        saved = capture_meta(train_state)
        self._sig = saved.meta["signature"]
        self._about = {"family": saved.meta["family"], "layout": saved.meta["layout"]}
        step = int(train_state.step)
        record: Dict[str, float] = {"step": step}
        self.stats.append(record)
        if self.threads:
            self._hook(train_state.optimizer)
            self._staged.clear()
            self._thread = threading.Thread(target=self._guarded, args=(train_state, saved, step, record),
                                            name="hpctrain-localckpt", daemon=True)
            self._thread.start()
        else:
            capture_tensors(train_state, saved)
            try:
                self._write(saved, step, record)
            except OSError as e:
                self._failed = self._failure(step, e)
        record["blocking_s"] = time.perf_counter() - t0
        return record["blocking_s"]

    def before_update(self) -> float:
        """Right before the optimizer step: wait until the save in flight has its tensors on the host
        (at once when it has); the seconds waited."""
        if self._staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._staged.wait()
        waited = time.perf_counter() - t0
        if self.stats:
            self.stats[-1]["blocking_s"] = self.stats[-1].get("blocking_s", 0.0) + waited
        return waited

    def _hook(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` itself wait for the host copy, so no update can tear a save
        (torch optimizers; the trainer also calls ``before_update``)."""
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is not None and not any(o is optimizer for o in self._hooked):
            def pre_step(*_: Any) -> None:  # (a step pre-hook returns None or new arguments)
                self.before_update()

            register(pre_step)
            self._hooked.append(optimizer)

    def _guarded(self, train_state: "TrainState", saved: Any, step: int, record: Dict[str, float]) -> None:
        try:
            try:
                capture_tensors(train_state, saved)
            finally:
                self._staged.set()
            self._write(saved, step, record)
        except OSError as e:  # the disk: reported by agree_failures, the run decides
            self._failed = self._failure(step, e)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            log.error("rank %d: local checkpoint of step %d failed: %s", self.rank, step, e)
            self._error = e

    def _failure(self, step: int, e: OSError) -> str:
        """Remove what the failed save of ``step`` left on this node (its temporary files; the step's
        files are unusable without every rank's manifest) and describe the failure."""
        store.remove_partial(self.root, step)
        return f"{type(e).__name__}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")

    @property
    def failed(self) -> bool:
        """This rank's save failed and has not been reported yet (``agree_failures``); without waiting."""
        return self._failed is not None

    def newest_saved(self) -> Optional[int]:
        """The newest step this rank's saves completed (written, replicated), or None."""
        done = [int(r["step"]) for r in self.stats if "write_s" in r]
        return max(done) if done else None

    def agree_failures(self) -> Dict[int, str]:
        """Every rank's save failure since the last call, by rank (collective; empty when none failed). Waits
        for the save in flight first."""
        self.wait()
        mine, self._failed = self._failed, None
        everyone = self.comm.allgather(mine) if self.comm is not None else [mine]
        return {r: why for r, why in enumerate(everyone) if why}

    def _write(self, saved: Any, step: int, record: Dict[str, float]) -> None:
        t0 = time.perf_counter()
        data = encode(saved)
        failed: Optional[OSError] = None
        try:
            path = store.rank_file(self.root, step, self.rank)
            if self.inject is not None and self.inject(step):
                raise OSError(errno.EIO, "debug.fault=local_save_error: injected I/O error", path)
            store.write_atomic(path, data)
        except OSError as e:  # the exchange still runs: the partners wait for this rank's copy
            failed = e
        t1 = time.perf_counter()
        got = self._exchange(data, step)
        for src, blob in got.items():
            if failed is None:
                try:
                    store.write_atomic(store.rank_file(self.root, step, src), blob)
                except OSError as e:
                    failed = e
        if failed is not None:
            raise failed  # no manifest: this node's files of the step are never used
        store.write_manifest(self.root, step, self.rank, [self.rank, *got], str(saved.meta["signature"]),
                             {"family": saved.meta["family"], "layout": saved.meta["layout"],
                              "dp_split": bool(saved.meta.get("dp_split", False))})
        store.prune(self.root, KEEP)
        record.update(write_s=t1 - t0, replicate_s=time.perf_counter() - t1, bytes=float(len(data)))

    def _exchange(self, data: bytes, step: int) -> Dict[int, bytes]:
        """Send ``data`` to the partners, receive the sources' files."""
        if self.comm is None or not (self.targets or self.sources):
            return {}
        from mpi4py import MPI  # MPI starts at import: after bootstrap only

        buf = np.frombuffer(data, dtype=np.uint8)
        size = np.array([buf.size], dtype=np.int64)
        reqs = []
        for t in self.targets:
            reqs.append(self.comm.Isend([size, MPI.INT64_T], dest=t, tag=TAG))
            reqs.append(self.comm.Isend([buf, MPI.BYTE], dest=t, tag=TAG + 1))
        got: Dict[int, bytes] = {}
        for s in self.sources:
            n = np.empty(1, dtype=np.int64)
            self.comm.Recv([n, MPI.INT64_T], source=s, tag=TAG)
            into = np.empty(int(n[0]), dtype=np.uint8)
            self.comm.Recv([into, MPI.BYTE], source=s, tag=TAG + 1)
            got[s] = into.tobytes()
        MPI.Request.Waitall(reqs)
        return got

    @property
    def busy(self) -> bool:
        """A save is still being written or replicated in the background."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight is complete; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self.wait()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    # -- resuming ------------------------------------------------------------------
    def agree(self, train_state: "TrainState", elastic: bool = False) -> Found:
        """What the surviving nodes hold, agreed in one allgather (collective). ``elastic``: a step another
        data-parallel size wrote counts too, dealt out over dp (``hpctrain.localckpt.reshard``)."""
        sig = signature(train_state)
        about: Dict[str, Dict[str, Any]] = {}
        mine = {step: {s: sorted(r) for s, r in by_sig.items()}
                for step, by_sig in store.held(self.root, about).items()}
        everyone = self.comm.allgather((mine, about)) if self.comm is not None else [(mine, about)]
        merged: Dict[str, Dict[str, Any]] = {}
        for _, a in everyone:
            merged.update(a)
        replica = Replica(family(train_state), layout(train_state.mesh), merged) if elastic else None
        self._listed = ([h for h, _ in everyone], sig, replica)
        return decide(self._listed[0], sig, self.size, replica)

    def without(self, damaged: List[Damaged]) -> Found:
        """``agree``'s answer again, with the ``damaged`` copies left out (pure: the same on every rank)."""
        assert self._listed is not None, "agree first"
        listings, sig, replica = self._listed
        for d in damaged:
            for holder, held in enumerate(listings):
                if self.rank_nodes[holder] != d.node:
                    continue
                for ranks in held.get(d.step, {}).values():
                    if d.rank in ranks:
                        ranks.remove(d.rank)
        return decide(listings, sig, self.size, replica)

    def copy_node(self, found: Found, rank: int) -> int:
        """The node whose copy of ``rank``'s state ``load`` reads for ``found``."""
        return self.rank_nodes[found.holders.get(rank, rank)]

    def load(self, train_state: "TrainState", found: Found) -> int:
        """Fetch what this rank lacks from its holder, check it, agree, then restore all but the step, which
        is returned (collective). ``DamagedCopies`` on every rank, with nothing restored, when a copy is
        damaged."""
        assert found.step is not None
        step = found.step
        source = found.sources.get(self.rank, self.rank)
        wanted: List[Tuple[int, int, bytes]]  # (old rank, the rank whose node's copy it is, bytes)
        if found.shards:
            wanted = self._fetch_shards(found, step)
        else:
            data: Optional[bytes] = None
            if self.rank not in found.holders:
                data = _read(store.rank_file(self.root, step, source))
            if self.comm is not None:
                data = self._fetch(found, step, data)
            assert data is not None
            wanted = [(source, found.holders.get(self.rank, self.rank), data)]
        decoded: Dict[int, Any] = {}
        bad: Optional[Tuple[int, int, str]] = None
        for old, holder, data in wanted:
            try:
                decoded[old] = decode(data)
            except LocalStateError as e:
                bad = (old, self.rank_nodes[holder], str(e))
                break
        everyone = self.comm.allgather(bad) if self.comm is not None else [bad]
        seen: Dict[Tuple[int, int], Damaged] = {}
        for b in everyone:
            if b is not None:
                seen.setdefault((b[0], b[1]), Damaged(step, b[0], b[1], b[2]))
        if seen:
            raise DamagedCopies(list(seen.values()))
        saved = decoded[source]
        try:
            return restore(train_state, saved, replica=found.resharded_from is not None,
                           shards=list(decoded.values()) if found.shards else None)
        except LocalStateError as e:
            raise LocalStateError(f"local checkpoint of step {step} for rank {self.rank}: {e}") from None

    def _fetch_shards(self, found: Found, step: int) -> List[Tuple[int, int, bytes]]:
        """``found.shards``: send the files this rank's node holds for others, read or receive this rank's own
        list, in its order (collective)."""
        reqs, keep = [], []
        for r, plan in sorted(found.shards.items()):
            for old, holder in plan:
                if holder == self.rank and r != self.rank:
                    from mpi4py import MPI  # MPI starts at import: after bootstrap only

                    assert self.comm is not None
                    buf = np.frombuffer(_read(store.rank_file(self.root, step, old)), dtype=np.uint8)
                    size = np.array([buf.size], dtype=np.int64)
                    keep += [buf, size]
                    reqs.append(self.comm.Isend([size, MPI.INT64_T], dest=r, tag=TAG + 4))
                    reqs.append(self.comm.Isend([buf, MPI.BYTE], dest=r, tag=TAG + 5))
        out = []
        for old, holder in found.shards.get(self.rank, []):
            if holder == self.rank:
                out.append((old, holder, _read(store.rank_file(self.root, step, old))))
                continue
            from mpi4py import MPI  # MPI starts at import: after bootstrap only

            assert self.comm is not None
            n = np.empty(1, dtype=np.int64)
            self.comm.Recv([n, MPI.INT64_T], source=holder, tag=TAG + 4)
            into = np.empty(int(n[0]), dtype=np.uint8)
            self.comm.Recv([into, MPI.BYTE], source=holder, tag=TAG + 5)
            out.append((old, holder, into.tobytes()))
        if reqs:
            from mpi4py import MPI  # MPI starts at import: after bootstrap only

            MPI.Request.Waitall(reqs)
        return out

    def _fetch(self, found: Found, step: int, data: Optional[bytes]) -> Optional[bytes]:
        from mpi4py import MPI  # MPI starts at import: after bootstrap only

        comm = self.comm
        assert comm is not None
        reqs, keep = [], []
        for r, holder in sorted(found.holders.items()):
            if holder == self.rank:
                # an unreadable file goes as nothing: the receiver finds it damaged, and the ranks agree
                buf = np.frombuffer(_read(store.rank_file(self.root, step, found.sources.get(r, r))), dtype=np.uint8)
                size = np.array([buf.size], dtype=np.int64)
                keep += [buf, size]
                reqs.append(comm.Isend([size, MPI.INT64_T], dest=r, tag=TAG + 2))
                reqs.append(comm.Isend([buf, MPI.BYTE], dest=r, tag=TAG + 3))
        h = found.holders.get(self.rank)
        if h is not None:
            n = np.empty(1, dtype=np.int64)
            comm.Recv([n, MPI.INT64_T], source=h, tag=TAG + 2)
            into = np.empty(int(n[0]), dtype=np.uint8)
            comm.Recv([into, MPI.BYTE], source=h, tag=TAG + 3)
            data = into.tobytes()
        MPI.Request.Waitall(reqs)
        return data

    def forget_after(self, step: int) -> None:
        """Remove this node's steps after ``step`` (a history not continued; all of them on a fresh start)."""
        if self.comm is not None:
            self.comm.Barrier()  # every rank has read what it needed before any is removed
        if self.local_leader:
            store.prune(self.root, KEEP, newer_than=step)


@dataclass
class Replica:
    """What ``decide`` needs to deal another data-parallel size's states out (``trainer.elastic``)."""

    family: str
    """``state.family`` of this run."""
    layout: Dict[str, Any]
    """``state.layout`` of this run."""
    about: Dict[str, Dict[str, Any]]
    """signature -> the family and layout that wrote it (from the manifests)."""


def decide(everyone: List[Dict[int, Dict[str, List[int]]]], sig: str, size: int,
           replica: Optional[Replica] = None) -> Found:
    """The agreed answer from every rank's ``store.held`` (pure: the same on every rank). With ``replica``,
    a step another data-parallel size of this experiment wrote is used when it is newer (or when this layout's
    own files of that step are incomplete)."""
    holders_of: Dict[int, Dict[str, Dict[int, Set[int]]]] = {}  # step -> signature -> rank -> holders
    for holder, held in enumerate(everyone):
        for step, by_sig in held.items():
            for s, ranks in by_sig.items():
                for r in ranks:
                    holders_of.setdefault(int(step), {}).setdefault(s, {}).setdefault(int(r), set()).add(holder)
    other: Optional[int] = None  # the newest step held only by other layouts' files
    refused: Optional[str] = None
    for step in sorted(holders_of, reverse=True):
        by_rank = holders_of[step].get(sig, {})
        if len(by_rank) == size and all(0 <= r < size for r in by_rank):
            holders = {r: min(h) for r, h in by_rank.items() if r not in h}
            return Found(step, holders, other, len(holders), refused=refused)
        for s, held_by in sorted(holders_of[step].items()):
            if s == sig:
                continue
            info = replica.about.get(s) if replica is not None else None
            if replica is None or info is None or info["family"] != replica.family:
                other = other if other is not None else step
                continue
            why = reshard.why_not(info["layout"], replica.layout)
            dealt = None if why else reshard.deal(info["layout"], replica.layout, held_by)
            if dealt is None:
                refused = refused or (f"step {step}: {why}" if why else f"step {step}: not every replica's state "
                                      "is held")
                other = other if other is not None else step
                continue
            sources, holders = dealt
            shards = reshard.gather(info["layout"], replica.layout, held_by) if info.get("dp_split") else {}
            if shards is None:
                refused = refused or f"step {step}: not every data-parallel rank's shards are held"
                other = other if other is not None else step
                continue
            fetching = {r for r, plan in shards.items() if any(h != r for _, h in plan)} if shards else set(holders)
            return Found(step, holders, other, len(fetching), sources, info["layout"], refused, shards)
    return Found(None, {}, other, refused=refused)


def _read(path: str) -> bytes:
    """A local-tier file's bytes; none when it cannot be read (it is then found damaged, not raised on one
    rank alone)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _threads_ok() -> bool:
    from mpi4py import MPI  # MPI starts at import: after bootstrap only

    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE
