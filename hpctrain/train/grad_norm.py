"""The step's global numbers: gradient norm and loss, over the whole mesh.

Whoever owns the gradients hands over ``(gradient, ShardSpec)`` pairs: the
model's parameters by default, or an optimizer that keeps gradient shards
itself (ZeRO) through a ``gradients()`` method returning such pairs (flat
specs). Each rank adds up the squares of the logical elements it holds
(``ShardSpec.pieces``: padding is left out), each divided by the number of
ranks holding the same element (replicas over data axes, replicated key/value
heads, tied weights on two pipeline stages), so every logical element counts
once in the sum.

That sum, the loss sum and the token count go into one float64 all-reduce
over the world, which every rank enters whether it holds gradients or not
(a pipeline stage with no loss, a rank whose experts got no tokens): no
lazily created groups, no rank-dependent set of collectives. Ranks that
compute the same loss (tensor parallel) add both its sum and its tokens, so
the mean is unchanged. A fourth value counts the ranks whose data for the
step could not be read (a token file that shrank under the job,
``hpctrain.data.tokenfile``): it rides in the same all-reduce, so every rank
learns of a rank-local read failure before the update at no extra collective.
A fifth counts the ranks holding a non-finite gradient (fp16's overflow,
``hpctrain.train.loss_scale``): every rank skips the same step.

Replicas that train alone (DiLoCo over dp, ``hpctrain.train.outer``) each
clip with their own norm: the squares then go into one slot per replica
(a piece's share counted over the ranks of its replica only, i.e. times the
number of replicas), still in the same one all-reduce, and each rank reads
its replica's slot; the logged norm is the root mean square over replicas
(plain data parallelism: the one slot).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.mesh import AXES, Mesh
from hpctrain.shard import ShardSpec, get_spec

GradPair = Tuple[torch.Tensor, ShardSpec]


def gradient_pairs(params: Iterable[torch.nn.Parameter], optimizer: Any = None) -> List[GradPair]:
    """(gradient, spec) of every gradient this rank holds: the optimizer's
    ``gradients()`` when it has one, else each parameter's ``.grad``."""
    owner = getattr(optimizer, "gradients", None)
    if callable(owner):
        return list(owner())
    out, seen = [], set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((p.grad, get_spec(p)))
    return out


def local_square_sum(pairs: Sequence[GradPair], coords: Mapping[str, int], sizes: Mapping[str, int],
                     device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global norm (float64 scalar on ``device``)."""
    whole: Dict[int, List[torch.Tensor]] = {}  # replicas -> gradients held whole
    parts: List[torch.Tensor] = []
    for grad, spec in pairs:
        pieces = spec.pieces(coords, sizes)
        if len(pieces) == 1 and pieces[0].flat is None and _covers(pieces[0].local_box, grad.shape):
            whole.setdefault(pieces[0].replicas, []).append(grad)
            continue
        for piece in pieces:
            view = piece.take(grad)
            parts.append(view.detach().double().pow(2).sum() / piece.replicas)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for replicas, grads in whole.items():
        norms = torch._foreach_norm([g.detach() for g in grads])
        total = total + torch.stack(norms).double().pow(2).sum() / replicas
    for part in parts:
        total = total + part.to(device)
    return total


def _covers(box: Tuple[Tuple[int, int], ...], shape: Sequence[int]) -> bool:
    return all(a == 0 and b == n for (a, b), n in zip(box, shape)) and len(box) == len(shape)


class StepTotals(NamedTuple):
    grad_norm: torch.Tensor
    """The global gradient norm (fp32 scalar); with replicas, the root mean square of theirs."""
    loss: torch.Tensor
    """The global mean loss per token (fp32 scalar)."""
    short_reads: int
    """Ranks whose data for the step came back short (the same count on every rank)."""
    overflow: int = 0
    """Ranks holding a non-finite gradient (the same count on every rank)."""
    replica_norm: Optional[torch.Tensor] = None
    """This rank's replica's gradient norm (what it clips with); None: ``grad_norm``."""


def reduce_totals(pairs: Sequence[GradPair], loss_sum: torch.Tensor, tokens: int, mesh: Mesh,
                  device: torch.device, short_reads: int = 0, replicas: Tuple[int, int] = (0, 1)) -> StepTotals:
    """The step's global numbers from one float64 all-reduce over the world
    that every rank enters; ``short_reads`` is this rank's 0 or 1
    (``DataCursor.short_reads``); ``replicas``: (this rank's replica, the
    number of replicas training alone; module docstring)."""
    mine, count_replicas = replicas
    square = local_square_sum(pairs, mesh.coords, mesh.sizes, device)
    overflow = 0.0 if bool(torch.isfinite(square)) else 1.0
    squares = torch.zeros(count_replicas, dtype=torch.float64, device=device)
    squares[mine] = square * count_replicas
    values = torch.cat([squares, torch.tensor([float(loss_sum.detach().double()), float(tokens), float(short_reads),
                                               overflow], dtype=torch.float64, device=device)])
    mesh.group(AXES).communicator().all_reduce(values, ReduceOp.SUM)
    got = values.tolist()
    per_replica, (loss, count, short, overflows) = got[:count_replicas], got[count_replicas:]
    norm = torch.tensor(math.sqrt(max(sum(per_replica) / count_replicas, 0.0)), dtype=torch.float32)
    own = torch.tensor(math.sqrt(max(per_replica[mine], 0.0)), dtype=torch.float32) if count_replicas > 1 else None
    mean = torch.tensor(loss / count if count else float("nan"), dtype=torch.float32)
    return StepTotals(norm, mean, int(round(short)), int(round(overflows)) if math.isfinite(overflows) else 1, own)


def reduce_step(pairs: Sequence[GradPair], loss_sum: torch.Tensor, tokens: int, mesh: Mesh,
                device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(global gradient norm, global mean loss), fp32 scalars: ``reduce_totals``
    for callers without a data cursor."""
    totals = reduce_totals(pairs, loss_sum, tokens, mesh, device)
    return totals.grad_norm, totals.loss


@torch.no_grad()
def clip_(pairs: Sequence[GradPair], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients so the global norm is at most ``max_norm`` (0: no clipping)."""
    if max_norm <= 0 or not pairs:
        return
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    if scale < 1.0:
        torch._foreach_mul_([g for g, _ in pairs], scale)
