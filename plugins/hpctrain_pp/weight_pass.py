"""Zero-bubble's split backward: B computes the input gradient, W the weight
gradients later, and together they cost one backward.

B runs autograd only towards the stage's input, so the nodes that multiply
by a weight (a matmul, a norm's scale) compute the input-side gradient and
skip the weight-side one. While it runs, a pre-hook keeps the gradient that
arrives at each such node (its "frontier": the nodes where a weight's path
joins the input's). W resumes autograd from those kept gradients towards
the weights only (``GradientEdge`` outputs), so nothing on the input path
runs twice.

Parameters that share a frontier node are differentiated together; when a
group has several frontier nodes, each node's gradient is pinned to the kept
one during W, because one frontier node may lie below another and autograd
would otherwise add the upper one's contribution a second time. A custom
``autograd.Function`` on the input path (tensor parallelism's regions)
computes all of its outputs in both passes; that costs time, never
correctness.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Optional[Node]:
    """The node a gradient for ``t`` goes into (a leaf's AccumulateGrad, made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    view = t.view_as(t).grad_fn
    assert view is not None  # a view of a tensor that requires grad has one
    return view.next_functions[0][0]


def _consumers(roots: Sequence[Node]) -> Dict[Node, List[Node]]:
    """For every node below ``roots``: the nodes that send it gradient."""
    up: Dict[Node, List[Node]] = defaultdict(list)
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            up[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return up


def _weight_edge(p: torch.Tensor) -> GradientEdge:
    node = grad_node(p)
    assert node is not None  # a weight the graph reached
    return GradientEdge(node, 0)


def _returning(grads: Optional[tuple]) -> Callable[..., object]:
    """A node pre-hook that makes ``grads`` the node's incoming gradients."""
    return lambda _: grads


def _upwards(start: Node, up: Dict[Node, List[Node]], stop: Set[Node]) -> Tuple[Set[Node], Set[Node]]:
    """(nodes reached from ``start`` towards the outputs, those of them in
    ``stop``); the walk does not pass a node of ``stop``."""
    hit: Set[Node] = set()
    seen, queue = {start}, deque([start])
    while queue:
        for parent in up.get(queue.popleft(), ()):
            if parent in seen:
                continue
            seen.add(parent)
            if parent in stop:
                hit.add(parent)
            else:
                queue.append(parent)
    return seen, hit


@dataclass(eq=False)  # identity: groups are merged and removed by object
class _Group:
    params: List[torch.nn.Parameter]
    frontier: List[Node]
    kept: Dict[Node, tuple] = field(default_factory=dict)


@dataclass
class WeightPass:
    """What W needs from B: each parameter group's frontier nodes and the gradients kept there."""

    groups: List[_Group]

    def run(self, on_ready: Callable[[torch.nn.Parameter], None] = lambda p: None) -> None:
        """Accumulate the weight gradients into ``.grad`` (in place when one is
        there: it may be a gradient-sync bucket's view) and announce each with
        ``on_ready`` (the engine's ``mark_ready``: autograd's hooks do not fire
        for gradients written by hand)."""
        for g in self.groups:
            edges, grads = [], []
            for node in g.frontier:
                for i, grad in enumerate(g.kept.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(grad)
            if not edges:  # no gradient reached these weights (unused this micro-batch)
                continue
            pins = ([n.register_prehook(_returning(g.kept.get(n))) for n in g.frontier]
                    if len(g.frontier) > 1 else [])
            try:
                dws = torch.autograd.grad(edges, [_weight_edge(p) for p in g.params], grads,
                                          retain_graph=True, allow_unused=True)
            finally:
                for h in pins:
                    h.remove()
            for p, dw in zip(g.params, dws):
                if dw is not None:
                    p.grad = dw if p.grad is None else p.grad.add_(dw)
                    on_ready(p)
        self.groups = []


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], stage_input: torch.Tensor,
                   params: Sequence[torch.nn.Parameter]) -> Optional[WeightPass]:
    """Write ``stage_input.grad`` (keeping the graph) and return the deferred
    weight pass; ``None`` when some weight's path never meets the input's
    (the caller then runs a whole backward towards the weights instead)."""
    roots = [n for n in (grad_node(t) for t in outputs) if n is not None]
    up = _consumers(roots)
    input_node = grad_node(stage_input)
    on_input_path = _upwards(input_node, up, set())[0] if input_node is not None else set()
    frontiers: Dict[torch.nn.Parameter, Set[Node]] = {}
    met = True  # every weight's path meets the input's
    for p in params:
        node = grad_node(p)
        if node is None or node not in up:
            continue  # not used by this micro-batch's graph
        hit = _upwards(node, up, on_input_path)[1]
        if not hit:
            met = False
            break
        frontiers[p] = hit
    groups = _merge(frontiers) if met else []
    hooks = [node.register_prehook(lambda grad_outputs, g=g, node=node: g.kept.__setitem__(node, grad_outputs))
             for g in groups for node in g.frontier]
    try:
        (dx,) = torch.autograd.grad(list(outputs), [stage_input], list(grads), retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    stage_input.grad = dx
    return WeightPass(groups) if met else None


def _merge(frontiers: Dict[torch.nn.Parameter, Set[Node]]) -> List[_Group]:
    """Parameters whose frontiers share a node form one group."""
    groups: List[_Group] = []
    owner: Dict[Node, _Group] = {}
    for p, nodes in frontiers.items():
        joined = {id(owner[n]): owner[n] for n in nodes if n in owner}
        g = _Group([p], list(nodes))
        for other in joined.values():
            g.params += other.params
            g.frontier += [n for n in other.frontier if n not in g.frontier]
            groups.remove(other)
        groups.append(g)
        for n in g.frontier:
            owner[n] = g
    return groups
