"""Typed options of the data-parallel plugin: the ``comm.dp`` config section.

The bucket size stays in the core's ``comm.bucket_mb`` (other plugins, such
as a ZeRO stage, bucket their reductions with the same knob); what only this
plugin understands lives here, registered through ``hpctrain_config_sections``
so overrides like ``comm.dp.compress=bf16`` are type-checked at composition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

WIRE_DTYPES: Dict[str, Optional[torch.dtype]] = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DataParallelConfig:
    """Data-parallel gradient reduction (bucket size: ``comm.bucket_mb``)."""

    compress: str = "none"
    """Gradient dtype on the wire: none (the gradient's own dtype), bf16 or fp16. Sums are fp32 either way."""
    overlap: bool = True
    """Start each bucket's reduction during backward, as soon as its last gradient is ready; false reduces
    every bucket after backward."""


def wire_dtype(name: str) -> Optional[torch.dtype]:
    """``comm.dp.compress`` -> the wire dtype (None: no compression)."""
    return WIRE_DTYPES[name]
