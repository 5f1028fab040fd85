"""DiLoCo / local SGD: an outer optimizer over the data-parallel replicas
(``optim.outer=diloco``, ``optim.outer.{every,lr,momentum,nesterov,dtype}``).

Each dp coordinate is a replica that trains alone: the composition puts
``dp`` in ``Mesh.alone_axes`` before any axis is applied, so no gradient is
averaged over dp (tp, pp, cp and ep work inside a replica as usual: dense
gradients are still averaged over cp x ep), and each replica clips with its
own gradient norm (``grad_norm.reduce_totals``). The inner optimizer is
whatever the composition built (AdamW, or another optimizer plugin's),
wrapped by ``DiLoCo``:

- every inner step is the inner optimizer's;
- after every ``every``-th inner step (an update skipped for an fp16
  overflow or a non-finite step does not count; every rank skips alike),
  each replica's delta ``anchor - params`` is averaged over dp in one
  all-reduce (``dtype=bf16``: bf16 on the wire, fp32 sums, through the
  gradient engine's ``CompressedAverage``), and ``torch.optim.SGD`` (Nesterov
  momentum, ``optim.outer.lr``) steps the anchor, the shared weights, with
  that average as its gradient; every replica then continues from the new
  anchor. ``every=1, lr=1, momentum=0`` sets the weights to the replicas'
  average after every step: with an inner update linear in the gradient
  (SGD) that is plain data parallelism; AdamW's update is not linear, so
  there it is the average of the replicas' AdamW updates.

Between outer steps the replicas hold different weights: the logged loss
(and a validation's) is the mean over all of them, as it is over dp's
samples in plain data parallelism.

Bytes: one all-reduce of the parameters per ``every`` steps, against plain
data parallelism's one of the gradients per step (plus its per-parameter
"used" flags). Memory: the anchor and the outer momentum, two more fp32
copies of this rank's parameters.

ZeRO is refused with DiLoCo (its validation): a replica trains alone, so
there is no data group to shard its optimizer state over. So is Muon: it
assembles each whole matrix over the data ranks and spreads the
Newton-Schulz work over them, which are separate replicas here (LAMB and
LARS reduce their norms over the splitting axes only and work).

Checkpoints (``state`` and ``state_spec``, as the checkpoint format reads an
optimizer): per parameter, the inner optimizer's state and the replica's
current weights (``replica.params``) are stored for every replica, as one
logical tensor with a leading replica dimension split over dp (replicas
differ between outer steps); the anchor (``outer.anchor``), the outer
momentum (``outer.momentum_buffer``) and the inner steps taken
(``outer.inner_steps``) are shared. A resume restores each replica's own,
so it continues bit for bit; it needs the same number of dp replicas. A
checkpoint of a run without DiLoCo resumes too: every replica starts from
its weights and optimizer state, which are also the anchor.
The ``/model`` tensors of a checkpoint saved between outer steps are each
some replica's (the format writes a replicated piece from one holder): end
a run on an outer step (``trainer.steps`` a multiple of ``every``) to
export the shared weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, MutableMapping, Optional, Tuple

import torch

from hpctrain.comm.protocol import ReduceOp
from hpctrain.grad_sync.reduction import CompressedAverage
from hpctrain.mesh import Mesh
from hpctrain.shard import Block, DimSplit, ShardSpec, get_spec

OUTER_AXIS = "dp"
"""The axis whose coordinates are DiLoCo's replicas."""


def alone_axes(cfg: Any) -> Tuple[str, ...]:
    """The data axes whose ranks train alone between outer steps (``Mesh.alone_axes``): DiLoCo's replicas
    with ``optim.outer=diloco``, none otherwise. Fixed before the mesh is built."""
    return (OUTER_AXIS,) if cfg.optim.outer.name == "diloco" else ()

INNER = "inner."
"""Prefix of the inner optimizer's state keys in ``DiLoCo.state``."""
PARAMS_KEY = "replica.params"
ANCHOR_KEY = "outer.anchor"
MOMENTUM_KEY = "outer.momentum_buffer"
STEPS_KEY = "outer.inner_steps"


def replica_spec(spec: ShardSpec, replicas: int) -> ShardSpec:
    """``spec`` with a leading dimension of ``replicas``, split over dp (one row per replica)."""
    shifted = tuple(dataclasses.replace(s, dim=s.dim + 1) for s in spec.splits)
    return dataclasses.replace(spec, global_shape=(replicas,) + tuple(spec.global_shape),
                               splits=(DimSplit(0, (OUTER_AXIS,), (Block(replicas),)),) + shifted)


