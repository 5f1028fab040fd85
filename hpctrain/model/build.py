"""Build on the meta device, then materialise with a layout-independent init.

``build_model`` allocates nothing: every parameter lives on the meta device
with a ShardSpec naming its logical tensor. Plugins then transform the model
axis by axis (``hpctrain_parallelize``), narrowing parameters and recording
their splits. ``materialize`` finally allocates each rank's local tensors
and fills every piece a rank holds (``ShardSpec.pieces``) from
``init_box``: random values come in fixed tiles of the logical tensor, each
drawn from a generator seeded by (seed, tensor name, tile index), so a rank
draws only the tiles its pieces touch (never a whole sharded tensor, let
alone the model) and the weights do not depend on the layout.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hpctrain.boxes import Box, box_shape, full_box, intersect
from hpctrain.errors import PluginError
from hpctrain.finetune.lora import add_adapters, lora_config
from hpctrain.mesh import AXES, Mesh
from hpctrain.model.attention import SdpaAttention
from hpctrain.model.mla import MLAttention
from hpctrain.model.mtp import build_mtp
from hpctrain.model.shapes import ModelShape
from hpctrain.model.transformer import Block, RMSNorm, RopeScaling, SwiGLU, Transformer
from hpctrain.model.yarn import YarnScaling
from hpctrain.shard import SPEC_ATTR, ShardSpec, get_spec, replicated_spec, set_spec

BUILTIN_ATTENTION = {"sdpa": SdpaAttention}

BoxSource = Callable[[ShardSpec, Box], Optional[torch.Tensor]]
"""Given weights (``checkpoint.init_from``): the values of a box of a logical tensor, or None for the init."""
BUILTIN_FFN = {"swiglu": SwiGLU}


def _make_part(pm, kind: str, name: str, builtins: Dict[str, Any], cfg: Any, shape: ModelShape, layer: int,
               mesh: Optional[Mesh]) -> nn.Module:
    if pm is not None:
        part = pm.hook.hpctrain_make_module(kind=kind, name=name, cfg=cfg, layer_index=layer, mesh=mesh)
        if part is not None:
            return part
    if name in builtins:
        return builtins[name]() if kind == "attention" else builtins[name](shape)

    raise PluginError(
        f"model.{kind}={name!r} is neither built in ({', '.join(builtins)}) nor provided by an installed plugin"
    )


class _NoInitOnMeta(TorchFunctionMode):
    """torch.nn.init's in-place initialisers (and the tensor methods they call) do
    nothing on meta tensors: a module's default init there only computes shapes,
    through torch's Python reference kernels (which load torch's compiler);
    ``materialize`` initialises every parameter later."""

    TENSOR_INITS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        is_init = func in self.TENSOR_INITS or getattr(func, "__module__", None) == "torch.nn.init"
        if is_init and isinstance(target, torch.Tensor) and target.is_meta and func.__name__.endswith("_"):
            return target
        return func(*args, **kwargs)


def build_model(cfg: Any, pm=None, mesh: Optional[Mesh] = None) -> Transformer:
    """The full (one-process) model on the meta device, a ShardSpec on every parameter.

    ``cfg`` is the whole run config (plugins building parts may read any
    section); ``mesh`` the layout, passed to plugins that build parts.
    """
    m = cfg.model
    shape = ModelShape.from_config(m)
    scaling = RopeScaling.from_config(getattr(m, "rope_scaling", None))
    softmax_factor = scaling.softmax_factor if isinstance(scaling, YarnScaling) else 1.0
    with torch.device("meta"), _NoInitOnMeta():

        def block(i: int) -> Block:  # block i of the model (i >= n_layers: a multi-token prediction module's)
            core = _make_part(pm, "attention", m.attention, BUILTIN_ATTENTION, cfg, shape, i, mesh)
            return Block(shape, m.norm_eps, core, _make_part(pm, "ffn", m.ffn, BUILTIN_FFN, cfg, shape, i, mesh),
                         MLAttention(shape, core, softmax_factor) if shape.mla is not None else None)

        blocks = nn.ModuleList(block(i) for i in range(shape.n_layers))
        mtp = build_mtp(shape, m.norm_eps, int(getattr(m, "mtp_depth", 0)), float(getattr(m, "mtp_loss_weight", 0.0)),
                        block, lambda: RMSNorm(shape.d_model, m.norm_eps))
        model = Transformer(shape, m.norm_eps, m.rope_theta, blocks, scaling, mtp)
        lora = lora_config(cfg)
        if lora is not None:  # adapters on the one-process model: every axis then cuts them with their base
            add_adapters(model, lora)
    assign_specs(model)
    return model


def narrow_param(module: nn.Module, name: str, spec: ShardSpec, mesh: Mesh) -> nn.Parameter:
    """Replace ``module.<name>`` (on the meta device) by this rank's piece as
    ``spec`` cuts it (an axis plugin splitting a weight in ``hpctrain_parallelize``)."""
    old = getattr(module, name)
    new = nn.Parameter(torch.empty(spec.local_shape(mesh.coords, mesh.sizes), dtype=old.dtype, device="meta"),
                       requires_grad=old.requires_grad)
    set_spec(new, spec)
    setattr(module, name, new)
    return new


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


TILE = 256
"""Random initialisation is drawn in tiles of the logical tensor: TILE x TILE
over the last two dims (one index of each leading dim), TILE * TILE
elements of a 1-D tensor. A tile's values depend only on (seed, tensor name,
tile index), so a rank draws the tiles its boxes touch and nothing else,
whatever the layout."""


def _tile_ranges(box: Box, ndim: int) -> List[List[Tuple[int, int, int]]]:
    """Per dim: (tile index, tile start, tile stop) of the tiles ``box`` touches."""
    sizes = [1] * max(0, ndim - 2) + ([TILE, TILE] if ndim >= 2 else [TILE * TILE] * ndim)
    out = []
    for (a, b), t in zip(box, sizes):
        out.append([(i, i * t, (i + 1) * t) for i in range(a // t, -(-b // t))])
    return out


def init_box(spec: ShardSpec, box: Box, seed: int, std: float, n_layers: int) -> torch.Tensor:
    """The values of ``box`` of the logical tensor, in fp32 on the CPU."""
    shape = box_shape(box)
    if spec.init == "ones":
        return torch.ones(shape)
    if spec.init == "zeros":
        return torch.zeros(shape)
    if spec.init not in ("normal", "normal_scaled", "kaiming_uniform"):
        raise ValueError(f"{spec.logical_name}: unknown init {spec.init!r}")
    if spec.init == "normal_scaled":
        std = std / math.sqrt(2 * n_layers)
    # torch's kaiming_uniform_(a=sqrt(5)), nn.Linear's and PEFT's LoRA A: uniform in +-1/sqrt(fan_in)
    bound = 1.0 / math.sqrt(spec.global_shape[-1]) if spec.init == "kaiming_uniform" else 0.0
    out = torch.empty(shape)
    full = spec.global_shape
    for tile in itertools.product(*_tile_ranges(box, len(full))):
        tile_box = tuple((lo, min(hi, n)) for (_, lo, hi), n in zip(tile, full))
        index = ",".join(str(i) for i, _, _ in tile)
        g = torch.Generator().manual_seed(tensor_seed(seed, f"{spec.logical_name}#{index}"))
        values = torch.empty(box_shape(tile_box))
        if bound:
            values.uniform_(-bound, bound, generator=g)
        else:
            values.normal_(0.0, std, generator=g)
        common = intersect(box, tile_box)
        if common is None:
            continue
        out[tuple(slice(x0 - b0, x1 - b0) for (x0, x1), (b0, _) in zip(common, box))] = \
            values[tuple(slice(x0 - t0, x1 - t0) for (x0, x1), (t0, _) in zip(common, tile_box))]
    return out


def init_logical(spec: ShardSpec, seed: int, std: float, n_layers: int) -> torch.Tensor:
    """The whole logical tensor of one parameter (tests and tools; training never draws it whole)."""
    return init_box(spec, full_box(spec.global_shape), seed, std, n_layers)


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    init_std: float,
    n_layers: int,
    coords: Optional[Mapping[str, int]] = None,
    sizes: Optional[Mapping[str, int]] = None,
    source: Optional[BoxSource] = None,
) -> nn.Module:
    """Allocate this rank's shards on ``device`` and fill each piece it holds
    from the logical init (``init_box``), or from ``source`` when it has the
    tensor (``checkpoint.init_from``: each rank reads its pieces only); padding stays zero.
    Persistent buffers are zeros, or ``source``'s values where it holds them.

    Parameters keep their identity (``torch.utils.swap_tensors``): a plugin
    may hold references to them from ``hpctrain_parallelize`` (gradient hooks,
    buckets), and tied parameters stay tied.

    On the meta ``device`` (``hpctrain-train --dry-run``) nothing is allocated
    or drawn: the parameters stay as they are, recorded as materialised
    (``materialized``), and the buffers go to the meta device.
    """
    coords = dict(coords or {})
    sizes = dict(sizes or {})
    for a in AXES:
        coords.setdefault(a, 0)
        sizes.setdefault(a, 1)
    seen = set()
    for p in model.parameters():  # unique: tied parameters come once
        if id(p) in seen:
            continue
        seen.add(id(p))
        spec = get_spec(p)
        shape = spec.local_shape(coords, sizes)
        if tuple(shape) != tuple(p.shape):
            raise RuntimeError(
                f"{spec.logical_name}: ShardSpec gives a local shape {tuple(shape)} but the parameter "
                f"is {tuple(p.shape)}; the plugin that split it must update its ShardSpec"
            )
        if device.type == "meta":
            _META_WEIGHTS[id(p)] = p
            continue
        local = torch.zeros(shape)
        for piece in spec.pieces(coords, sizes):
            given = source(spec, piece.box) if source is not None else None
            piece.take(local).copy_(given if given is not None else init_box(spec, piece.box, seed, init_std, n_layers))
        real = nn.Parameter(local.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, real)  # swaps __dict__ too: re-attach the spec
        set_spec(p, spec)
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type == "meta":
                buf_spec = getattr(buf, SPEC_ATTR, None)
                filled = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
                if source is not None and device.type != "meta" and name not in module._non_persistent_buffers_set:
                    # a persistent buffer the given weights hold (a router's selection bias: DeepSeek-V3's
                    # e_score_correction_bias), named as checkpoints name it (its spec, else its path)
                    spec = buf_spec or replicated_spec(f"{mod_name}.{name}" if mod_name else name, tuple(buf.shape),
                                                       "zeros")
                    for piece in spec.pieces(coords, sizes):
                        given = source(spec, piece.box)
                        if given is not None:
                            piece.take(filled).copy_(given)
                if buf_spec is not None:
                    setattr(filled, SPEC_ATTR, buf_spec)
                module._buffers[name] = filled
    return model


_META_WEIGHTS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""Parameters ``materialize`` left on the meta device (a dry run), by id."""


def materialized(p: torch.Tensor) -> bool:
    """Whether ``p`` holds this rank's weights: not on the meta device, or left there by
    ``materialize`` (a dry run); False for a placeholder of a model not materialised yet."""
    return not p.is_meta or _META_WEIGHTS.get(id(p)) is p


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
