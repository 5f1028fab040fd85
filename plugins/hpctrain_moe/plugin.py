"""Mixture-of-experts plugin: ``model.ffn=moe`` blocks and the ``ep`` axis.

- ``hpctrain_make_module(kind="ffn", name="moe")`` builds every
  ``model.moe.every``-th block's feed-forward after the first
  ``model.moe.first_dense_blocks`` as an ``MoE`` (the others stay the
  core's SwiGLU), holding all experts, on the meta device; multi-token
  prediction's blocks (indices from ``model.n_layers`` on) follow the same
  rule and count as MoE layers of the model (``moe_layers``).
- ``hpctrain_parallelize(axis="ep")`` keeps this rank's E/ep experts: the
  stacked expert weights are split on dim 0 over ``ep`` (their ShardSpecs
  say so, so checkpoints store [experts, ...] logical tensors and any ep
  can load them). Expert-parallel ranks are data-parallel for every other
  weight: samples are split over dp x ep, dense gradients averaged over
  cp x ep x dp and expert gradients over cp x dp by the core (which also
  divides the experts' ep-summed gradients by ep, ``grad_sync.presummed``).
- Its handle (``Experts``, on every rank of a model with experts: the core
  asks the plugin that claims ``ep`` at size 1 too) holds the routers'
  per-run state. After each update (``after_update``): the step's expert
  load, drops and balance losses, reduced over the world in one
  all-reduce; the sigmoid router's selection biases move towards balance
  from those loads (identical on every rank); ``step_metrics`` writes them
  to ``metrics.jsonl``.

With ``model.ffn`` other than ``moe`` the plugin declines ``ep``, which is
then a plain data axis.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from hpctrain import hookimpl
from hpctrain.config import plugin_section
from hpctrain.log import log_rank0
from hpctrain.mesh import AXES, Mesh
from hpctrain.model.build import narrow_param
from hpctrain.model.shapes import ModelShape
from hpctrain.model.transformer import SwiGLU
from hpctrain.parallel.handles import AxisHandle
from hpctrain.parallel.tokens import token_placement
from hpctrain.shard import get_spec

from hpctrain_moe.config import MoEConfig
from hpctrain_moe.layer import MoE, MoERegions
from hpctrain_moe.router import ROUTERS, update_bias
from hpctrain_moe.stats import loads, step_metrics

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState

SECTION = "model.moe"


def moe_config(cfg: Any) -> MoEConfig:
    return plugin_section(cfg, SECTION, MoEConfig)


def is_moe_block(layer_index: int, m: MoEConfig) -> bool:
    """Whether block ``layer_index`` is an MoE block (``MoEConfig.first_dense_blocks`` and ``every``)."""
    return layer_index >= m.first_dense_blocks and (layer_index + 1) % m.every == 0


def block_count(cfg: Any) -> int:
    """The model's blocks: ``model.n_layers`` and one per multi-token prediction module after them."""
    return int(cfg.model.n_layers) + int(cfg.model.get("mtp_depth", 0))


def moe_layer_ids(cfg: Any) -> List[int]:
    m = moe_config(cfg)
    return [i for i in range(block_count(cfg)) if is_moe_block(i, m)]


def moe_layers(model: nn.Module) -> Dict[int, MoE]:
    """This rank's MoE blocks by their index in the whole model (multi-token prediction's after the main
    model's, on the stage that holds them)."""
    layers = model.layers
    assert isinstance(layers, nn.Module)
    blocks = dict(layers.named_children())
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        blocks.update({name: module.block for name, module in mtp.layers.named_children()})
    return {int(name): block.ffn for name, block in blocks.items() if isinstance(block.ffn, MoE)}


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["ep"], "model.ffn": ["moe"]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {SECTION: MoEConfig}


