"""The auxiliary-loss channel: losses a model part adds to the training
objective besides the language-model loss (an MoE router's load-balancing
and z-losses).

A part calls ``add_aux_loss(name, value)`` in its forward. Whoever runs the
forward for training (a step schedule) collects them::

    with collect_aux_losses() as aux:
        loss = model(inputs, targets)
    ((loss + aux.total()) / num_microbatches).backward()

so an auxiliary loss is scaled like the main loss and reaches backward on
the rank (pipeline stage) that computed it. The logged ``loss`` stays the
language-model loss, comparable across models and layouts; a plugin reports
its auxiliary values through ``hpctrain_step_metrics``. Outside a
``collect_aux_losses`` block (inference) ``add_aux_loss`` does nothing;
activation recomputation replays a forward with a throwaway collector
(``replaying``), and a part that keeps statistics asks
``hpctrain.model.recompute.recomputing()`` to count each forward once.

The collector is found through a context variable: dynamic scope, like
``torch.autocast``, so a part needs no reference to the model that runs it.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Iterator, List, Optional, Tuple

import torch

_ACTIVE: contextvars.ContextVar[Optional["AuxLosses"]] = contextvars.ContextVar("hpctrain_aux_losses", default=None)
_SCALE: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("hpctrain_objective_scale", default=None)


class AuxLosses:
    """The auxiliary losses added during one forward."""

    def __init__(self) -> None:
        self.terms: List[Tuple[str, torch.Tensor]] = []
        self.like_loss: List[bool] = []
        """Per term: weighted like the language-model loss (``add_aux_loss(..., like_loss=True)``)."""

    def add(self, name: str, value: torch.Tensor, like_loss: bool = False) -> None:
        if value.dim() != 0:
            raise ValueError(f"auxiliary loss {name!r} must be a scalar, got shape {tuple(value.shape)}")
        self.terms.append((name, value))
        self.like_loss.append(like_loss)

    def total(self, loss_weight: Optional[float] = None) -> Optional[torch.Tensor]:
        """Their sum (differentiable), or None when there are none; the terms added ``like_loss`` times
        ``loss_weight`` (the micro-batch's, ``hpctrain.train.step_runner.weighted_loss``; None: 1)."""
        out: Optional[torch.Tensor] = None
        for (_, v), like in zip(self.terms, self.like_loss):
            if like and loss_weight is not None:
                v = v * loss_weight
            out = v if out is None else out + v
        return out

    def by_name(self) -> Dict[str, float]:
        """Detached values summed per name (over layers)."""
        out: Dict[str, float] = {}
        for name, v in self.terms:
            out[name] = out.get(name, 0.0) + float(v.detach())
        return out


def add_aux_loss(name: str, value: torch.Tensor, like_loss: bool = False) -> None:
    """Add ``value`` (a scalar tensor) to the objective of the forward being collected; ``like_loss``: a
    mean over the micro-batch's counted targets (multi-token prediction), which a loss mask weighs as it
    weighs the language-model loss (``with_aux``'s ``loss_weight``)."""
    active = _ACTIVE.get()
    if active is not None:
        active.add(name, value, like_loss)


def collecting() -> bool:
    """Whether a training forward is collecting auxiliary losses now (a part
    builds its auxiliary losses only then, not in inference)."""
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def replaying(collected: bool) -> Iterator[None]:
    """While activation recomputation re-runs a forward in backward: parts see
    ``collecting()`` as the original forward did (so they rebuild the same
    graph, auxiliary losses included), but what they add goes to a collector
    nobody reads: the original forward's losses already joined the objective."""
    token = _ACTIVE.set(AuxLosses() if collected else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def collect_aux_losses() -> Iterator[AuxLosses]:
    """Collect the auxiliary losses of the forwards run inside."""
    aux = AuxLosses()
    token = _ACTIVE.set(aux)
    try:
        yield aux
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def objective_scale(scale: Optional[float]) -> Iterator[None]:
    """Training objectives made inside (``with_aux``, ``scaled``) are multiplied
    by ``scale`` (fp16's loss scale, ``hpctrain.train.loss_scale``; None: 1), so
    every schedule's backward, whichever stage holds the loss, starts scaled."""
    token = _SCALE.set(scale)
    try:
        yield
    finally:
        _SCALE.reset(token)


def scaled(objective: torch.Tensor) -> torch.Tensor:
    """``objective`` times the active ``objective_scale`` (itself when none):
    for a part of the objective built without ``with_aux`` (a pipeline
    stage's own auxiliary losses)."""
    scale = _SCALE.get()
    return objective if scale is None else objective * scale


def with_aux(loss: torch.Tensor, aux: AuxLosses, loss_weight: Optional[float] = None) -> torch.Tensor:
    """The training objective: ``loss`` (already weighted) plus the collected auxiliary losses (those added
    ``like_loss`` times ``loss_weight``, as ``loss`` was), times the active ``objective_scale``."""
    extra = aux.total(loss_weight)
    return scaled(loss if extra is None else loss + extra)