class _State(MutableMapping):
    """``DiLoCo.state``: per parameter, the inner optimizer's state (each
    tensor with a leading replica dimension of 1), the replica's weights and
    the outer state, under the keys of the module docstring."""

    def __init__(self, owner: "DiLoCo"):
        self.owner = owner

    def __getitem__(self, p: torch.nn.Parameter) -> Dict[str, Any]:
        o = self.owner
        i = o.index.get(id(p))
        if i is None:
            raise KeyError(p)
        out: Dict[str, Any] = {}
        for key, value in o.inner.state.get(p, {}).items():
            out[INNER + key] = value.unsqueeze(0) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
        out[PARAMS_KEY] = p.data.unsqueeze(0)
        out[ANCHOR_KEY] = o.anchors[i]
        momentum = o.outer.state.get(o.anchors[i], {}).get("momentum_buffer")
        if momentum is not None:
            out[MOMENTUM_KEY] = momentum
        out[STEPS_KEY] = o.inner_steps
        return out

    def __setitem__(self, p: torch.nn.Parameter, state: Dict[str, Any]) -> None:
        """A checkpoint's state (tensors already restored in place where they existed)."""
        o = self.owner
        i = o.index[id(p)]
        inner: Dict[str, Any] = {}
        with torch.no_grad():
            for key, value in state.items():
                if key.startswith(INNER):
                    is_row = isinstance(value, torch.Tensor) and value.dim() > 0
                    inner[key[len(INNER):]] = value.squeeze(0) if is_row else value
                elif key == PARAMS_KEY:  # (restored in place already: the view __getitem__ offers)
                    p.data.copy_(value.reshape(p.shape))
                elif key == ANCHOR_KEY:
                    o.anchors[i].copy_(value)
                elif key == MOMENTUM_KEY:
                    o.outer.state[o.anchors[i]]["momentum_buffer"] = value.to(o.anchors[i].dtype).clone()
                elif key == STEPS_KEY:
                    o.inner_steps = int(value)
                else:  # a run without DiLoCo saved it: its optimizer's state, the same for every replica
                    inner[key] = value
            if ANCHOR_KEY not in state:  # ... and its weights are where every replica starts
                o.anchors[i].copy_(p.data)
        if inner:
            o.inner.state[p] = inner

    def __delitem__(self, p: torch.nn.Parameter) -> None:
        self.owner.inner.state.pop(p, None)

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.owner.params)

    def __len__(self) -> int:
        return len(self.owner.params)


class DiLoCo:
    """The inner optimizer of one replica plus the outer step over dp
    (module docstring). Has what the trainer and the checkpoint call of a
    torch optimizer: ``step``, ``zero_grad``, ``param_groups`` (the inner
    optimizer's: the learning-rate schedule is the inner one; the outer lr
    is constant), ``state`` and ``state_spec``."""

    def __init__(self, inner: Any, params: List[torch.nn.Parameter], mesh: Mesh, outer: Any):
        self.inner = inner
        self.params = list(params)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.every = int(outer.every)
        self.wire = torch.bfloat16 if outer.dtype == "bf16" else None
        self.replicas = mesh.size(OUTER_AXIS)
        group = mesh.group(OUTER_AXIS)
        self.comm = group.communicator() if group.size > 1 else None
        self.anchors = [p.detach().clone().float() for p in self.params]
        """The shared weights at the start of the current round (what the outer optimizer updates)."""
        momentum = float(outer.momentum)
        self.outer = torch.optim.SGD(self.anchors, lr=float(outer.lr), momentum=momentum,
                                     nesterov=bool(outer.nesterov) and momentum > 0)
        self.inner_steps = 0
        """Inner updates applied so far (an outer step follows every ``every``-th)."""
        self.state = _State(self)
        self.outer_steps = 0
        """Outer steps taken in this process (logged)."""

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_spec(self, param: torch.nn.Parameter, key: str) -> Optional[ShardSpec]:
        """Per-replica tensors (the inner state, the replica's weights) get a leading replica dimension over dp."""
        if key == PARAMS_KEY or key.startswith(INNER):
            return replica_spec(get_spec(param), self.replicas)
        return None

    def checkpoint_problem(self, shapes: Dict[str, Tuple[int, ...]]) -> Optional[str]:
        """Why a checkpoint with these datasets cannot resume here (None: it can)."""
        saved = {shape[0] for path, shape in shapes.items() if path.startswith(f"/optim/{PARAMS_KEY}/")}
        if saved and saved != {self.replicas}:
            n = saved.pop()
            return (f"it was saved by DiLoCo with {n} dp replicas, each with its own weights and optimizer state, "
                    f"and this run has {self.replicas}; resume with parallel.dp={n} (tp, pp and cp may change)")
        return None

    def step(self) -> None:
        self.inner.step()
        self.inner_steps += 1
        if self.inner_steps % self.every == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the replicas' deltas over dp (one all-reduce, collective) and step the anchor with them."""
        deltas = torch.cat([(a - p.detach().float()).reshape(-1) for a, p in zip(self.anchors, self.params)])
        if self.comm is not None:
            if self.wire is not None:
                average = CompressedAverage(self.comm, deltas, self.wire)
                average.start(blocking=True)
                average.finish()
            else:
                self.comm.all_reduce(deltas, ReduceOp.AVG)
        offset = 0
        for a in self.anchors:
            n = a.numel()
            a.grad = deltas[offset:offset + n].view_as(a)
            offset += n
        self.outer.step()
        for a, p in zip(self.anchors, self.params):
            a.grad = None
            p.copy_(a)
        self.outer_steps += 1