@hookimpl
def hpctrain_claim_axis(cfg: Any) -> Optional[bool]:
    return cfg.model.ffn == "moe"


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> Optional[List[str]]:
    if cfg.model.ffn != "moe":
        return None
    m, ep = moe_config(cfg), int(cfg.parallel.ep)
    out = []
    if m.num_experts < 1:
        out.append(f"model.moe.num_experts={m.num_experts}: need at least 1 expert")
    elif ep >= 1 and m.num_experts % ep:
        fits = [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]
        out.append(f"parallel.ep={ep} does not divide model.moe.num_experts={m.num_experts}: "
                   f"use ep in {fits} or a multiple of {ep} experts")
    if not 1 <= m.top_k <= max(m.num_experts, 1):
        out.append(f"model.moe.top_k={m.top_k}: must be between 1 and num_experts ({m.num_experts})")
    if m.capacity_factor is not None and not m.capacity_factor > 0:
        out.append(f"model.moe.capacity_factor={m.capacity_factor}: must be > 0, or null for dropless routing")
    if m.router not in ROUTERS:
        out.append(f"model.moe.router={m.router!r}: choose one of {', '.join(ROUTERS)}")
    out += _group_problems(m)
    if not (m.routed_scaling_factor > 0 and m.routed_scaling_factor < float("inf")):
        out.append(f"model.moe.routed_scaling_factor={m.routed_scaling_factor}: must be a finite number > 0 "
                   "(1: the weights as routed; DeepSeek-V3: 2.5)")
    for key in ("aux_loss_coef", "z_loss_coef", "aux_free_bias_rate"):
        value = getattr(m, key)
        if not value >= 0:  # also rejects nan
            out.append(f"model.moe.{key}={value}: must be >= 0 (0 turns it off)")
    if m.ffn_hidden is not None and m.ffn_hidden < 1:
        out.append(f"model.moe.ffn_hidden={m.ffn_hidden}: must be null (model.ffn_hidden) or an integer >= 1")
    if m.shared_experts < 0:
        out.append(f"model.moe.shared_experts={m.shared_experts}: must be >= 0")
    if m.every < 1:
        out.append(f"model.moe.every={m.every}: must be >= 1 (1: every block is MoE)")
    elif m.every > cfg.model.n_layers:
        out.append(f"model.moe.every={m.every} exceeds model.n_layers={cfg.model.n_layers}: no block would be MoE; "
                   f"use every <= {cfg.model.n_layers} or model.ffn=swiglu")
    if m.first_dense_blocks < 0:
        out.append(f"model.moe.first_dense_blocks={m.first_dense_blocks}: must be >= 0")
    elif 1 <= m.every <= cfg.model.n_layers and not any(is_moe_block(i, m) for i in range(cfg.model.n_layers)):
        out.append(f"model.moe.first_dense_blocks={m.first_dense_blocks} leaves none of model.n_layers="
                   f"{cfg.model.n_layers} blocks MoE (model.moe.every={m.every}); use fewer dense blocks or "
                   "model.ffn=swiglu")
    return out


