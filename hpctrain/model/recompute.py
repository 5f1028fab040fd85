"""Activation recomputation: ``model.recompute=none|selective|full``.

``full`` keeps only each block's inputs for backward and runs the block's
forward again when backward reaches it; ``selective`` does the same for the
attention core alone (Korthikanti et al. 2022: the part whose saved tensors
grow with the sequence length, for little compute). With a flash-style
attention, which keeps no s x s matrix, selective saves only the core's
log-sum-exp; full trades one more forward of every block for keeping one
hidden state per token and block.

Both use torch's non-reentrant checkpoint with early stopping turned off:
the recomputed forward always runs to its end, so every collective inside it
(tensor-parallel reductions, ring attention's exchanges, MoE all-to-alls)
runs on every rank of its group, whatever each rank's graph needs. The
replayed forward sees the auxiliary-loss channel as the original did
(``hpctrain.model.aux.replaying``) and ``recomputing()`` is true, so a part
rebuilds the same graph but counts its statistics once.
"""
from __future__ import annotations

import contextvars
from typing import Any, Callable, cast

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from hpctrain.eager import eager
from hpctrain.model import amp
from hpctrain.model.aux import collecting, replaying

RECOMPUTE = ("none", "selective", "full")

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("hpctrain_recomputing", default=False)


def recomputing() -> bool:
    """Whether the forward running now is a recomputation in backward."""
    return _RECOMPUTING.get()


@eager
def recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward (``fn`` runs again there).
    Without gradients (inference) it is a plain call.

    Never traced by torch.compile (``trainer.compile``): its call count and
    context variables must run each time, not once at tracing; inside a
    compiled block (selective recomputation) it is a graph break, and ``fn``
    itself may be compiled (full recomputation of a compiled block)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    collected = collecting()
    calls = [0]
    meta_autocast = amp.meta_state()  # torch's checkpoint replays torch's autocast state, not the dry run's

    def run(*inputs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the original forward
            return fn(*inputs)
        token = _RECOMPUTING.set(True)
        try:
            with replaying(collected), amp.meta_restored(meta_autocast):
                return fn(*inputs)
        finally:
            _RECOMPUTING.reset(token)

    with set_checkpoint_early_stop(False):
        return checkpoint(run, *args, use_reentrant=False)


def set_recompute(model: torch.nn.Module, mode: str) -> None:
    """Turn ``mode`` on for every block ``model`` runs (a ``Transformer``, a
    pipeline stage or an interleaved rank's chunks): each module offering
    the switch (a block's ``recompute``, an attention's ``recompute_core``)."""
    if mode not in RECOMPUTE:
        raise ValueError(f"model.recompute={mode!r} is not one of {', '.join(RECOMPUTE)}")
    for module in model.modules():
        # (cast: torch types Module.__setattr__ for tensors and modules only; these switches are bools)
        switch = cast(Any, module)
        if hasattr(module, "recompute"):
            switch.recompute = mode == "full"
        if hasattr(module, "recompute_core"):
            switch.recompute_core = mode == "selective"
