"""What ZeRO holds per rank: the expected bytes (the core's formulas,
``hpctrain.planner.memory``, on this layout, padding included) and what the
tensors actually hold.

With P the padded size of the flat groups (each a multiple of its group
size n), C = P / n the owned chunks, U the elements of parameters with
nothing to shard, p and r the bytes of an element in ``param_dtype`` and
``reduce_dtype``, and AdamW's two moments in fp32:

| stage | parameters | gradients | optimizer state |
|---|---|---|---|
| 1 | P p | P r + C r | 8 C (+ 4 C fp32 master when p < 4) |
| 2 | P p | C r | 8 C (+ 4 C) |
| 3 | 4 C (fp32 master = the parameters) | C r | 8 C |

plus 4 U, 4 U and 8 U for the unsharded parameters (the optimizer state of
LAMB is AdamW's; of LARS 4 bytes per held element; of Muon 4 on its
matrices' held elements and 8 on the rest). With ``offload=nvme``
the 8 C of moments are in files and only one flat group's (8 x its chunk)
is resident at a time, during the optimizer step (counted in flight). Stage 1 keeps the whole
gradient between steps (accumulated over micro-batches, reduce-scattered
after the last) and the reduce-scatter's output C r; stages 2 and 3 keep
only the output. On top of that, *in flight*: stages 2 and 3 hold the
gradient buffers of buckets being reduced (bounded by the two largest flat
groups, r bytes each; under a pipeline, whose micro-batches' backwards
interleave, the whole P r until the step's last backward), and stage 3 the gathered units (the two largest:
the one in use and the one prefetched; under a pipeline also the stage's
last unit, kept gathered for its backward while the next micro-batch's
forward gathers; all of them without ``reshard_after_forward``). Activations are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpctrain.optimizers.kinds import muon_matrix, state_bytes_per_element
from hpctrain.planner.memory import sharded_states, zero_in_flight
from hpctrain.shard import get_spec

from hpctrain_zero.config import dtype_of


@dataclass(frozen=True)
class ZeroMemory:
    params: int
    """Bytes of parameters held between steps."""
    grads: int
    """Bytes of gradients held through a step."""
    optimizer: int
    """Bytes of optimizer state (moments, fp32 masters kept apart)."""
    in_flight: int
    """At most this many bytes more, transiently (gradient buckets, gathered units)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.total + self.in_flight

    def describe(self) -> str:
        def mb(b: int) -> str:
            return f"{b / 2**20:.2f} MiB"

        return (f"parameters {mb(self.params)}, gradients {mb(self.grads)}, optimizer state {mb(self.optimizer)}, "
                f"up to {mb(self.in_flight)} in flight; expected peak {mb(self.peak)} ({self.peak:,} bytes)")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def expected(setup: Any) -> ZeroMemory:
    """The core's table (``hpctrain.planner.memory.sharded_states`` and
    ``zero_in_flight``, the module docstring) for ``setup`` (the plugin's
    handle, ``Zero``), padding included."""
    z = setup.cfg
    flats = getattr(setup, "trained", setup.flats)  # frozen weights (LoRA's base) have no gradient or state
    first = next((p for fg in flats for p in fg.params), None)
    own = first.dtype if first is not None and setup.stage != 3 else torch.float32
    p_size = _size(dtype_of(z.param_dtype) or own)
    reduce_dtype = dtype_of(z.reduce_dtype)
    assert reduce_dtype is not None  # validated: reduce_dtype is never none
    r_size = _size(reduce_dtype)
    P = sum(fg.total for fg in flats)
    C = sum(fg.chunk for fg in flats)
    U = sum(p.numel() for p in setup.unsharded)
    nvme = z.offload == "nvme"  # moments paged in one flat group at a time
    states = sharded_states(setup.stage, P, C, U, p_size, r_size, 0.0 if nvme else 8.0,
                            master_bytes=4.0 if setup.stage in (1, 2) and p_size < 4 else 0.0)
    units = [sum(fg.total for fg in setup.unit_flats[u.name]) for u in setup.units] if setup.stage == 3 else []
    in_flight = zero_in_flight(setup.stage, r_size, p_size, [fg.total for fg in flats], units,
                               pipeline=setup.mesh.size("pp") > 1, reshard_after_forward=z.reshard_after_forward,
                               whole_gradient=P)
    if nvme:
        in_flight += 8 * max((fg.chunk for fg in flats), default=0)
    optimizer = states.optimizer
    optim = getattr(setup, "optim", None)
    if optim is not None and optim.name != "adamw":  # LAMB, LARS, Muon: their state per element held
        optimizer += _state_bytes(setup, optim) - 8.0 * (C + U)
    return ZeroMemory(int(states.weights + _frozen_bytes(setup)), int(states.grads), int(optimizer), int(in_flight))


def _frozen_bytes(setup: Any) -> int:
    """Frozen weights held (LoRA's base): whole at stages 1-2, an fp32 chunk of their flat groups at stage 3."""
    if setup.stage == 3:
        return 4 * sum(fg.chunk for fg in setup.flats if fg not in setup.trained)
    seen = {id(p) for fg in setup.flats for p in fg.params} | {id(p) for p in setup.unsharded}
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in setup.model.parameters()}.values()
               if not p.requires_grad and id(p) not in seen)


def _state_bytes(setup: Any, optim: Any) -> float:
    """Bytes of LAMB's, LARS's or Muon's state on this rank: per element it
    holds (``hpctrain.optimizers.kinds.state_bytes_per_element``; Muon: 4 on
    its matrices, AdamW's 8 on the rest), shards and unsharded parameters."""
    def per_element(spec: Any) -> float:
        return state_bytes_per_element(optim.name, float(muon_matrix(spec, list(optim.adamw_params))))

    held = [(b - a, fg.specs[i]) for fg in setup.trained for i in range(len(fg.params)) for a, b in [fg.held(i)]]
    held += [(p.numel(), get_spec(p)) for p in setup.unsharded]
    return sum(n * per_element(spec) for n, spec in held)


def measured(setup: Any, model: torch.nn.Module, optimizer: Any) -> ZeroMemory:
    """What the tensors hold after a step (``in_flight``: the peaks seen so far)."""
    storages = {}
    for p in model.parameters():
        s = p.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    files = [seg.mapped for seg in optimizer.segments if seg.mapped is not None]
    state = [t for s in optimizer.shard_states() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() and not any(inside(t, m.exp_avg) or inside(t, m.exp_avg_sq)
                                                                    for m in files)]
    masters = sum(m.numel() * m.element_size() for m, full in zip(setup.masters, setup.full)
                  if full is not None and not inside(m, full))  # fp32 masters kept apart from 16-bit parameters
    engine = setup.engine
    shards = sum(r.shard.numel() * r.shard.element_size() for r in engine.shards())
    kept = engine.buffer_bytes  # stage 1 keeps its gradient buffers between steps
    unsharded_grads = sum(p.grad.numel() * p.grad.element_size() for p in setup.unsharded if p.grad is not None)
    gathered = setup.gatherer.peak_bytes if setup.gatherer is not None else 0
    return ZeroMemory(sum(storages.values()), kept + shards + unsharded_grads,
                      sum(t.numel() * t.element_size() for t in state) + masters,
                      engine.peak_buffer_bytes - kept + gathered)


def inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t`` lies in ``base``'s memory (a view of it)."""
    lo = base.data_ptr()
    return lo <= t.data_ptr() < lo + base.numel() * base.element_size()
