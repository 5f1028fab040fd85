"""Context-parallel plugin: ``parallel.cp`` ranks split each sequence.

The core already gives each cp rank its tokens and targets (the zigzag
chunks of ``hpctrain.data.sequence``: rank i holds chunks i and 2cp-1-i of
2cp, so causal attention costs every rank the same), passes their true
positions to RoPE, averages the loss over all tokens (with a loss mask,
over the targets that count: masked targets travel with the rank's tokens)
and reduces dense gradients over cp (a data axis). What this plugin adds is
attention across the split: ``hpctrain_parallelize(axis="cp")`` replaces
every block's core attention by

- ``ring`` (``parallel.cp_impl=ring``, the default): ``ring.RingAttention``,
  key/value chunks passed around the cp ring, overlapped with compute,
  merged with an online softmax; the backward pass sends dK/dV around;
- ``allgather``: ``allgather.AllGatherAttention``, keys and values
  all-gathered per layer, gradients reduce-scattered.

Both compute chunk pair by chunk pair (``blocks``), skipping the pairs
causality masks out, so the zigzag layout gives every rank the same work.
With document masking (the core called with ``segments``) a pair is
masked by causality AND segment equality, and pairs that share no
document are skipped too (docs/cp.md, "Document masking").
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from torch import nn

from hpctrain import hookimpl
from hpctrain.data.sequence import SequenceLayout
from hpctrain.log import log_rank0
from hpctrain.mesh import Mesh
from hpctrain.model.transformer import Transformer
from hpctrain.parallel.handles import AxisHandle

from hpctrain_cp.allgather import AllGatherAttention
from hpctrain_cp.ring import RingAttention

IMPLS = ("ring", "allgather")


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["cp"]}


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> Optional[List[str]]:
    impl = str(cfg.parallel.cp_impl)
    if impl not in IMPLS:
        return [f"parallel.cp_impl={impl!r}: choose one of {', '.join(IMPLS)}"]
    return None


def _attention_modules(model: Transformer):
    for block in model.layers:
        yield block.attn
    for module in model.mtp.modules_by_depth() if model.mtp is not None else []:  # multi-token prediction's
        yield module.block.attn


@hookimpl
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any) -> Optional[AxisHandle]:
    group = mesh.group("cp")
    cp, rank, seq = group.size, mesh.rank("cp"), int(cfg.trainer.seq_len)
    layout = SequenceLayout.zigzag(cp)
    chunk = seq // (2 * cp)
    impl = str(cfg.parallel.cp_impl)
    assert isinstance(model, Transformer)  # the core model (tp changes it in place)
    for attn in _attention_modules(model):
        attn.core = RingAttention(group, layout) if impl == "ring" else AllGatherAttention(group, layout)
    if model.mtp is not None:  # its ids and targets k places ahead come from the whole sequence
        model.mtp.sequence = group
    log_rank0("context parallelism: cp=%d (%s), %d tokens per rank in chunks %s of %d", cp, impl, seq // cp,
              list(layout.chunks[rank]), chunk)
    return AxisHandle(model)


@hookimpl
def hpctrain_benchmarks() -> Dict[str, str]:
    return {"cp": "hpctrain_cp.bench"}
