"""Build on the meta device, then materialise with a layout-independent init.

``build_model`` allocates nothing: every parameter lives on the meta device
with a ShardSpec naming its logical tensor. Plugins then transform the model
axis by axis (``hpctrain_parallelize``), narrowing parameters and recording
their splits. ``materialize`` finally allocates each rank's shards and fills
them: for each parameter it draws the *logical* tensor from a generator
seeded by (seed, logical name) and copies out this rank's hyperslab. One
tensor at a time is ever whole on a rank, never the whole model, and the
weights do not depend on the layout.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn

from hpctrain.model.attention import SdpaAttention
from hpctrain.model.shapes import ModelShape
from hpctrain.model.transformer import Block, SwiGLU, Transformer
from hpctrain.shard import ShardSpec, get_spec, replicated_spec, set_spec

BUILTIN_ATTENTION = {"sdpa": SdpaAttention}
BUILTIN_FFN = {"swiglu": SwiGLU}


def _make_part(pm, kind: str, name: str, builtins: Dict[str, Any], cfg: Any, shape: ModelShape, layer: int) -> nn.Module:
    if pm is not None:
        part = pm.hook.hpctrain_make_module(kind=kind, name=name, cfg=cfg, layer_index=layer)
        if part is not None:
            return part
    if name in builtins:
        return builtins[name]() if kind == "attention" else builtins[name](shape)
    from hpctrain.errors import PluginError

    raise PluginError(
        f"model.{kind}={name!r} is neither built in ({', '.join(builtins)}) nor provided by an installed plugin"
    )


def build_model(cfg: Any, pm=None) -> Transformer:
    """The full (one-process) model on the meta device, a ShardSpec on every parameter.

    ``cfg`` is the whole run config (plugins building parts may read any section).
    """
    m = cfg.model
    shape = ModelShape.from_config(m)
    with torch.device("meta"):
        blocks = nn.ModuleList(
            Block(
                shape,
                m.norm_eps,
                _make_part(pm, "attention", m.attention, BUILTIN_ATTENTION, cfg, shape, i),
                _make_part(pm, "ffn", m.ffn, BUILTIN_FFN, cfg, shape, i),
            )
            for i in range(shape.n_layers)
        )
        model = Transformer(shape, m.norm_eps, m.rope_theta, blocks)
    assign_specs(model)
    return model


def assign_specs(model: nn.Module) -> None:
    """Give every parameter without a ShardSpec a replicated one named by its
    path, with the init its module declares in ``param_init``."""
    for mod_name, module in model.named_modules():
        inits = getattr(module, "param_init", {})
        for p_name, p in module.named_parameters(recurse=False):
            if getattr(p, "hpctrain_spec", None) is None:
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                set_spec(p, replicated_spec(full, tuple(p.shape), inits.get(p_name, "normal")))


def tensor_seed(seed: int, logical_name: str) -> int:
    """A 63-bit seed from (run seed, tensor name): stable across runs, machines and layouts."""
    digest = hashlib.sha256(f"{seed}/{logical_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_logical(spec: ShardSpec, seed: int, std: float, n_layers: int) -> torch.Tensor:
    """The whole logical tensor of one parameter, in fp32 on the CPU."""
    if spec.init == "ones":
        return torch.ones(spec.global_shape)
    if spec.init == "zeros":
        return torch.zeros(spec.global_shape)
    if spec.init not in ("normal", "normal_scaled"):
        raise ValueError(f"{spec.logical_name}: unknown init {spec.init!r}")
    if spec.init == "normal_scaled":
        std = std / math.sqrt(2 * n_layers)
    g = torch.Generator().manual_seed(tensor_seed(seed, spec.logical_name))
    return torch.empty(spec.global_shape).normal_(0.0, std, generator=g)


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    init_std: float,
    n_layers: int,
    coords: Optional[Mapping[str, int]] = None,
    sizes: Optional[Mapping[str, int]] = None,
) -> nn.Module:
    """Allocate this rank's shards on ``device`` and fill them from the logical init.

    Parameters keep their identity (``torch.utils.swap_tensors``): a plugin
    may hold references to them from ``hpctrain_parallelize`` (gradient hooks,
    buckets), and tied parameters stay tied.
    """
    coords = coords or {}
    sizes = sizes or {}
    seen = set()
    for p in model.parameters():  # unique: tied parameters come once
        if id(p) in seen:
            continue
        seen.add(id(p))
        spec = get_spec(p)
        full = init_logical(spec, seed, init_std, n_layers)
        shard = full[spec.local_slices(coords, sizes)] if spec.splits else full
        if tuple(shard.shape) != tuple(p.shape):
            raise RuntimeError(
                f"{spec.logical_name}: ShardSpec gives a local shape {tuple(shard.shape)} but the parameter "
                f"is {tuple(p.shape)}; the plugin that split it must update its ShardSpec"
            )
        real = nn.Parameter(shard.to(device=device, dtype=p.dtype).contiguous(), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, real)  # swaps __dict__ too: re-attach the spec
        set_spec(p, spec)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type == "meta":
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
    return model


def logical_param_count(model: nn.Module) -> int:
    """Parameters of the logical (unsharded) model, from the ShardSpecs."""
    seen = set()
    total = 0
    for p in model.parameters():
        spec = get_spec(p)
        if spec.logical_name not in seen:
            seen.add(spec.logical_name)
            total += math.prod(spec.global_shape)
    return total
