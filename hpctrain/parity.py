"""Parity with one process: what a layout trains, as logical tensors, against
the same config in one process.

``record(trainer, steps)`` trains ``steps`` steps and returns, per step, the
logged loss and gradient norm and the gradient of every parameter as a
*logical* tensor: after the gradient sync and before clipping, each rank's
pieces (``ShardSpec.pieces``, padding left out) are gathered and assembled.
Pieces that several ranks hold (replicas) must agree; how far they disagree
is kept per parameter. ``compare`` measures a layout's records against a
one-process run's (``hpctrain.run.reference_trainer``). The multi-rank tests
and ``hpctrain-parity`` (``hpctrain.parity_cli``) both use these.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from hpctrain import hookimpl
from hpctrain.bootstrap import idle_wait
from hpctrain.train.grad_norm import gradient_pairs

T = TypeVar("T")
Box = Tuple[Tuple[int, int], ...]
Piece = Tuple[str, Tuple[int, ...], Box, torch.Tensor]


@dataclass
class StepRecord:
    loss: float
    grad_norm: float
    grads: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Logical gradient by logical name (parameters without a gradient are absent)."""
    replica_diffs: Dict[str, float] = field(default_factory=dict)
    """Largest difference between ranks holding the same piece, by name (absent: they agree)."""


def on_rank0(comm: Any, fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 of ``comm`` while the other ranks sleep (``bootstrap.idle_wait``); its
    result on every rank, or its failure raised on every rank as a RuntimeError."""
    result, error = None, None
    if comm.Get_rank() == 0:
        try:
            result = fn()
        except BaseException:  # noqa: BLE001 - passed to every rank, which raises it
            error = traceback.format_exc()
    idle_wait(comm)
    result, error = comm.bcast((result, error), root=0)
    if error:
        raise RuntimeError(f"rank 0 failed:\n{error}")
    return result


class _GradTap:
    """Collects this rank's gradient pieces once they are final
    (``hpctrain_after_finalize_grads``: reduced, tied embeddings summed, not
    clipped), from whoever owns the gradients (the parameters, or a ZeRO
    optimizer's shards)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.pieces: List[Piece] = []

    @hookimpl
    def hpctrain_after_finalize_grads(self, state):
        if state is not self.trainer.state:
            return
        mesh = state.mesh
        self.pieces = []
        for grad, spec in gradient_pairs(self.trainer.params, self.trainer.optimizer):
            for piece in spec.pieces(mesh.coords, mesh.sizes):
                self.pieces.append((spec.logical_name, spec.global_shape, piece.box,
                                    piece.take(grad).detach().to("cpu", torch.float32).clone()))


def assemble_gathered(everyone: List[List[Piece]]) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """Logical tensors from every rank's pieces, and per name the largest
    difference between replicas of one piece (only names where they differ).
    Raises ValueError when the pieces do not cover a tensor."""
    out: Dict[str, torch.Tensor] = {}
    filled: Dict[str, torch.Tensor] = {}
    diffs: Dict[str, float] = {}
    for found in everyone:
        for name, shape, box, values in found:
            if name not in out:
                out[name] = torch.zeros(shape)
                filled[name] = torch.zeros(shape, dtype=torch.bool)
            where = tuple(slice(a, b) for a, b in box)
            seen = filled[name][where]
            if bool(seen.any()):
                diff = float((out[name][where][seen] - values[seen]).abs().max())
                if diff > 0 or diff != diff:
                    diffs[name] = max(diffs.get(name, 0.0), diff)
            out[name][where] = values
            filled[name][where] = True
    for name, mask in filled.items():
        if not bool(mask.all()):
            raise ValueError(f"{name}: the ranks' pieces do not cover the logical tensor")
    return out, diffs


def record(trainer, steps: int, comm=None, root: Optional[int] = None) -> List[StepRecord]:
    """Train ``steps`` steps; the loss, norm and logical gradients of each.
    ``comm`` (an mpi4py communicator, default the MPI world) gathers the
    pieces, to every rank, or to ``root`` only (the others' records then
    hold no gradients). A one-process trainer passes ``MPI.COMM_SELF``."""
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    comm = comm or MPI.COMM_WORLD
    tap = _GradTap(trainer)
    trainer.pm.register(tap)
    try:
        out = []
        for _ in range(steps):
            m = trainer.train_step()
            if root is None:
                everyone = comm.allgather(tap.pieces)
            else:
                everyone = comm.gather(tap.pieces, root=root)
            grads, diffs = assemble_gathered(everyone) if everyone is not None else ({}, {})
            out.append(StepRecord(m["loss"], m["grad_norm"], grads, diffs))
        return out
    finally:
        trainer.pm.unregister(tap)


@dataclass
class StepDiff:
    """How one step of a layout differs from one process."""

    step: int
    loss: float
    reference_loss: float
    loss_rel: float
    """|loss - reference| / |reference|."""
    grad_rel: float
    """Largest over parameters of max |g - g_ref| / max |g_ref| (0 where the reference is all zeros and so is g)."""
    worst_param: str
    missing: List[str] = field(default_factory=list)
    """Parameters with a gradient on one side only."""
    replica_diffs: Dict[str, float] = field(default_factory=dict)


def relative_grad_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to want's largest element (inf when want is
    zero and got is not; NaN anywhere counts as inf)."""
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    if diff != diff or scale != scale:
        return float("inf")
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def compare(got: List[StepRecord], want: List[StepRecord]) -> List[StepDiff]:
    """Per step: the loss difference and the largest per-parameter gradient difference."""
    out = []
    for step, (g, w) in enumerate(zip(got, want), start=1):
        loss_rel = abs(g.loss - w.loss) / abs(w.loss) if w.loss else abs(g.loss)
        if loss_rel != loss_rel:
            loss_rel = float("inf")
        worst, worst_name = 0.0, ""
        for name, ref in w.grads.items():
            if name in g.grads:
                d = relative_grad_diff(g.grads[name], ref)
                if d > worst or not worst_name:
                    worst, worst_name = d, name
        missing = sorted(set(g.grads) ^ set(w.grads))
        out.append(StepDiff(step, g.loss, w.loss, loss_rel, worst, worst_name, missing, dict(g.replica_diffs)))
    return out
