"""Tensor-parallel plugin: Megatron's column/row-parallel split of every
block over ``parallel.tp`` ranks, with sequence parallelism
(``parallel.sequence_parallel``, on by default) and a vocab-parallel
embedding, output projection and loss.

``hpctrain_parallelize(axis="tp")`` runs first of the axes, on the meta
model: it narrows each weight to this rank's piece (``layers``, ``vocab``),
records the split in its ShardSpec and swaps in the parallel modules; the
parameter names stay the one-process names. The layout checks (tp divides
the query heads, the key/value heads and the SwiGLU width; the sequence
divides into tp shards under sequence parallelism) are the core's
``check_layout``, which the planner shares.

A feed-forward block other than the built-in SwiGLU (an MoE layer from
another plugin) is left whole on every tp rank, but for the SwiGLUs inside
it (an MoE layer's shared experts), which are split as a dense block's: it
receives this rank's tokens (its sequence shard under sequence parallelism)
and sums its own weights' gradients over tp where the ranks' tokens differ.

Data parallelism composes unchanged: tp is not a data axis, so every
gradient is averaged over the data axes as before (and ZeRO shards the tp
pieces further). A tp group should stay inside a node; one that spans nodes
works but is logged as a warning once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from hpctrain import hookimpl
from hpctrain.log import get_logger, log_rank0
from hpctrain.mesh import Mesh
from hpctrain.model.build import narrow_param
from hpctrain.model.mla import MLAttention
from hpctrain.model.shapes import padded_vocab
from hpctrain.model.transformer import Attention, SwiGLU, Transformer
from hpctrain.parallel.handles import AxisHandle
from hpctrain.shard import get_spec

from hpctrain_tp.latent import parallelize_latent_attention
from hpctrain_tp.layers import SumOverTensorParallel, TensorParallelLinears, column_parallel, row_parallel
from hpctrain_tp.regions import TensorParallelRegions
from hpctrain_tp.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, VocabParallelHead

log = get_logger(__name__)


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["tp"]}


@hookimpl
def hpctrain_benchmarks() -> Dict[str, str]:
    return {"tp": "hpctrain_tp.bench"}


@hookimpl
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any) -> Optional[AxisHandle]:
    group = mesh.group("tp")
    tp = group.size
    if tp == 1:
        return AxisHandle(model)
    if mesh.node_local("tp").size != tp and mesh.world_rank == 0:
        log.warning("the tp group spans nodes (%d of its %d ranks share a node): tensor parallelism's blocking "
                    "collectives will cross the network; launch more ranks per node or put tp first in "
                    "parallel.order", mesh.node_local("tp").size, tp)
    assert isinstance(model, Transformer)  # tp is the first axis: the core model
    sequence_parallel = bool(cfg.parallel.sequence_parallel)
    regions = TensorParallelRegions(group, sequence_parallel)
    shape = model.shape
    head_dim = shape.head_dim
    kv_pieces = None if shape.n_kv_heads >= tp else shape.n_kv_heads
    kv_replicas = mesh.replicas("tp", kv_pieces) if kv_pieces is not None else None

    attention_linears = TensorParallelLinears(regions, replicated=(1, 2), replicas=kv_replicas)
    ffn_linears = TensorParallelLinears(regions)
    norms = []
    # multi-token prediction's modules (hpctrain.model.mtp): their blocks split as the model's, their norms as its
    mtp = model.mtp.modules_by_depth() if model.mtp is not None else []
    for block in list(model.layers) + [m.block for m in mtp]:
        attn = block.attn
        if isinstance(attn, MLAttention):  # latent attention: heads split, latents whole (latent.py)
            parallelize_latent_attention(attn, mesh, regions)
        else:
            _parallelize_attention(attn, mesh, head_dim, kv_pieces, attention_linears)
        # the dense SwiGLU, or one inside another feed-forward (an MoE layer's shared experts), is split; the
        # rest of that feed-forward is replicated over tp and handles the tp region itself (its plugin gets the
        # mesh in hpctrain_make_module)
        for ffn in [m for m in block.ffn.modules() if type(m) is SwiGLU]:
            column_parallel(ffn.w1, mesh)
            column_parallel(ffn.w3, mesh)
            row_parallel(ffn.w2, mesh)
            ffn.linears = ffn_linears
        norms += [block.attn_norm, block.ffn_norm]

    _vocab_parallel(model, mesh, regions, padded_vocab(shape.vocab_size, tp, cfg.model.vocab_pad_to))
    if model.norm is not None:
        norms.append(model.norm)
    norms += [n for m in mtp for n in (m.enorm, m.hnorm, m.norm)]
    if sequence_parallel:
        for norm in norms:
            norm.weight_view = SumOverTensorParallel(group)
        for m in mtp:  # the projection is whole; each rank projects its shard of the sequence
            m.eh_weight_view = SumOverTensorParallel(group)
    log_rank0("tensor parallelism: tp=%d, sequence parallelism %s, vocabulary %d padded to %d, %s", tp,
              "on" if sequence_parallel else "off", shape.vocab_size,
              padded_vocab(shape.vocab_size, tp, cfg.model.vocab_pad_to),
              f"key/value heads replicated on {tp // kv_pieces} ranks each" if kv_pieces else "key/value heads split")
    return AxisHandle(model)


def _parallelize_attention(attn: Attention, mesh: Mesh, head_dim: int, kv_pieces: Optional[int],
                            linears: TensorParallelLinears) -> None:
    """Grouped-query attention: whole query heads per rank, key/value heads split or replicated."""
    column_parallel(attn.wq, mesh, unit=head_dim)
    column_parallel(attn.wk, mesh, unit=head_dim, pieces=kv_pieces)
    column_parallel(attn.wv, mesh, unit=head_dim, pieces=kv_pieces)
    row_parallel(attn.wo, mesh, unit=head_dim)
    attn.linears = linears
    for qk_norm in (attn.q_norm, attn.k_norm):
        if qk_norm is not None:  # each rank normalises its own heads: the weight's gradient sums over tp
            qk_norm.weight_view = SumOverTensorParallel(linears.regions.group)


def _vocab_parallel(model: Transformer, mesh: Mesh, regions: TensorParallelRegions, padded: int) -> None:
    """Cut the embedding and output rows (one tensor when tied) into padded ranges."""
    rows = padded // regions.group.size
    start = mesh.coords["tp"] * rows
    split: Dict[int, nn.Parameter] = {}

    def cut(module: nn.Module) -> nn.Parameter:
        old = module.weight
        assert isinstance(old, torch.Tensor)
        if id(old) not in split:
            spec = get_spec(old).split(0, "tp", padded=padded)
            split[id(old)] = narrow_param(module, "weight", spec, mesh)
        return split[id(old)]

    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(cut(model.tok_embeddings), start, regions)
    if model.output is not None:
        model.output = VocabParallelHead(cut(model.output), regions)
        model.loss_fn = VocabParallelCrossEntropy(regions.group, start, model.shape.vocab_size)
