"""Muon (Keller Jordan 2024; Liu et al. 2025) over sharded matrices.

Hidden matrices (``kinds.muon_matrix``: logical rank >= 2, not the
embedding or the head by default) take Muon's step; every other tensor
takes AdamW's (torch's functional ``adam`` with decoupled decay, the same
``lr``, betas, eps and decay), with its usual state (``step``, ``exp_avg``,
``exp_avg_sq``).

Muon, per matrix W with gradient G, momentum mu and Nesterov:

    B <- mu * B + (1 - mu) * G;   U = (1 - mu) * G + mu * B  (Nesterov; else U = B)
    O = NewtonSchulz(U)  (~ the orthogonal factor of U, of the whole matrix)
    W <- (1 - lr * wd) * W - lr * 0.2 * sqrt(max(A, B)) * O

The shape-based factor is Moonshot's (``newton_schulz.lr_scale``), chosen
so that one ``optim.lr`` serves both parts. The momentum ``B`` is
elementwise, so it lives on the rank's piece (a ZeRO shard: state sharded
like the parameter and saved as a logical tensor through its spec), but the
orthogonalisation needs the whole matrix. Each step, over the group ``H`` of
ranks of this pipeline stage (every axis but ``pp``, which never splits a
tensor):

1. every matrix of the stage has an owner in ``H``, chosen once, largest
   first onto the least loaded rank (the Newton–Schulz work per matrix grows
   with numel x min(A, B)), so the work is spread over the data-parallel
   (and tensor-parallel) ranks;
2. each rank writes its pieces of ``U`` (``ShardSpec.pieces``; padding left
   out, a replica divided by its count within ``H`` so it adds up once) into
   the owners' segments of a buffer, and one reduce-scatter over ``H``
   gives each owner its whole matrices;
3. each owner orthogonalises its matrices; one all-gather over ``H`` returns
   every result, and each rank takes its pieces of ``O``.

The buffer holds every matrix of the stage once (as fp32), on every rank of
``H``, while the step runs: the price of assembling whole matrices from
ZeRO's shards. Muon's state is ``momentum_buffer`` per matrix tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.optim.adam import adam

from hpctrain.mesh import AXES, Mesh
from hpctrain.optimizers.base import ShardedOptimizer
from hpctrain.optimizers.kinds import muon_matrix
from hpctrain.optimizers.newton_schulz import lr_scale, orthogonalize
from hpctrain.shard import Piece, ShardSpec

NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Values of ``optim.ns_dtype``."""


class MatrixPlan:
    """Who orthogonalises which matrix of the stage, and where each sits in
    the step's buffer (``n`` segments of ``length`` elements, one per rank of ``H``)."""

    def __init__(self, specs: Sequence[ShardSpec], matrices: Sequence[int], n: int):
        load = [0] * n
        self.owner: Dict[int, int] = {}
        for slot in sorted(matrices, key=lambda i: (-self._cost(specs[i]), i)):
            rank = min(range(n), key=lambda r: (load[r], r))
            self.owner[slot] = rank
            load[rank] += self._cost(specs[slot])
        used = [0] * n
        self.start: Dict[int, int] = {}
        for slot in matrices:
            rank = self.owner[slot]
            self.start[slot] = used[rank]
            used[rank] += _numel(specs[slot])
        self.length = max([1] + used)
        self.start = {slot: self.owner[slot] * self.length + off for slot, off in self.start.items()}

    @staticmethod
    def _cost(spec: ShardSpec) -> int:
        return _numel(spec) * min(spec.global_shape[-2:])


def _numel(spec: ShardSpec) -> int:
    n = 1
    for d in spec.global_shape:
        n *= d
    return n


