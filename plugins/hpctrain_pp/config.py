"""Typed options of the pipeline plugin: the ``parallel.pipeline`` config section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PipelineConfig:
    """Pipeline parallelism over the ``parallel.pp`` ranks."""

    schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved (with vpp >= 2) or zb-h1 (zero-bubble: backward split into input and weight passes)."""
    vpp: int = 1
    """Model chunks (virtual stages) per rank; >= 2 only with schedule=interleaved."""
    layers: Any = "auto"
    """Blocks per virtual stage: auto (as even as the stages' cost allows: the first and last also hold the
    embedding and the head, each counted as its parameters' share of a block, so they take a block fewer where
    that balances better; extra blocks go to the middle stages; hpctrain.pipeline.split, the split hpctrain-plan
    assumes) or pp x vpp counts: parallel.pipeline.layers=[3,5,5,3] (a Hydra list; the string "3,5,5,3" works
    too, quoted against Hydra's sweep syntax)."""
    timeline: bool = True
    """Record every action's start and end; after training rank 0 writes pipeline_timeline.json (Chrome trace)
    and pipeline_timeline.png in the run directory."""
