"""``H5Checkpointer``: the hpctrain Checkpointer protocol over one parallel
HDF5 file per checkpoint.

save: (1) wait for the previous background save, if any; (2) describe this
rank's state and allgather the declarations into a Plan (who writes which
hyperslab); (3) stage: copy the boxes this rank *owns* to host memory (see
``staging``: with ``checkpoint.hdf5.staging=overlap`` the copy runs in the
background during the next forward/backward and ``before_update`` (also
registered as the optimizer's step pre-hook) waits for it before the
optimizer step; with ``blocking`` it runs here; a
synchronous save of CPU tensors skips it and writes from the tensors' own
memory, which training cannot change before the call returns); (4) write
``<name>.h5.tmp`` collectively and (5) commit: every rank has closed the
file, rank 0 renames it, updates ``latest`` and prunes to
``checkpoint.keep``. With ``checkpoint.async_save`` steps 4-5 (and 3 when
overlapped) run on a background thread (see ``asyncsave``); otherwise in
the call. The time training waits (in ``save`` and in ``before_update``)
is measured, kept in ``stats`` and logged.

load: read and verify this rank's boxes by the current layout, then
restore (``restore.load_into``). With ``resume=auto`` a checkpoint that
fails verification is skipped with a warning naming it, and the next
newest is tried; ``load`` returns the path it actually loaded.

All collectives run on ``comm``, the checkpointer's own duplicate of the
world communicator, passed in by the plugin.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Deque, List, Optional, Tuple

from hpctrain import provenance
from hpctrain.checkpoint import Restored
from hpctrain.log import get_logger, log_rank0

from hpctrain_h5ckpt import lock, snapshot, space, store, writer
from hpctrain_h5ckpt.asyncsave import BackgroundSaver, threads_supported
from hpctrain_h5ckpt.errors import CheckpointDirInUse, CheckpointError, CheckpointSaveFailed
from hpctrain_h5ckpt.layout import Plan, PlanError, gather_plan
from hpctrain_h5ckpt.options import IOOptions
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.restore import load_into
from hpctrain_h5ckpt.staging import HostBuffers, Stager

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState

log = get_logger(__name__)


@dataclass
class SaveStats:
    step: int
    path: str
    async_save: bool
    blocking_s: float
    """Time training waited for this save: in save() (includes waited_s) plus staging_wait_s."""
    waited_s: float
    """Part of blocking_s spent in save() waiting for the previous background save."""
    host_bytes: int
    """Bytes of the boxes this rank owns (what it stages to host memory and writes)."""
    total_bytes: int
    """Tensor bytes in the file (all ranks)."""
    staging_wait_s: float = 0.0
    """Part of blocking_s spent in before_update() waiting for an overlapped host copy."""
    write_s: float = 0.0
    """Time from the start of the write to the commit (background when async)."""
    committed: bool = False
    started: float = 0.0
    """``time.perf_counter()`` when the save started, once the previous background save was done."""
    total_s: float = 0.0
    """From ``started`` to the commit: what the same save would take if it had to finish before the job ends
    (``save_seconds``)."""


class H5Checkpointer:
    def __init__(self, comm: Any, opts: IOOptions, directory: Optional[str], keep: int, async_save: bool,
                 staging: str = "overlap", lock_now: bool = False, run_dir: Optional[str] = None,
                 read_only: bool = False):
        """``lock_now``: take the directory's lock at once (a run that saves
        periodically or resumes); otherwise at the first save. ``read_only``:
        the run does not save by itself (``hpctrain-eval``; ``every=0`` with
        ``save_on_stop=false``), so it reads without the lock and removes
        nothing: it reads only committed files, which a training run writing
        the same directory never changes. A save asked for in code
        (``trainer.save_checkpoint()``) still takes the lock. Collective."""
        self.comm, self.opts, self.directory, self.keep = comm, opts, directory, keep
        self.read_only = read_only
        self.run_dir = run_dir
        self._lock: Optional[lock.DirLock] = None
        self._locked = False
        self.overlap = staging == "overlap"
        self.rank = comm.Get_rank()
        self._bg: Optional[BackgroundSaver] = None
        if async_save:
            if threads_supported():
                self._bg = BackgroundSaver(self.rank)
            elif self.rank == 0:
                log.warning("checkpoint.async_save=true needs MPI_THREAD_MULTIPLE; this MPI gives less, "
                            "so saves are synchronous")
        self._auto: List[str] = []
        self._cached_plan: Optional[Tuple[Any, Plan]] = None
        self._buffers = HostBuffers() if self._bg is not None else None
        self._static: Optional[Tuple[Any, Tuple[bytes, str, str]]] = None
        self._hooked: List[Any] = []
        self.stats: Deque[SaveStats] = deque(maxlen=1000)
        """The most recent saves' timings (blocking, write, bytes)."""
        self.inject: Optional[Callable[[int], bool]] = None
        """``debug.fault=save_error``: whether this rank's part of the save of a step is to fail (set by the
        plugin from the core's ``FaultInjector.save_error``); None: never."""
        if lock_now:
            self._ensure_lock()

    # -- the directory's lock --------------------------------------------------
    def _ensure_lock(self, saving: bool = False) -> None:
        """Take the directory's lock once (collective: rank 0 takes it, every
        rank learns the outcome); then remove what crashed saves left, which
        only the holder can tell from a live run's files. A read-only
        checkpointer takes it only to save."""
        if self._locked or not self.directory or (self.read_only and not saving):
            return
        problem = None
        if self.rank == 0:
            try:
                self._lock = lock.acquire(self.directory, self.run_dir)
            except lock.DirInUse as e:
                problem = (f"checkpoint.dir {os.path.abspath(self.directory)} is in use by {e}: two runs in one "
                           "directory resume from and overwrite each other's checkpoints; wait for that run to "
                           "end, or give this run its own checkpoint.dir")
            except OSError as e:
                problem = f"checkpoint.dir {os.path.abspath(self.directory)}: cannot take its lock ({e})"
            else:
                for path in store.orphans(self.directory):  # no save of another run can be in flight here
                    try:
                        os.remove(path)
                        log.warning("removed %s, left by a save that did not finish", path)
                    except OSError:
                        pass
        problem = self.comm.bcast(problem, root=0)
        if problem:
            raise CheckpointDirInUse(problem)
        self._locked = True

    def close(self) -> None:
        """The run is over: wait for a background save, then let go of the directory."""
        try:
            self.wait()
        finally:
            if self._lock is not None:
                lock.release(self._lock)
                self._lock = None

    # -- saving ----------------------------------------------------------------
    def save(self, train_state: "TrainState", path: Optional[str] = None) -> str:
        t0 = time.perf_counter()
        waited = self._bg.wait() if self._bg is not None else 0.0
        started = time.perf_counter()
        step = int(train_state.step)
        if path is None:
            if self.directory is None:
                raise CheckpointError("no checkpoint directory: set checkpoint.dir")
            path = os.path.join(self.directory, store.checkpoint_name(step))
        final = os.path.abspath(path)
        if self.directory and os.path.dirname(final) == os.path.abspath(self.directory):
            self._ensure_lock(saving=True)
        if self.rank == 0:
            os.makedirs(os.path.dirname(final), exist_ok=True)
        if self._static is None or self._static[0] is not train_state.cfg:
            self._static = (train_state.cfg, self._static_text(train_state.cfg))
        view = snapshot.describe(train_state, self._static[1])
        try:
            plan = self._plan(view)  # collective: also orders rank 0's makedirs before the file is opened
        except PlanError as e:
            raise CheckpointError(f"checkpoint {final}: {e}") from e
        needed = space.needed_bytes(plan, self.opts.alignment)
        attrs, short = self.comm.bcast((view.attrs, self._room_problem(final, needed))
                                       if self.rank == 0 else None, root=0)
        if short:
            raise CheckpointSaveFailed(f"checkpoint step {step} not saved: {short}; older checkpoints are untouched")
        stager = Stager(view, plan.owned_by(self.rank), self._buffers)
        if self._bg is not None and self.overlap:
            self._hook_optimizer(train_state.optimizer)
        del view
        stats = SaveStats(step=step, path=final, async_save=self._bg is not None, blocking_s=0.0, waited_s=waited,
                          host_bytes=stager.nbytes, total_bytes=sum(plan.bytes_by_rank().values()),
                          started=started)
        self.stats.append(stats)

        def stage() -> Tuple[Optional[writer.Owned], Optional[str]]:
            try:
                if self.inject is not None and self.inject(step):
                    raise OSError(errno.EIO, "debug.fault=save_error: injected I/O error")
                return stager.copy(), None
            except Exception as e:  # noqa: BLE001 - agreed in write(), so no rank is left alone in a collective
                return None, f"{type(e).__name__}: {e}"

        def write(staged: Tuple[Optional[writer.Owned], Optional[str]]) -> None:
            owned, error = staged
            errors = self.comm.allgather(error)
            if any(errors):
                raise CheckpointSaveFailed(f"checkpoint step {step} not saved: copying to host memory failed: "
                                           f"{writer.summarize_failures(errors)}")
            assert owned is not None  # no rank failed, this one neither
            self._write_and_commit(plan, owned, attrs, final, stats, needed)

        if self._bg is None:
            write(stage())
            stats.blocking_s = time.perf_counter() - t0
            log_rank0("checkpoint step %d: training blocked %.3f s (synchronous save)", step, stats.blocking_s)
        elif self.overlap:
            self._bg.submit(stage, write, f"step{step}")
            stats.blocking_s = time.perf_counter() - t0
            log_rank0("checkpoint step %d: training blocked %.3f s (waited %.3f s for the previous save); copying "
                      "%.1f MB to host during the next step, then writing %s in the background", step,
                      stats.blocking_s, waited, stats.host_bytes / 1e6, os.path.basename(final))
        else:
            staged = stage()
            self._bg.submit(lambda: staged, write, f"step{step}")
            stats.blocking_s = time.perf_counter() - t0
            log_rank0("checkpoint step %d: training blocked %.3f s (waited %.3f s for the previous save, "
                      "copied %.1f MB to host); writing %s in the background", step, stats.blocking_s, waited,
                      stats.host_bytes / 1e6, os.path.basename(final))
        return final

    def _static_text(self, cfg: Any) -> Tuple[bytes, str, str]:
        """(config YAML, versions JSON, provenance JSON) for a run's saves, once per config (collective: every
        rank's node; rank 0 alone computes the provenance, whose attributes are the ones written)."""
        text, versions = snapshot.static_text(cfg)
        hosts = self.comm.allgather(os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        record = json.dumps(provenance.record(text, cfg.data, hosts)) if self.rank == 0 else ""
        return text, versions, record

    @staticmethod
    def _room_problem(final: str, needed: int) -> Optional[str]:
        """Rank 0, before the file is opened: a full disk stops the run without touching the directory."""
        return space.shortage(os.path.dirname(final), needed)

    def before_update(self) -> None:
        """Called by the trainer right before the optimizer step: wait until an
        overlapped host copy is done (at once when nothing is being staged).
        A failed copy is agreed among the ranks in the background and raised
        by the next ``save``/``wait``, like a failed write."""
        if self._bg is None or not self._bg.staging:
            return
        stats = self.stats[-1]
        waited = self._bg.wait_staged()
        stats.staging_wait_s += waited
        stats.blocking_s += waited
        if waited >= 1e-3:
            log_rank0("checkpoint step %d: the optimizer step waited %.3f s for the host copy", stats.step, waited)

    def _hook_optimizer(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` itself wait for an overlapped copy, so a
        training loop that never calls ``before_update`` cannot tear a
        checkpoint (torch optimizers; others rely on the caller)."""
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is None or any(o is optimizer for o in self._hooked):
            return
        register(lambda *_: self.before_update())
        self._hooked.append(optimizer)

    def _plan(self, view: snapshot.StateView) -> Plan:
        """The Plan, reused while no rank's declaration changed: then an
        allgather of a flag and the step replaces the allgather of every
        dataset's declaration (pickled; with thousands of tensors a visible
        part of the time an async save blocks the step)."""
        signature = (tuple(view.decls), tuple((p, tuple(b)) for p, b in view.boxes.items()))
        cached = self._cached_plan is not None and self._cached_plan[0] == signature
        everyone = self.comm.allgather((cached, view.meta))
        if all(ok for ok, _ in everyone) and all(m == view.meta for _, m in everyone):
            assert self._cached_plan is not None  # this rank's flag said cached
            plan = self._cached_plan[1]
            plan.meta = dict(view.meta)
            return plan
        plan = gather_plan(self.comm, view.decls, view.boxes, view.meta)
        self._cached_plan = (signature, plan)
        return plan

    def _write_and_commit(self, plan: Plan, owned: writer.Owned, attrs: dict, final: str, stats: SaveStats,
                          needed: int) -> None:
        t0 = time.perf_counter()
        tmp = store.tmp_path(final)
        try:
            writer.write_file(tmp, plan, owned, attrs, self.comm, self.opts)
        except CheckpointError as e:
            message = None
            if self.rank == 0:
                try:
                    os.remove(tmp)  # nothing committed; older checkpoints are untouched
                except FileNotFoundError:
                    pass
                # measured once the partial file is gone: did the file system run out of room?
                short = space.shortage(os.path.dirname(final), needed)
                fix = None if short else writer.fix_for(str(e))
                message = (f"checkpoint step {stats.step} not saved: {short or e}; older checkpoints are "
                           "untouched" + (f"; {fix}" if fix else ""))
            message = self.comm.bcast(message, root=0)  # every rank raises only once the .tmp is gone
            raise CheckpointSaveFailed(message) from e
        error = None
        if self.rank == 0:
            try:
                removed = store.commit(tmp, final, self.directory, self.keep, self.opts.fsync)
                if removed:
                    log_rank0("pruned %s (checkpoint.keep=%d)", ", ".join(os.path.basename(p) for p in removed),
                              self.keep)
            except OSError as e:
                error = f"checkpoint {final}: commit failed ({e}); older checkpoints are untouched"
        error = self.comm.bcast(error, root=0)
        if error:
            raise CheckpointError(error)
        done = time.perf_counter()
        stats.write_s, stats.total_s, stats.committed = done - t0, done - stats.started, True
        log_rank0("checkpoint step %d committed: %s, %.1f MB in %.2f s (%.0f MB/s)", stats.step, final,
                  stats.total_bytes / 1e6, stats.write_s, stats.total_bytes / 1e6 / max(stats.write_s, 1e-9))

    def save_seconds(self) -> Optional[float]:
        """The longest of the last few committed saves, start to commit (background writing included), or
        None before the first: the time a stop's save needs (``hpctrain.train.deadline``)."""
        recent = [s.total_s for s in list(self.stats)[-8:] if s.committed]
        return max(recent) if recent else None

    def wait(self) -> None:
        if self._bg is not None:
            self._bg.wait()

    def failed(self) -> bool:
        """A background save has failed and its error waits for the next ``wait()`` (never blocks)."""
        return self._bg is not None and self._bg.failed

    @property
    def busy(self) -> bool:
        """A background save is still copying, writing or committing."""
        return self._bg is not None and self._bg.busy

    # -- resuming --------------------------------------------------------------
    def resolve(self, resume: str) -> Optional[str]:
        """"auto": the newest committed checkpoint in the directory (older ones
        are kept as fallbacks for load); another directory: the same there;
        a file: exactly that file. Takes the directory's lock first (collective)."""
        self._ensure_lock()
        if resume == "auto":
            found = store.candidates(self.directory) if (self.rank == 0 and self.directory) else []
            if self.rank == 0:
                self._say_what_auto_found(found)
            self._auto = self.comm.bcast(found, root=0)
            return self._auto[0] if self._auto else None
        found, is_dir = [], False
        if self.rank == 0:
            p = os.path.abspath(resume)
            is_dir = os.path.isdir(p)
            found = store.candidates(p) if is_dir else ([p] if os.path.isfile(p) else [])
        found, is_dir = self.comm.bcast((found, is_dir), root=0)
        self._auto = found if is_dir else []  # a directory falls back like auto; a file is exactly that file
        path = found[0] if found else None
        if path is None:
            raise CheckpointError(f"checkpoint.resume={resume}: no checkpoint file there (expected a .h5 file, "
                                  "a checkpoint directory, or auto)")
        return path

    def _say_what_auto_found(self, found: List[str]) -> None:
        where = os.path.abspath(self.directory) if self.directory else "(no checkpoint.dir)"
        if not found:
            log_rank0("checkpoint.resume=auto: no committed checkpoint (step_*.h5) in %s%s",
                      where, self._siblings_note())
            return
        steps = [store.step_of(os.path.basename(p)) for p in found]
        log_rank0("checkpoint.resume=auto: %d checkpoint(s) in %s (steps %s); trying the newest, step %d",
                  len(found), where, ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else ""), steps[0])
        assert self.directory is not None  # the candidates were found in it
        latest = store.read_latest(self.directory)
        if latest and os.path.abspath(latest) != os.path.abspath(found[0]):
            log.warning("checkpoint.resume=auto: 'latest' names %s, older than %s; the newest committed "
                        "checkpoint wins", os.path.basename(latest), os.path.basename(found[0]))

    def _siblings_note(self) -> str:
        """The directories beside this one made for the same model (the default
        directory is ``<model>-<hash of the experiment's settings>``), with their
        newest step: a changed setting (a new global batch size) gives a new
        directory, and the user should know the old one is there."""
        if not self.directory:
            return ""
        here = os.path.abspath(self.directory)
        parent, name = os.path.split(here)
        prefix = name.rsplit("-", 1)[0] + "-" if "-" in name else None
        if prefix is None:
            return ""
        try:
            names = sorted(os.listdir(parent))
        except OSError:
            return ""
        found = []
        for other in names:
            path = os.path.join(parent, other)
            if other == name or not other.startswith(prefix) or not os.path.isdir(path):
                continue
            newest = store.committed(path)
            if newest:
                found.append(f"{other} (step {store.step_of(newest[0])})")
        if not found:
            return ""
        return (f". Checkpoints of the same model with other experiment settings (model, data, optimizer, batch, "
                f"sequence, seed or precision) are beside it in {parent}: {', '.join(found[:5])}"
                + (f" and {len(found) - 5} more" if len(found) > 5 else "")
                + "; to continue one of them, set checkpoint.resume=<its path> (checkpoint.allow_batch_change=true "
                "if only the global batch changed)")

    def load(self, train_state: "TrainState", path: str) -> Restored:
        self.wait()
        queue = [path] + [p for p in self._auto if p != path] if path in self._auto else [path]
        bad: List[str] = []
        for candidate in queue:
            try:
                with CheckpointReader(candidate, self.comm, self.opts) as reader:
                    restored = load_into(train_state, reader)
            except CheckpointError as e:
                if path not in self._auto:
                    raise
                bad.append(f"{candidate}: {e}")
                if self.rank == 0:
                    log.warning("checkpoint.resume=auto: skipping unusable checkpoint %s:\n%s", candidate, e)
                continue
            if bad and self.rank == 0:
                log.warning("checkpoint.resume=auto: resumed from %s after skipping %d unusable newer checkpoint(s)",
                            candidate, len(bad))
            return restored
        raise CheckpointError("checkpoint.resume=auto: no usable checkpoint in "
                              f"{self.directory}; every candidate failed:\n" + "\n".join(bad))