class Muon(ShardedOptimizer):
    def __init__(self, tensors: Sequence[torch.nn.Parameter], optim: Any, mesh: Mesh,
                 specs: Optional[Sequence[ShardSpec]] = None):
        super().__init__(tensors, optim, mesh, specs)
        self.is_matrix = [muon_matrix(s, optim.adamw_params) for s in self.specs]
        self.group = mesh.group([a for a in AXES if a != "pp"])
        coords, sizes = mesh.coords, mesh.sizes
        self.pieces: Dict[int, List[Piece]] = {}
        self.replicas: Dict[int, List[int]] = {}
        for slot, spec in enumerate(self.specs):
            if self.is_matrix[slot]:
                pieces = spec.pieces(coords, sizes)
                off_group = spec.replicas_off_split({"pp": sizes["pp"]})  # copies on other stages (none)
                self.pieces[slot] = pieces
                self.replicas[slot] = [pc.replicas // off_group for pc in pieces]
        self.plan = MatrixPlan(self.specs, [i for i, m in enumerate(self.is_matrix) if m], self.group.size)
        self.ns_dtype = NS_DTYPES[optim.ns_dtype]

    def owned(self) -> List[int]:
        """Slots of the matrices this rank orthogonalises."""
        return [s for s, r in self.plan.owner.items() if r == self.group.rank]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("Muon takes no closure")
        cfg = self.cfg
        mu, nesterov = float(cfg.momentum), bool(cfg.nesterov)
        updates: Dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            matrices = [p for p in group["params"] if self.is_matrix[self.slot[id(p)]]]
            for p in matrices:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = st["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                updates[self.slot[id(p)]] = g.lerp(buf, mu) if nesterov else buf.clone()
            self._adamw(group, [p for p in group["params"] if not self.is_matrix[self.slot[id(p)]]])
        whole = self._orthogonalized(updates)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                slot = self.slot[id(p)]
                if slot not in updates:
                    continue
                spec = self.specs[slot]
                full = whole[self.plan.start[slot]:self.plan.start[slot] + _numel(spec)].view(spec.global_shape)
                local = torch.zeros_like(p)  # padding positions stay unchanged
                for piece in self.pieces[slot]:
                    piece.take(local).copy_(full[piece.slices])
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(local, alpha=-lr * lr_scale(torch.Size(spec.global_shape)))

    def _orthogonalized(self, updates: Dict[int, torch.Tensor]) -> torch.Tensor:
        """Every matrix of the stage, orthogonalised, in the plan's buffer (module docstring, 2-3)."""
        n, length = self.group.size, self.plan.length
        buf = torch.zeros(n * length, dtype=torch.float32, device=self.device)
        for slot, u in updates.items():
            spec = self.specs[slot]
            full = buf[self.plan.start[slot]:self.plan.start[slot] + _numel(spec)].view(spec.global_shape)
            for piece, rep in zip(self.pieces[slot], self.replicas[slot]):
                part = piece.take(u).float()
                full[piece.slices] += part / rep if rep > 1 else part
        comm = self.group.communicator() if n > 1 else None
        mine = torch.zeros(length, dtype=torch.float32, device=self.device)
        if comm is not None:
            comm.reduce_scatter(mine, buf)
        else:
            mine = buf
        base = self.group.rank * length
        for slot in self.owned():
            spec = self.specs[slot]
            at = self.plan.start[slot] - base
            view = mine[at:at + _numel(spec)].view(spec.global_shape)
            view.copy_(orthogonalize(view, int(self.cfg.ns_steps), self.ns_dtype).float())
        if comm is not None:
            comm.all_gather(buf, mine)
        return buf

    def _adamw(self, group: Dict[str, Any], tensors: List[torch.Tensor]) -> None:
        """AdamW's step (torch's functional ``adam``, decoupled decay) on the tensors Muon leaves alone."""
        tensors = [p for p in tensors if p.grad is not None]
        if not tensors:
            return
        for p in tensors:
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        cfg = self.cfg
        grads = [p.grad for p in tensors if p.grad is not None]
        adam(list(tensors), grads, [self.state[p]["exp_avg"] for p in tensors],
             [self.state[p]["exp_avg_sq"] for p in tensors], [], [self.state[p]["step"] for p in tensors],
             foreach=False, decoupled_weight_decay=True, amsgrad=False, beta1=float(cfg.beta1),
             beta2=float(cfg.beta2), lr=group["lr"], weight_decay=group["weight_decay"], eps=float(cfg.eps),
             maximize=False)
