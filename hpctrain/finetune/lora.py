"""LoRA (``finetune.method=lora``): low-rank adapters on the chosen projections, every other weight frozen.

An adapted projection ``W`` (an ``nn.Linear`` of ``Attention``, latent attention's ``MLAttention`` or
``SwiGLU``) computes
``W x + (alpha / r) * B A dropout(x)`` (``hpctrain.finetune.adapter``); the model's projection seam
(``Linears``) adds the adapter's term: the one-process seam (``adapted``), tensor parallelism's in its plugin,
which cuts the adapter with its base (column-parallel W: B by rows, A whole with its gradient summed over tp;
row-parallel W: A by columns, B whole, its gradient summed over tp, the partial ``B A_r x_r`` summed with W's
partial output by the row projection's own reduction). Latent attention (``model.attention_kind=mla``) has
targets of its own, its down-projections ``q_a`` (``wq_a``) and ``kv_a`` (``wkv_a``, the key/value latent with
the shared rotary key) and per-head up-projections ``q_b`` (``wq_b``) and ``kv_b`` (``wkv_b``), beside ``q``
(the plain query projection without q_lora_rank) and ``o``; its seam (``LatentLinears``, tensor parallelism's
in ``hpctrain_tp.latent``) adds the updates. Pipeline stages, context parallelism, recomputation
and compilation see the same modules and need nothing.

Frozen weights have ``requires_grad`` False from the meta model on, so backward makes no gradient for them,
the data axes' gradient reduction and ZeRO attach only what trains, and the optimizer is given only the
adapters (``parallelize`` passes ``requires_grad`` parameters only).

Dropout (``finetune.lora.dropout`` > 0) masks the adapter's input as PEFT does, one mask per adapter, from
torch's global generator (the same state on every rank). Under tensor parallelism a mask is drawn where the
input lives: a column-parallel adapter's input without sequence parallelism is whole on every tp rank, which
each draw the whole mask as one process does (the run equals one process's with the same generator state:
tests/mpi/test_lora_dropout.py); with sequence parallelism each token is masked once, on its shard before
the gather, and a row-parallel adapter's input columns on the rank holding them: valid dropout, not one
process's masks, every replicated adapter tensor still identical on every rank (docs/finetune.md). Latent
attention's down-projection adapters with dropout need sequence parallelism under tp (``checks``). Parity
tests between layouts use 0.

Init as PEFT's default: A kaiming-uniform (a = sqrt(5): uniform in +-1/sqrt(in)), B zeros, so a fresh
adapter changes nothing. A is drawn from its logical tensor's name and tiles like every weight
(``hpctrain.model.build.init_box``), so it does not depend on the layout.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.finetune.adapter import ADAPTER, LoraAdapter, is_adapter_name
from hpctrain.model.mla import MLAttention
from hpctrain.model.transformer import Attention, Block, SwiGLU

PROJECTIONS: Dict[str, Tuple[str, str]] = {
    "q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
    "gate": ("ffn", "w1"), "up": ("ffn", "w3"), "down": ("ffn", "w2"),
    "q_a": ("attn", "wq_a"), "q_b": ("attn", "wq_b"), "kv_a": ("attn", "wkv_a"), "kv_b": ("attn", "wkv_b"),
}
"""finetune.lora.targets -> (sub-layer, projection) of a block (q_a, q_b, kv_a, kv_b: latent attention's,
transformers' q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj)."""
DOWN_TARGETS = ("q_a", "kv_a")
"""Latent attention's down-projections: whole on every tensor-parallel rank (``hpctrain_tp.latent``)."""


def _targets(model: nn.Module, targets: List[str]) -> Iterator[Tuple[str, nn.Linear]]:
    """(target, projection) of every block for the targets; SwiGLU's only (MoE experts are not adapted)."""
    for block in model.modules():
        if not isinstance(block, Block):
            continue
        for target in targets:
            part, name = PROJECTIONS[target]
            owner = getattr(block, part, None)
            if isinstance(owner, (Attention, MLAttention, SwiGLU)) and isinstance(getattr(owner, name, None),
                                                                                 nn.Linear):
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
                         "(attention q,k,v,o; latent attention q_a,q_b,kv_a,kv_b,o, or q without q_lora_rank; "
                         "gate,up,down of dense SwiGLU blocks)")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return count


def lora_config(cfg: Any) -> Optional[Any]:
    """``cfg.finetune.lora`` when the run fine-tunes with LoRA, else None (older configs have no finetune)."""
    finetune = getattr(cfg, "finetune", None) if not hasattr(cfg, "get") else cfg.get("finetune")
    if finetune is None or finetune.get("method", "full") != "lora":
        return None
    return finetune.lora

