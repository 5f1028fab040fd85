"""Measuring what a real model holds: tensor bytes and bytes saved for backward."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Iterable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (a tied weight counts once)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


_CAST_OR_VIEW = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0"}


def _is_weight_copy(t: torch.Tensor) -> bool:
    """A parameter cast (and maybe viewed or transposed) and nothing else:
    autocast's bf16 weight copy. The embedding output, which also leads
    straight to a parameter, is not one (EmbeddingBackward is not a cast)."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _CAST_OR_VIEW:
        parents = [f for f, _ in fn.next_functions if f is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
    return (fn is not None and type(fn).__name__ == "AccumulateGrad" and t.grad_fn is not fn
            and fn.variable.numel() == t.numel())


def measure_saved(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, autocast: bool = False):
    """Bytes autograd saves for backward during one forward, by where they were
    first saved: ``{"layer0": .., "layer1": .., "outside": .., "weight_copies": ..}``.
    Parameters' own storages are not activations and are skipped; a storage
    saved twice (one tensor used by several ops) counts once."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = {"now": "outside"}
    seen: Dict[int, str] = {}
    found: Dict[str, int] = defaultdict(int)
    hooks = []
    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: where.update(now=f"layer{i}")))
        hooks.append(block.register_forward_hook(lambda m, a, o: where.update(now="outside")))

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in param_storages and key not in seen:
            seen[key] = "weight_copies" if _is_weight_copy(t) else where["now"]
            found[seen[key]] += st.nbytes()
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            loss = model(tokens, targets)
    finally:
        for h in hooks:
            h.remove()
    loss.backward()  # the graph was complete and usable
    return dict(found)
