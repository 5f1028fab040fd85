"""``Checkpointing``: where a run saves and what it resumes from, in one place.

A run has up to two checkpoint tiers:

- the **persistent** one, a format plugin's ``Checkpointer``
  (``checkpoint.format``, every ``checkpoint.every`` steps, on a stop);
- the **node-local** one (``checkpoint.local.every``, ``hpctrain.localckpt``):
  fast copies on each node's disk with partner copies on other nodes, a cache
  of the newest state for restarts inside the allocation.

The coordinator owns both and the trainer keeps only the loop: ``resume()``
once before step 1, ``maybe_save_local(step)`` at every step boundary before
the step's metrics are logged (its blocking time is one of them),
``maybe_save(step)`` after them (a failed persistent save stops the run
with the step's line already written),
``before_update()`` right before every optimizer step (an async save may
still be copying state to host memory), ``save()`` on demand (a stop), and
``close()`` at the end of the run. Each tier reads and restores the run's
``TrainState``; a load says what it restored and the coordinator, not the
format, sets the step.

The resume rule (``checkpoint.resume``), the same on every rank:

1. the persistent tier first: ``resume=<path>`` or ``auto`` (its newest
   usable checkpoint, skipping damaged ones);
2. then, with ``resume=auto`` and a local tier, its newest step that every
   rank's state is held for on the surviving nodes (``LocalTier.agree``)
   replaces it when newer (``choose_local``, pure logic); a step another
   layout or experiment wrote is not used, unless ``trainer.elastic`` and
   only dp changed;
3. a damaged local copy (a flipped bit, a truncated file: every rank checks
   what it got and the ranks agree before anything is restored) is left
   out and the rule decides again: a partner node's copy of the same step,
   else an older local step, else the persistent checkpoint; one line says
   which;
4. local steps after the one resumed from are forgotten (all of them on a
   fresh start), so a later failure never mixes two histories.

The local tier is a cache: a local save that fails (a full or broken
node-local disk) leaves no temporary files. It, and a background persistent
save that fails, is reported in one line at the next step boundary (or by
the next save of its tier, whichever comes first); training goes on when the
other tier holds a recent state, and otherwise stops after a save attempt
with exit status 6 (``hpctrain.train.save_failures``; ``LocalSaveFailed``).

A resumed checkpoint saved by another optimizer is refused before training
(``refuse_another_optimizer``), not by ``hpctrain-eval``, which takes no
step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence

from hpctrain.bootstrap import get_runtime
from hpctrain.checkpoint import Checkpointer, Restored
from hpctrain.errors import ConfigError, PluginError
from hpctrain.localckpt import LocalTier
from hpctrain.localckpt.tier import DamagedCopies, Found
from hpctrain.log import log_rank0
from hpctrain.provenance import software, stack_changes
from hpctrain.train.faults import FaultInjector
from hpctrain.train.save_failures import (
    LOCAL,
    PERSISTENT,
    SaveFailedStop,
    after_local,
    after_persistent,
    first_failure,
    stop_message,
    who,
)
from hpctrain.train.state import TrainState


class LocalSaveFailed(SaveFailedStop):
    """A local save failed on some rank and no persistent checkpoint is configured to fall back on: every
    rank stops after a save attempt (exit status 6, as a failed persistent save)."""


@dataclass(frozen=True)
class Resumed:
    """What a run resumed from."""

    tier: str = "none"
    """``local``, ``persistent`` or ``none`` (``hpctrain.train.recovery`` reports it)."""
    checkpoint: Optional[str] = None
    """The persistent checkpoint loaded, if one was."""
    optimizer: Optional[str] = None
    """The ``optim.name`` that saved what was loaded, where recorded."""


@dataclass
class LocalChoice:
    """``choose_local``'s answer: whether to load the local tier's step, and the lines to log."""

    use: bool
    notes: List[str] = field(default_factory=list)


def choose_local(found: Found, step_now: int, where: str) -> LocalChoice:
    """Whether the local tier's agreed step (``found``) replaces the state at ``step_now`` (what the
    persistent tier gave, 0 without one), with the lines that say why. Pure: the same on every rank."""
    notes = []
    if found.refused is not None:
        notes.append(f"local tier ({where}): {found.refused}; trainer.elastic=true reshards the local tier over dp "
                     "only, so this step is not used")
    if found.other_layout is not None:
        notes.append(f"local tier ({where}): step {found.other_layout} was written by another layout or experiment; "
                     "not used, falling back to the persistent checkpoint")
    if found.step is None:
        notes.append(f"local tier ({where}): no step that every rank's state is held for")
        return LocalChoice(False, notes)
    if found.step <= step_now:
        notes.append(f"local tier ({where}): its newest complete step {found.step} is not newer than the persistent "
                     f"checkpoint's step {step_now}; using the persistent checkpoint")
        return LocalChoice(False, notes)
    return LocalChoice(True, notes)


def damaged_line(where: str, damaged: DamagedCopies, found: Found, use: bool, step_now: int) -> str:
    """One line: which local copies were found damaged, and what the resume uses instead."""
    if use and found.step == min(d.step for d in damaged.damaged):
        instead = "using the partner node's copy"
    elif use:
        instead = f"using the local tier's step {found.step}"
    elif step_now:
        instead = f"using the persistent checkpoint (step {step_now})"
    else:
        instead = "no other copy or step to use: starting from step 0"
    return f"local tier ({where}): damaged copy: {damaged}; {instead}"


class Checkpointing:
    """The run's checkpoint tiers and its resume rule (see the module docstring)."""

    def __init__(self, state: TrainState, pm: Any, faults: Optional[FaultInjector] = None):
        self.state, self.pm = state, pm
        self.faults = faults
        self.persistent: Optional[Checkpointer] = self._make_persistent()
        """The format plugin's checkpointer; None until a stop saves when the run neither saves
        periodically nor resumes."""
        self.local: Optional[LocalTier] = self._make_local()
        """The node-local tier, or None."""
        self.resumed = Resumed()
        self.save_times: Deque[float] = deque(maxlen=8)
        """The last persistent saves' durations as this rank measured them, start to commit (the
        checkpointer's ``save_seconds()`` where it saves in the background; else the call's own time)."""
        self.blocked_s = 0.0
        """Seconds persistent saves blocked the loop since ``take_blocked`` last asked (the deadline counts them
        as the save, not as the step)."""

    # -- set-up ----------------------------------------------------------------------
    def _make_persistent(self, for_stop: bool = False) -> Optional[Checkpointer]:
        """The format plugin's checkpointer: at set-up when the run saves periodically or resumes;
        otherwise only when a stop is about to save (``for_stop``), on every rank at once (the ranks agreed
        to stop), so a run that is never stopped makes none (the plugin's is collective over the world,
        which a one-process reference inside an MPI job is not)."""
        ck = self.state.cfg.checkpoint
        if not (ck.every or ck.resume or for_stop):
            return None
        made = self.pm.hook.hpctrain_make_checkpointer(name=ck.format, mesh=self.state.mesh, cfg=self.state.cfg,
                                                       run_dir=self.state.run_dir)
        if made is None:
            raise PluginError(f"checkpoint.format={ck.format!r}: no plugin made a checkpointer")
        return made

    def _make_local(self) -> Optional[LocalTier]:
        """The local tier when ``checkpoint.local.every`` is set and this run is the whole job (a
        one-process reference inside an MPI job keeps none)."""
        cfg, mesh = self.state.cfg, self.state.mesh
        if not cfg.checkpoint.local.every:
            return None
        rt = get_runtime()
        if rt.world_size != mesh.world_size:
            return None
        tier = LocalTier(cfg, mesh, rt)
        faults = self.faults
        if faults is not None:
            tier.inject = lambda step: faults.save_error(step, "local")  # debug.fault=local_save_error
        return tier

    # -- resuming --------------------------------------------------------------------
    def resume(self) -> Resumed:
        """Apply the resume rule (module docstring; collective) and set ``state.step``."""
        state, cfg = self.state, self.state.cfg
        resume = str(cfg.checkpoint.resume) if cfg.checkpoint.resume else ""
        if self.persistent is not None and resume:
            path = self.persistent.resolve(resume)
            if path is not None:
                restored: Restored = self.persistent.load(state, path)
                state.step = restored.step
                self.resumed = Resumed("persistent", restored.path, restored.optimizer)
                log_rank0("resumed from %s at step %d (%d samples consumed)", restored.path, state.step,
                          state.cursor.consumed_samples)
                changed = stack_changes(restored.provenance, software())
                if changed:  # information: a newer stack loads an older checkpoint
                    log_rank0("%s was saved on another software stack (hpctrain-ckpt inspect shows its "
                              "provenance):\n  %s", restored.path, "\n  ".join(changed))
        tier = self.local
        if tier is None:
            return self.resumed
        if resume == "auto":
            found = tier.agree(state, bool(cfg.trainer.elastic))
            choice = choose_local(found, state.step, tier.base)
            for line in choice.notes:
                log_rank0("%s", line)
            while choice.use:
                try:
                    state.step = tier.load(state, found)
                    break
                except DamagedCopies as e:  # nothing restored: decide again without them
                    found = tier.without(e.damaged)
                    choice = choose_local(found, state.step, tier.base)
                    log_rank0("%s", damaged_line(tier.base, e, found, choice.use, state.step))
            if choice.use:
                self.resumed = Resumed("local", None, None)
                log_rank0("resumed from the local tier (%s) at step %d (%d samples consumed); %d rank(s)' state "
                          "fetched from partner nodes", tier.base, state.step, state.cursor.consumed_samples,
                          found.lost)
                if found.resharded_from is not None:
                    old = found.resharded_from
                    log_rank0("local tier: step %d was written at dp(%d) on %d ranks, resharded to dp(%d) on %d "
                              "(trainer.elastic=true: each rank loads a data-parallel replica's state)", state.step,
                              int(old["sizes"]["dp"]), int(old["world_size"]), state.mesh.size("dp"),
                              state.mesh.world_size)
        tier.forget_after(state.step)
        return self.resumed

    def refuse_another_optimizer(self) -> None:
        """A ConfigError, on every rank alike, when the checkpoint resumed was saved by
        another optimizer: its state is not this one's (AdamW fails at its first step
        without its moments; LARS would carry AdamW's along into every later save).
        Asked before training, not by ``hpctrain-eval``, which takes no step."""
        saved, now = self.resumed.optimizer, str(self.state.cfg.optim.name)
        if saved is None or saved == now:
            return
        path = self.resumed.checkpoint
        raise ConfigError(f"checkpoint {path} holds the optimizer state of optim.name={saved!r}, and this run uses "
                          f"{now!r}; resume with optim={saved}, or start {now} from its weights alone in another "
                          f"checkpoint.dir with checkpoint.init_from={path} (step 0, a fresh optimizer state)")

    # -- saving ----------------------------------------------------------------------
    def maybe_save_local(self, step: int) -> Dict[str, float]:
        """At the boundary after optimizer step ``step``: the local tier's save when due (collective).
        Returns ``{"local_ckpt_blocking_s": seconds}`` when it saved, for the step's metrics."""
        if self.local is None or not self.local.due(step):
            return {}
        self._local_failures()  # the previous local save's, agreed before the next one starts
        return {"local_ckpt_blocking_s": self.local.save(self.state)}

    def maybe_save(self, step: int) -> Optional[str]:
        """At the boundary after optimizer step ``step``, once its metrics are logged: the persistent tier's
        save when ``checkpoint.every`` is due (collective). Its path, or None."""
        every = int(self.state.cfg.checkpoint.every)
        if self.persistent is not None and every and step % every == 0:
            if self.state.cfg.checkpoint.async_save and getattr(self.persistent, "failed", None) is not None:
                self._persistent_failures()  # the previous background save's, agreed before this one starts
            return self.save()
        return None

    def save(self, path: Optional[str] = None, for_stop: bool = False) -> Optional[str]:
        """Save the persistent tier now (collective): ``checkpoint.every``, or on demand (a stop, with
        ``for_stop`` making the checkpointer if the run had none). None without a checkpointer."""
        if self.persistent is None and for_stop:
            self.persistent = self._make_persistent(for_stop=True)
        if self.persistent is None:
            return None
        state = self.state
        if self.faults is not None:
            self.faults.before_checkpoint(state.step)
        board = state.mesh.board
        board.phase = "checkpoint save"
        # one numbered op over the world: a rank that never enters is named by the hang watchdog
        t0 = time.monotonic()
        with board.collective("checkpoint save", "checkpoint", tuple(range(state.mesh.world_size))):
            saved = self.persistent.save(state, path)
        board.phase = "training"
        blocked = time.monotonic() - t0
        self.blocked_s += blocked
        self.save_times.append(blocked)
        self.pm.hook.hpctrain_on_checkpoint(state=state, step=state.step, path=saved)
        return saved

    def save_seconds(self) -> float:
        """The longest of the recent persistent saves, start to commit, as measured (0 before the first): a
        checkpointer that commits in the background answers ``save_seconds()`` with its own measure
        (``hpctrain.checkpoint``), which replaces the time the call blocked."""
        own = getattr(self.persistent, "save_seconds", None)
        measured = own() if own is not None else None
        return max([*self.save_times, *([measured] if measured is not None else [])], default=0.0)

    def take_blocked(self) -> float:
        """The seconds persistent saves blocked the loop since the last call."""
        out, self.blocked_s = self.blocked_s, 0.0
        return out

    def before_update(self) -> float:
        """Right before the optimizer step: wait until the saves in flight have copied what the update
        changes (persistent async saves, the local tier's host copy). The seconds the local tier waited."""
        wait = getattr(self.persistent, "before_update", None)
        if wait is not None:
            wait()
        return self.local.before_update() if self.local is not None else 0.0

    def finish_local(self) -> None:
        """The run's last step is done: the local tier's last save completes (and its failure is reported)
        before the run ends."""
        if self.local is not None:
            self._local_failures()
            self.local.close()

    # -- saves that failed out of sight (hpctrain.train.save_failures) -------------------------
    def failure_flags(self) -> List[int]:
        """This rank's failed background saves not yet reported, without waiting: 1 at ``PERSISTENT`` and
        ``LOCAL`` where one failed (for the stop agreement, which ORs them over the ranks)."""
        flags = [0, 0]
        failed = getattr(self.persistent, "failed", None)
        flags[PERSISTENT] = int(bool(failed is not None and failed()))
        flags[LOCAL] = int(self.local is not None and self.local.failed)
        return flags

    def after_failures(self, flags: Sequence[int]) -> None:
        """The agreed flags of ``failure_flags`` at a step boundary: report each failure in one line and go on
        when the other tier holds a recent state; else stop after a save attempt (``SaveFailedStop``).
        Collective when a flag is set (the same on every rank)."""
        if flags and flags[LOCAL]:
            self._local_failures()
        if flags and flags[PERSISTENT]:
            self._persistent_failures()

    def _allgather(self, mine: Any, what: str) -> List[Any]:
        mesh = self.state.mesh
        if mesh.world_size == 1:
            return [mine]
        with mesh.board.collective(what, "checkpoint", tuple(range(mesh.world_size))):
            return get_runtime().mpi_comm.allgather(mine)

    def _persistent_failures(self) -> None:
        """Wait for the background persistent save and agree on its failure (collective); report it and go
        on with the local tier, or stop after a save attempt."""
        assert self.persistent is not None
        mine = None
        try:
            self.persistent.wait()
        except Exception as e:  # noqa: BLE001 - the background save's error, whatever it is: agreed below
            mine = str(e).splitlines()[0] if str(e) else type(e).__name__
        held = self.local.newest_saved() if self.local is not None else None
        everyone = self._allgather((mine, held), "checkpoint failures")
        failed = first_failure([m for m, _ in everyone])
        if not failed:
            return
        nodes = self.local.rank_nodes if self.local is not None else get_runtime().rank_nodes
        ranks, first = who(failed, nodes)
        agreed = len(failed) == len(everyone) and len(set(failed.values())) == 1  # (it names the ranks itself)
        what = f"a background checkpoint save failed: {first}" if agreed else \
            f"a background checkpoint save failed on rank(s) {ranks}: {first}"
        local_every = int(self.state.cfg.checkpoint.local.every) if self.local is not None else 0
        verdict = after_persistent(what, [h for _, h in everyone], local_every)
        if verdict.go_on:
            log_rank0("%s", verdict.line)
            return
        self._stop_after_attempt(verdict.line, SaveFailedStop)

    def _local_failures(self) -> None:
        """Report the local tier's failed save, agreed over the ranks (collective); stop after a save
        attempt with ``LocalSaveFailed`` when no persistent checkpoint is configured to fall back on."""
        assert self.local is not None
        failed = self.local.agree_failures()
        if not failed:
            return
        ranks, first = who(failed, self.local.rank_nodes)
        verdict = after_local(f"a local checkpoint save failed on rank(s) {ranks}: {first}",
                              int(self.state.cfg.checkpoint.every))
        if verdict.go_on:
            log_rank0("%s", verdict.line)
            return
        self._stop_after_attempt(verdict.line, LocalSaveFailed)

    def _stop_after_attempt(self, line: str, error: type) -> None:
        """Save the persistent tier now and wait for its commit (collective), then stop with ``error``
        saying what the attempt did."""
        saved: Optional[str] = None
        failed: Optional[str] = None
        try:
            saved = self.save(for_stop=True)
            if self.persistent is not None:
                self.persistent.wait()
        except Exception as e:  # noqa: BLE001 - the attempt's outcome goes into the stop's message
            failed = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(stop_message(line, saved, failed))

    def close(self) -> None:
        """The run is over: wait for a background save and let go of the checkpoint directory (collective)."""
        if self.persistent is None:
            return
        board = self.state.mesh.board
        board.phase = "checkpoint finish"
        # a checkpointer without close() only waits
        finish = getattr(self.persistent, "close", self.persistent.wait)
        with board.collective("checkpoint finish", "checkpoint", tuple(range(self.state.mesh.world_size))):
            finish()
