"""What a plan is for: the batch, sequence, precision and state-byte profile
one layout is estimated with (``estimate``), and the bytes it moves
(``traffic``), both of which read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpctrain.planner.frameworks import HPCTRAIN_FW, Framework
from hpctrain.planner.lora import LoraPlan
from hpctrain.planner.memory import StateBytes


@dataclass(frozen=True)
class Workload:
    """What is trained: batch, sequence, precision and the state-byte profile."""

    global_batch: int
    seq_len: int
    precision: str
    state_bytes: StateBytes
    bucket_bytes: float = 25 * 2 ** 20
    framework: Framework = HPCTRAIN_FW
    """The code that runs it (``frameworks``): hpctrain's own unless validating a published run."""
    fp8: bool = False
    """The block's projections run as float8 GEMMs (torchtitan's float8 linears; ``kernels.block_cost``)."""
    lora: Optional[LoraPlan] = None
    """LoRA fine-tuning (``finetune=lora``): only these adapters train, the base is frozen (``planner.lora``)."""
