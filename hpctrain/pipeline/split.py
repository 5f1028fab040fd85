"""Which blocks each virtual stage holds (``parallel.pipeline.layers``)."""
from __future__ import annotations

from typing import Any, List


def stage_layers(layers: Any, n_layers: int, stages: int) -> List[List[int]]:
    """Block indices of each of ``stages`` virtual stages, in order.

    ``auto``: ``n_layers // stages`` each and the remainder one by one to the
    middle stages, outward from the centre (the first and last stage also run
    the embedding and the head, so they take extra blocks last). A list
    ``[3, 5, 5, 3]`` (or the string ``"3,5,5,3"``): those counts. ValueError, naming the fix, when it cannot.
    """
    if not isinstance(layers, str):  # a list from the config: [3, 5, 5, 3]
        layers = ",".join(str(x) for x in layers)
    if layers.strip() == "auto":
        if n_layers < stages:
            raise ValueError(f"model.n_layers={n_layers} cannot give each of the {stages} pipeline stages "
                             f"(parallel.pp x parallel.pipeline.vpp) a block; use fewer stages")
        counts = [n_layers // stages] * stages
        centre = (stages - 1) / 2
        for s in sorted(range(stages), key=lambda s: (abs(s - centre), s))[:n_layers % stages]:
            counts[s] += 1
    else:
        try:
            counts = [int(x) for x in str(layers).split(",")]
        except ValueError:
            raise ValueError(f"parallel.pipeline.layers={layers!r} is neither auto nor block counts per stage "
                             "(e.g. parallel.pipeline.layers=[3,5,5,3])") from None
        if len(counts) != stages or sum(counts) != n_layers or min(counts) < 1:
            raise ValueError(f"parallel.pipeline.layers={layers}: needs {stages} counts (parallel.pp x "
                             f"parallel.pipeline.vpp), each >= 1, adding up to model.n_layers={n_layers}")
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out
