"""Validation: the loss on held-out data, forward only, under any layout.

For each validation source (``data.split``'s held-out documents of each
training source, or ``data.validation.paths``) the trainer runs
``trainer.eval_batches`` global batches from the start of that source's
sample order (the same batches every time, so validations compare), with
the step schedule in forward-only mode (a pipeline runs its forward-only
program; no gradient is made and no optimizer state is touched), and one
all-reduce over the world gives the source's mean token loss, as a
training step's loss is found. With several sources each gets its own
loss; ``val_loss`` is their mean weighted by the blend (the training
mixture), and ``val_ppl`` its exponential.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from hpctrain.train.grad_norm import reduce_totals
from hpctrain.train.step_runner import as_step_result


@torch.no_grad()
def source_loss(trainer: Any, order: Any, batches: int) -> float:
    """The mean token loss of ``batches`` global batches of ``order`` (collective)."""
    cursor = trainer.cursor_over([order])
    loss_sum, tokens = torch.zeros((), dtype=torch.float64), 0
    for _ in range(batches):
        microbatches = [mb.to(trainer.device) for mb in cursor.next_step()]
        result = as_step_result(trainer.step_runner.run(trainer.model, microbatches, trainer.data_handle,
                                                        trainer.autocast, forward_only=True), microbatches)
        loss_sum = loss_sum + result.loss_sum.detach().to(torch.float64).cpu()
        tokens += result.tokens
    totals = reduce_totals([], loss_sum, tokens, trainer.mesh, trainer.device)
    return float(totals.loss)


def validate(trainer: Any) -> Dict[str, float]:
    """Every validation source's loss and their blend-weighted mean (empty when there is none)."""
    orders = trainer.orders
    if not orders.valid:
        return {}
    trainer.model.eval()
    try:
        losses = [source_loss(trainer, order, int(trainer.cfg.trainer.eval_batches)) for order in orders.valid]
    finally:
        trainer.model.train()
    weights = _weights(orders)
    mean = sum(w * x for w, x in zip(weights, losses)) / sum(weights)
    out = {"val_loss": mean, "val_ppl": math.exp(min(mean, 50.0))}
    if len(losses) > 1:
        for name, loss in zip(orders.valid_names, losses):
            out[f"val_loss.{name}"] = loss
    return out


def _weights(orders: Any) -> List[float]:
    """Each validation source's weight: its training source's blend weight (held-out documents), else equal."""
    by_name = dict(zip(orders.names, orders.weights))
    return [float(by_name.get(name, 1.0)) for name in orders.valid_names]
