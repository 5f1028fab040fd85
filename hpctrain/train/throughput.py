"""The numbers users compare across frameworks: tokens/s per device, model
TFLOP/s per device and MFU.

Model FLOPs per token are the planner's (``hpctrain.planner.compute.
model_flops_per_token``: PaLM's 6N + 12 l h s, N the active parameters in
matrix multiplies), so the MFU a run logs and the MFU the planner predicts
are the same quantity. Recomputation is not credited (model FLOPs, not
hardware FLOPs). A device is one rank: the world size counts them.
"""
from __future__ import annotations

from typing import Any, Dict

from hpctrain.planner.arch import Arch
from hpctrain.planner.compute import mfu, model_flops_per_token


def flops_per_token(cfg: Any) -> float:
    """Model FLOPs of one trained token (forward and backward) for the run's model and sequence length."""
    return model_flops_per_token(Arch.from_model_config(cfg.model), int(cfg.trainer.seq_len))


def throughput(tokens: float, seconds: float, devices: int, flops_per_tok: float,
               peak_tflops: float) -> Dict[str, float]:
    """``tokens`` trained in ``seconds`` by ``devices``: the global and per-device
    rates, model TFLOP/s per device and, with a peak (``cluster.peak_tflops`` > 0), MFU."""
    per_device = tokens / seconds / devices
    flops = per_device * flops_per_tok
    out = {"tokens_per_s": tokens / seconds, "tokens_per_s_per_device": per_device,
           "model_tflops_per_device": flops / 1e12}
    if peak_tflops > 0:
        out["mfu"] = mfu(flops, peak_tflops * 1e12)
    return out