def _group_problems(m: MoEConfig) -> List[str]:
    """Group-limited routing's keys (``MoEConfig.expert_groups``, ``topk_groups``)."""
    g, top = m.expert_groups, m.topk_groups
    if g < 1:
        return [f"model.moe.expert_groups={g}: must be >= 1 (1: no group limit)"]
    if not 1 <= top <= g:
        return [f"model.moe.topk_groups={top}: must be between 1 and model.moe.expert_groups ({g})"]
    if g == 1:
        return []
    out = []
    if m.router != "sigmoid":
        out.append(f"model.moe.expert_groups={g} with model.moe.router={m.router}: group-limited routing is "
                   "DeepSeek-V3's, on the sigmoid router's biased scores; use model.moe.router=sigmoid or "
                   "expert_groups=1")
    if m.num_experts % g or m.num_experts // g < 2:
        out.append(f"model.moe.expert_groups={g} does not split model.moe.num_experts={m.num_experts} into groups "
                   "of 2 or more experts (a group scores by its two best); use a divisor of num_experts up to "
                   f"{m.num_experts // 2}")
    elif top * (m.num_experts // g) < m.top_k:
        out.append(f"model.moe.topk_groups={top} groups of {m.num_experts // g} experts hold fewer than "
                   f"model.moe.top_k={m.top_k}; raise topk_groups or lower top_k")
    return out


def _regions(mesh: Optional[Mesh], cfg: Any) -> MoERegions:
    """Where this layer's tokens live (the core's rule, ``hpctrain.parallel.tokens``)."""
    tokens = token_placement(mesh, bool(cfg.parallel.sequence_parallel))
    return MoERegions(token_split=tokens.split, counts_tokens=tokens.counts_tokens,
                      counts_values=tokens.counts_values, sequence=tokens.sequence)


@hookimpl
def hpctrain_make_module(kind: str, name: str, cfg: Any, layer_index: int, mesh: Optional[Mesh]) -> Optional[nn.Module]:
    if kind != "ffn" or name != "moe":
        return None
    m = moe_config(cfg)
    shape = ModelShape.from_config(cfg.model)
    if not is_moe_block(layer_index, m):
        return SwiGLU(shape)
    return MoE(shape.d_model, shape.ffn_hidden, m, _regions(mesh, cfg))


class Experts(AxisHandle):
    """The expert axis's handle, on every rank of a model with experts (ep 1 included: the core asks the
    claiming plugin at size 1 too). It owns the routers' per-run state: each step's expert loads, reduced
    over the world once and used both to move the sigmoid router's selection biases and for the metrics."""

    def __init__(self, model: nn.Module, cfg: Any, mesh: Mesh):
        super().__init__(model)
        self.cfg, self.mesh, self.moe = cfg, mesh, moe_config(cfg)
        self._reduced: Optional[Tuple[int, torch.Tensor]] = None
        """(step, its loads reduced over the world), from ``after_update`` to ``step_metrics``."""

    def _reduced_rows(self, state: "TrainState") -> torch.Tensor:
        """The step's per-layer expert loads and balance terms, summed over the world (a collective every
        rank enters, with MoE blocks on its stage or not)."""
        m = self.moe
        ids = moe_layer_ids(self.cfg)
        held = moe_layers(state.model)
        rows = torch.zeros((len(ids), m.num_experts + 5), dtype=torch.float64, device=state.device)
        for row, layer_id in enumerate(ids):
            if layer_id in held:
                rows[row] = held[layer_id].stats.take(state.device)
        world = self.mesh.group(AXES)
        if world.size > 1:
            world.communicator().all_reduce(rows)
        return rows

    def after_update(self, state: "TrainState", step: int) -> None:
        """The sigmoid router's selection biases move towards balance from the step's loads (identical on
        every rank): after the update, not a gradient."""
        m = self.moe
        rows = self._reduced_rows(state)
        self._reduced = (step, rows)
        if m.router == "sigmoid" and m.aux_free_bias_rate:
            held = moe_layers(state.model)
            for row, layer_id in enumerate(moe_layer_ids(self.cfg)):
                if layer_id in held:
                    bias = held[layer_id].router.expert_bias
                    assert bias is not None  # the sigmoid router keeps selection biases
                    update_bias(bias, loads(rows, m.num_experts)[row].to(bias.device), m.aux_free_bias_rate)

    def step_metrics(self, state: "TrainState", step: int) -> Dict[str, float]:
        kept, self._reduced = self._reduced, None
        # a step whose update was skipped had no after_update: its loads are reduced here
        rows = kept[1] if kept is not None and kept[0] == step else self._reduced_rows(state)
        return step_metrics(rows, self.moe.num_experts)


@hookimpl
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any) -> Optional[AxisHandle]:
    group = mesh.group("ep")
    if group.size > 1:
        for layer in moe_layers(model).values():
            experts = layer.experts
            local = experts.num_experts // group.size
            for name in ("w1", "w3", "w2"):
                narrow_param(experts, name, get_spec(getattr(experts, name)).split(0, "ep"), mesh)
            experts.first, experts.local = mesh.rank("ep") * local, local
            layer.regions.ep = group
        m = moe_config(cfg)
        log_rank0("expert parallelism: ep=%d, %d of %d experts per rank, top-%d %s routing, %s", group.size,
                  m.num_experts // group.size, m.num_experts, m.top_k, m.router,
                  "dropless" if m.capacity_factor is None else f"capacity factor {m.capacity_factor}")
    return Experts(model, cfg, mesh)


@hookimpl
def hpctrain_benchmarks() -> Dict[str, str]:
    return {"moe": "hpctrain_moe.bench"}
