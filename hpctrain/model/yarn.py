"""YaRN RoPE scaling (``model.rope_scaling.type=yarn``), as transformers computes it for DeepSeek-V3.

Three numbers come out of the config (``YarnScaling``):

- the inverse frequencies: each of a head's rotary pairs turns ``original_max_seq_len / wavelength`` times over
  the pretraining context; pairs turning more than ``beta_fast`` times keep their frequency, pairs turning
  fewer than ``beta_slow`` times are divided by ``factor``, and a linear ramp over the pair index (its ends
  rounded outwards) blends the two between;
- ``attention_factor``, multiplying cos and sin (so q.k of the rotary part by its square):
  ``m(mscale) / m(mscale_all_dim)`` with ``m(s) = 0.1 s ln(factor) + 1`` when both are set, else ``m(1)``;
- ``softmax_factor``, multiplying latent attention's softmax scale 1/sqrt(qk head dim):
  ``m(mscale_all_dim)^2`` when set (transformers' ``yarn_apply_mscale`` in DeepseekV3Attention), else 1.

The arithmetic follows ``transformers.modeling_rope_utils._compute_yarn_parameters`` step by step (fp32, the
same operations in the same order), so the tables agree to the bit; tests/unit/hf/test_deepseek_mla.py
compares logits with transformers' own DeepseekV3 forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """``0.1 mscale ln(factor) + 1``, or 1 for ``factor <= 1`` (no stretch, no correction)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, original: int) -> float:
    """The pair index (fractional) whose wavelength fits ``rotations`` times into ``original`` positions."""
    return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))


@dataclass(frozen=True)
class YarnScaling:
    """``model.rope_scaling`` with type yarn (see the module docstring)."""

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None

    @classmethod
    def from_config(cls, rs: Any) -> "YarnScaling":
        def opt(key: str) -> Optional[float]:
            value = rs.get(key) if hasattr(rs, "get") else getattr(rs, key, None)
            return None if value is None else float(value)

        return cls(float(rs.factor), int(rs.original_max_seq_len), float(rs.beta_fast), float(rs.beta_slow),
                   opt("mscale"), opt("mscale_all_dim"))

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What latent attention's softmax scale is multiplied by."""
        if not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m

    def inv_freq(self, dim: int, theta: float, device: Optional[torch.device] = None) -> torch.Tensor:
        """(dim/2,) fp32 inverse frequencies of a rotary part of ``dim`` dims."""
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1  # transformers' defaults for 0 too
        low = math.floor(_correction_dim(beta_fast, dim, theta, self.original_max_seq_len))
        high = math.ceil(_correction_dim(beta_slow, dim, theta, self.original_max_seq_len))
        low, high = max(low, 0), min(high, dim - 1)
        span = float(high - low)
        if span == 0:
            span = 0.001  # (transformers: max += 0.001, against a division by zero)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / span, 0, 1)
        keep = 1 - ramp.to(device=device, dtype=torch.float)
        return interpolation * (1 - keep) + extrapolation * keep
