"""Which blocks each virtual stage holds (``parallel.pipeline.layers``).

One rule for ``auto``, used by the pipeline plugin and assumed by the planner
(``hpctrain.planner``), so a planned split is the split that runs.

The first stage also holds the token embedding and the last the output
projection and loss. Each counts as ``end_cost`` blocks: the table's
parameters over one block's (``end_cost``). Its weights, gradients and
optimizer state weigh exactly that much; the output projection's FLOPs are
close to it too (2 h V against 2 x block parameters + 4 s h per token:
Llama 3 405B 0.61 against a parameter share of 0.66 at s = 8192). Megatron-LM's
``--account-for-embedding-in-pipeline-split`` / ``-loss-`` count each as one
whole block; Llama 3 405B (126 blocks on 16 stages) took one block off each
end stage, which is what this rule gives: [7, 8 x 14, 7].

``auto`` is the split whose costliest stage (blocks plus its end cost) costs
least, every stage holding at least one block; among those, blocks are taken
off the costliest stages first, the outer ones first, so extra blocks sit in
the middle. With ``end_cost`` 0 (or below 1) this is the even split with the
remainder on the middle stages.
"""
from __future__ import annotations

import math
from typing import Any, List, Sequence


def end_cost(vocab_size: int, d_model: int, block_params: float) -> float:
    """The embedding's (and the output projection's) cost in blocks: its parameters over one block's."""
    return vocab_size * d_model / block_params if block_params > 0 else 0.0


def model_end_cost(shape: Any) -> float:
    """``end_cost`` of a ``hpctrain.model.shapes.ModelShape`` (a dense block's parameters)."""
    return end_cost(shape.vocab_size, shape.d_model, shape.block_params)


def _costs(counts: Sequence[int], ends: float) -> List[float]:
    out = [float(c) for c in counts]
    out[0] += ends
    out[-1] += ends
    return out


def auto_counts(n_layers: int, stages: int, ends: float = 0.0) -> List[int]:
    """Blocks per stage of the ``auto`` split (module docstring); ``ends``: ``end_cost``."""
    if n_layers < stages:
        raise ValueError(f"model.n_layers={n_layers} cannot give each of the {stages} pipeline stages "
                         f"(parallel.pp x parallel.pipeline.vpp) a block; use fewer stages")
    if stages == 1:
        return [n_layers]
    extra = [0.0] * stages
    extra[0] += ends
    extra[-1] += ends

    def caps(bound: float) -> List[int]:
        # the most blocks each stage can take without costing more than ``bound`` (1e-9: float ties)
        return [max(0, math.floor(bound - e + 1e-9)) for e in extra]

    # the least costly bound is a whole number of blocks plus 0 or a stage's extra
    bounds = sorted({k + e for k in range(1, n_layers + 1) for e in set(extra)})
    lo, hi = 0, len(bounds) - 1  # bounds[hi] >= n_layers + 0: always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        c = caps(bounds[mid])
        if min(c) >= 1 and sum(c) >= n_layers:
            hi = mid
        else:
            lo = mid + 1
    counts = caps(bounds[lo])
    centre = (stages - 1) / 2
    for _ in range(sum(counts) - n_layers):
        cost = _costs(counts, ends)
        s = max((s for s in range(stages) if counts[s] > 1), key=lambda s: (round(cost[s], 9), abs(s - centre), s))
        counts[s] -= 1
    return counts


def layer_counts(layers: Any, n_layers: int, stages: int, ends: float = 0.0) -> List[int]:
    """Blocks per virtual stage for ``parallel.pipeline.layers``: ``auto`` (``auto_counts``
    with ``ends``) or a list ``[3, 5, 5, 3]`` (or the string ``"3,5,5,3"``): those counts.
    ValueError, naming the fix, when it cannot."""
    if not isinstance(layers, str):  # a list from the config: [3, 5, 5, 3]
        layers = ",".join(str(x) for x in layers)
    if layers.strip() == "auto":
        return auto_counts(n_layers, stages, ends)
    try:
        counts = [int(x) for x in str(layers).split(",")]
    except ValueError:
        raise ValueError(f"parallel.pipeline.layers={layers!r} is neither auto nor block counts per stage "
                         "(e.g. parallel.pipeline.layers=[3,5,5,3])") from None
    if len(counts) != stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"parallel.pipeline.layers={layers}: needs {stages} counts (parallel.pp x "
                         f"parallel.pipeline.vpp), each >= 1, adding up to model.n_layers={n_layers}")
    return counts


def stage_layers(layers: Any, n_layers: int, stages: int, ends: float = 0.0) -> List[List[int]]:
    """Block indices of each of ``stages`` virtual stages, in order (``layer_counts``)."""
    out, start = [], 0
    for c in layer_counts(layers, n_layers, stages, ends):
        out.append(list(range(start, start + c)))
        start += c
    return out


def rank_layers(counts: Sequence[int], pp: int) -> List[int]:
    """Blocks per pipeline rank: rank r holds virtual stages r, r + pp, ... (``schedules``)."""
    return [sum(counts[r::pp]) for r in range(pp)]
