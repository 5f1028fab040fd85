"""LoRA (``finetune.method=lora``): low-rank adapters on the chosen projections, every other weight frozen.

An adapted projection ``W`` (an ``nn.Linear`` of ``Attention`` or ``SwiGLU``) computes
``W x + (alpha / r) * B A dropout(x)``, A (r x in), B (out x r), as PEFT's ``lora.Linear``. The adapter is a
child of the projection (``<projection>.lora``, so ``layers.0.attn.wq.lora.A``), and the model's projection
seam (``Linears``) adds its term: the one-process seam here (``adapted``), tensor parallelism's in its plugin,
which cuts the adapter with its base (column-parallel W: B by rows, A whole with its gradient summed over tp;
row-parallel W: A by columns, B whole, its gradient summed over tp, the partial ``B A_r x_r`` summed with W's
partial output by the row projection's own reduction). Pipeline stages, context parallelism, recomputation
and compilation see the same modules and need nothing.

Frozen weights have ``requires_grad`` False from the meta model on, so backward makes no gradient for them,
the data axes' gradient reduction and ZeRO attach only what trains, and the optimizer is given only the
adapters (``parallelize`` passes ``requires_grad`` parameters only).

Init as PEFT's default: A kaiming-uniform (a = sqrt(5): uniform in +-1/sqrt(in)), B zeros, so a fresh
adapter changes nothing. A is drawn from its logical tensor's name and tiles like every weight
(``hpctrain.model.build.init_box``), so it does not depend on the layout.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.errors import ConfigError

PROJECTIONS: Dict[str, Tuple[str, str]] = {
    "q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
    "gate": ("ffn", "w1"), "up": ("ffn", "w3"), "down": ("ffn", "w2"),
}
"""finetune.lora.targets -> (sub-layer, projection) of a block."""

ADAPTER = "lora"
"""The adapter's attribute on its projection (and the part of its parameters' names)."""


class LoraAdapter(nn.Module):
    """The low-rank update of one projection: ``scaling * B A dropout(x)``."""

    param_init = {"A": "kaiming_uniform", "B": "zeros"}

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def down(self, x: torch.Tensor, a: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``A dropout(x)``; ``a``: A as forward uses it (tensor parallelism's view), default A."""
        return F.linear(self.dropout(x), self.A if a is None else a)

    def up(self, h: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``scaling * B h``; ``b``: B as forward uses it, default B."""
        return F.linear(h, self.B if b is None else b) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def adapter_of(linear: nn.Module) -> Optional[LoraAdapter]:
    """The projection's adapter, or None."""
    found = getattr(linear, ADAPTER, None)
    return found if isinstance(found, LoraAdapter) else None


def adapted(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The projection of ``x`` with its adapter's update, if it has one (the one-process seam)."""
    adapter = adapter_of(linear)
    return linear(x) if adapter is None else linear(x) + adapter(x)


def is_adapter_name(logical_name: str) -> bool:
    """Whether a logical tensor name is an adapter's (``...wq.lora.A``)."""
    return f".{ADAPTER}." in logical_name


def _targets(model: nn.Module, targets: List[str]) -> Iterator[Tuple[str, nn.Linear]]:
    """(target, projection) of every block for the targets; SwiGLU's only (MoE experts are not adapted)."""
    from hpctrain.model.transformer import Attention, Block, SwiGLU  # (it imports this module)

    for block in model.modules():
        if not isinstance(block, Block):
            continue
        for target in targets:
            part, name = PROJECTIONS[target]
            owner = getattr(block, part, None)
            if isinstance(owner, (Attention, SwiGLU)) and isinstance(getattr(owner, name, None), nn.Linear):
                yield target, getattr(owner, name)


def add_adapters(model: nn.Module, lora: Any) -> int:
    """Put an adapter on every targeted projection of ``model`` (the one-process model on the meta device)
    and freeze every other parameter; returns the number of adapters. Raises ConfigError when the targets
    name no projection of this model."""
    count = 0
    for _, linear in _targets(model, list(lora.targets)):
        adapter = LoraAdapter(linear.in_features, linear.out_features, int(lora.rank), float(lora.alpha),
                              float(lora.dropout))
        setattr(linear, ADAPTER, adapter)
        count += 1
    if count == 0:
        raise ConfigError(f"finetune.lora.targets={list(lora.targets)} names no projection of this model "
                         "(attention q,k,v,o; gate,up,down of dense SwiGLU blocks)")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return count


def lora_config(cfg: Any) -> Optional[Any]:
    """``cfg.finetune.lora`` when the run fine-tunes with LoRA, else None (older configs have no finetune)."""
    finetune = getattr(cfg, "finetune", None) if not hasattr(cfg, "get") else cfg.get("finetune")
    if finetune is None or finetune.get("method", "full") != "lora":
        return None
    return finetune.lora


def lora_problems(cfg: Any, pm: Any) -> List[str]:
    """Validation before any collective: with ``finetune=lora``, the targets name a projection of this model
    (built on the meta device, nothing allocated)."""
    if lora_config(cfg) is None:
        return []
    from hpctrain.model.build import build_model  # (it imports this module)

    try:
        build_model(cfg, pm)
    except ConfigError as e:
        return [str(e)] if "finetune.lora" in str(e) else []
    except Exception:  # noqa: BLE001 (a model config the other checks reject: they say why)
        return []
    return []
