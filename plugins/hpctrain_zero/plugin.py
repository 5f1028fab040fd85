"""ZeRO plugin: the data axes' implementation when ``parallel.zero.stage`` > 0
(it claims axis ``dp`` then; ``parallel.impl.dp=zero`` also chooses it).

Units (``units``: the embedding, each block, the head) are cut into flat
groups (``flat``: a unit's parameters averaged over one data group, laid out
end to end and padded to a multiple of that group's size); rank r of the
group owns the r-th chunk of each. The core gradient-sync engine reduce-
scatters the flat groups (they are its buckets) and the ``ZeroOptimizer``
runs AdamW on the owned chunks only:

- stage 1: parameters and gradients stay whole; gradients accumulate over
  the step's micro-batches in a full buffer and are reduce-scattered once,
  after the last; after the optimizer step each group all-gathers the
  updated parameters (in place: the parameters are views of the flat
  buffer);
- stage 2: every micro-batch's gradients are reduce-scattered as backward
  produces them and added into the owned chunk; no full gradient is kept;
- stage 3: parameters are kept as their owned chunks too (``gather``): each
  unit is all-gathered just before its forward, the next unit's gather
  prefetched, freed after forward (``reshard_after_forward``), gathered
  again for backward and freed once its gradients are out.

Parameters whose data group has a single rank (nothing to shard) stay as
they are and are updated whole. Frozen parameters (``requires_grad`` False:
a LoRA run's base weights) have no gradient and no optimizer state: stages
1-2 leave them whole and out of the flat groups; stage 3 shards them in flat
groups of their own (``@frozen``), gathered for forward and backward like the
others but never reduced, updated or all-gathered after a step. ``param_dtype`` makes gathered / computed
parameters 16-bit with an fp32 master chunk; ``reduce_dtype`` is the
reduce-scatter's dtype. Memory per rank is logged at start (``memory``).

The plugin's per-run state is its handle (``Zero``, a ``DataHandle``): the
trainer's step schedule drives the engine through it, the core's
``finalize_grads`` asks it to turn the reduced chunks into the shards'
gradients (``reduce_gradients``) and for the shards holding a tied
embedding's gradient (``gradients_of``), which the core then sums between
the pipeline's first and last stage.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, ContextManager, Dict, Iterable, List, Optional, Tuple, cast

import torch
from omegaconf import OmegaConf
from torch import nn

from hpctrain import grad_sync, hookimpl
from hpctrain.comm.protocol import ReduceOp
from hpctrain.config import plugin_section
from hpctrain.errors import PluginError
from hpctrain.grad_sync.buckets import cap_bytes_from_mb
from hpctrain.log import log_rank0
from hpctrain.mesh import Group, Mesh
from hpctrain.optimizers.kinds import OPTIMIZERS
from hpctrain.parallel.handles import DataHandle
from hpctrain.shard import ShardSpec, get_spec, set_spec

from hpctrain_zero import memory, offload, optimizer
from hpctrain_zero.config import DTYPES, OFFLOADS, SHARD_GROUPS, ZeroConfig, dtype_of
from hpctrain_zero.flat import FlatGroup
from hpctrain_zero.gather import UnitFlats, UnitGatherer
from hpctrain_zero.units import Unit, model_units


class Zero(DataHandle):
    """The data axes' handle at ZeRO stages 0-3: the flat groups, the engine,
    the gatherer (stage 3) and the sharded optimizer (module docstring).
    Made on the meta model by ``hpctrain_parallelize``; its buffers and
    engine once the weights are real (``after_materialize``)."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: ZeroConfig, bucket_mb: float, run_dir: Optional[str],
                 units: List[Unit], flats: List[FlatGroup], unit_flats: Dict[str, List[FlatGroup]],
                 shapes: Dict[str, List[torch.Size]], unsharded: List[nn.Parameter]):
        super().__init__(model)
        self.cfg, self.mesh, self.bucket_mb, self.run_dir = cfg, mesh, bucket_mb, run_dir
        self.units = units
        self.flats = flats
        """Forward order."""
        self.unit_flats = unit_flats
        self.shapes = shapes
        """Full (pre-flat) shape of each parameter, per flat group."""
        self.unsharded = unsharded
        self.trained = [fg for fg in flats if fg.params[0].requires_grad]
        """The flat groups that train (the engine's buckets, the optimizer's shards), forward order."""
        self.full: List[Optional[torch.Tensor]] = []
        """Stages 1-2: each flat group's whole parameter buffer (the parameters are views of it)."""
        self.masters: List[torch.Tensor] = []
        """Each flat group's owned chunk, the master copy the optimizer updates."""
        self.shards: Dict[int, Tuple[nn.Parameter, ShardSpec]] = {}
        self.engine: Optional[grad_sync.GradSync] = None
        self.gatherer: Optional[UnitGatherer] = None
        self.memory: Optional[memory.ZeroMemory] = None
        """Expected bytes per rank (logged at start)."""
        self.device: Optional[torch.device] = None
        """Where the model computes."""
        self.host = False
        """Masters and optimizer state in host memory (offload=cpu on a GPU)."""
        self.optim: Any = None
        """The run's ``optim`` config (what the memory log counts of the optimizer's state)."""

    @property
    def stage(self) -> int:
        return self.cfg.stage

    # -- once the weights are real ------------------------------------------------
    def after_materialize(self) -> None:
        z, mesh = self.cfg, self.mesh
        if z.stage == 0:  # chosen explicitly at stage 0: plain data parallelism through the same engine
            self.engine = grad_sync.GradSync(grad_sync.reduction_comm(mesh),
                                             grad_sync.SyncConfig(cap_bytes=cap_bytes_from_mb(self.bucket_mb)))
            self.engine.attach([p for p in self.model.parameters() if p.requires_grad])
            return
        param_dtype = dtype_of(z.param_dtype)
        self.device = next(iter(self.model.parameters())).device
        host = self.host = z.offload == "cpu" and self.device.type == "cuda"  # masters, moments in pinned host memory
        for fg in self.flats:
            if z.stage == 3:
                self.masters.append(_master_chunk_stage3(fg, host))
                self.full.append(None)
            else:
                full, master = _flat_buffers(fg, param_dtype, host)
                self.full.append(full)
                self.masters.append(master)
            for i, p in enumerate(fg.params):
                a, b = fg.held(i)
                if b > a:
                    if fg not in self.trained:  # frozen: sharded (stage 3), never updated
                        continue
                    shard = p if z.stage == 3 else nn.Parameter(self.masters[-1][fg.shard_slice(i)])
                    if z.stage != 3:
                        set_spec(shard, fg.flat_spec(i))
                    self.shards[id(p)] = (shard, fg.flat_spec(i))
        for p in self.unsharded:
            self.shards[id(p)] = (p, get_spec(p))
        numels = {id(p): n for fg in self.trained for p, n in zip(fg.params, fg.numels)}
        groups = {id(p): fg.group.communicator() for fg in self.trained for p in fg.params}
        config = grad_sync.SyncConfig(cap_bytes=0, reduce_scatter=True, keep_grads=False,
                                      every_microbatch=z.stage >= 2 and mesh.size("pp") == 1,
                                      dtype=dtype_of(z.reduce_dtype), release_buffers=z.stage >= 2, max_in_flight=1,
                                      device=self.device)
        self.engine = grad_sync.GradSync(lambda p: groups.get(id(p)), config)
        params = [p for fg in self.trained for p in fg.params]
        self.engine.attach(params, buckets=[fg.params for fg in reversed(self.trained)],
                           numel_of=lambda p: numels[id(p)])
        if z.stage == 3:
            units = [UnitFlats(u, self.unit_flats[u.name], [self.masters[self.flats.index(fg)]
                                                            for fg in self.unit_flats[u.name]],
                               [self.shapes[fg.name] for fg in self.unit_flats[u.name]])
                     for u in self.units if self.unit_flats[u.name]]
            self.gatherer = UnitGatherer(units, param_dtype or torch.float32, z.reshard_after_forward, self.device)
            self.gatherer.install()
        self.memory = memory.expected(self)
        padding = sum(fg.total - fg.numel for fg in self.flats)
        log_rank0("ZeRO stage %d per rank: %s; %d flat groups over %s (%d padding elements), %d parameters unsharded",
                  z.stage, self.memory.describe(), len(self.flats),
                  ", ".join(sorted({fg.group.name for fg in self.flats})) or "-", padding, len(self.unsharded))

    # -- the step ---------------------------------------------------------------
    def _engine(self) -> grad_sync.GradSync:
        assert self.engine is not None, "after_materialize attaches the engine"
        return self.engine

    def before_backward(self, microbatch: int, num_microbatches: int) -> None:
        self._engine().begin_microbatch(microbatch, num_microbatches)

    def no_sync(self) -> ContextManager[None]:
        return self._engine().no_sync()

    def mark_ready(self, param: nn.Parameter) -> None:
        self._engine().mark_ready(param)

    def reduce_gradients(self) -> None:
        """Each flat group's averaged chunk becomes its shard parameters' gradients."""
        self._engine().finish()
        if self.stage == 0:
            return
        if self.gatherer is not None:  # units a pipeline stage still holds gathered: back to their shards first
            self.gatherer.release_all()
        for reduced, fg in zip(self._engine().shards(), reversed(self.trained)):
            used_anywhere = reduced.used_anywhere
            if fg.replicas is not None and fg.replicas.size > 1:  # hierarchical: the node averages, then across nodes
                across = fg.replicas.communicator()
                across.all_reduce(reduced.shard, ReduceOp.AVG)
                used = torch.tensor([float(u) for u in used_anywhere])
                across.all_reduce(used, ReduceOp.MAX)
                used_anywhere = [u > 0 for u in used.tolist()]
            for i, p in enumerate(fg.params):
                held = self.shards.get(id(p))
                if held is None:
                    continue
                shard = held[0]
                grad = reduced.shard[fg.shard_slice(i)]
                if grad.dtype != shard.dtype or grad.device != shard.device:  # fp32 master, or on the host
                    grad = grad.to(device=shard.device, dtype=shard.dtype)
                shard.grad = grad if used_anywhere[i] else None

    def gradients_of(self, params: Iterable[nn.Parameter]) -> List[torch.Tensor]:
        """The gradient of each parameter's part this rank holds: its shard's
        (a rank may hold none of a parameter; the two ends of a pipeline cut a
        tied table alike, so they agree on that)."""
        if self.stage == 0:
            return super().gradients_of(params)
        out = []
        for p in params:
            held = self.shards.get(id(p))
            if held is None:
                continue
            shard = held[0]
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            out.append(shard.grad)
        return out

    def make_optimizer(self, params: List[nn.Parameter], cfg: Any) -> Optional[torch.optim.Optimizer]:
        if self.stage == 0:
            return None
        apart = any(full is not None and not memory.inside(master, full)
                    for master, full in zip(self.masters, self.full))
        segments = None
        if self.cfg.offload == "nvme":
            directory = self.cfg.offload_dir or os.path.join(self.run_dir or tempfile.gettempdir(), "zero_offload")
            mapped = offload.mapped_states(directory, self.mesh.world_rank,
                                           [(fg.name, fg.chunk) for fg in self.trained])
            segments = [optimizer.Segment(list(fg.params), mapped[fg.name],
                                          {id(p): fg.shard_slice(i) for i, p in enumerate(fg.params)})
                        for fg in self.trained]
            segments.append(optimizer.Segment(list(self.unsharded)))
            log_rank0("ZeRO offload=nvme: optimizer moments memory-mapped in %s (%d files per rank)", directory,
                      len(mapped))
        elif self.cfg.offload == "cpu":
            log_rank0("ZeRO offload=cpu: %s", "fp32 master chunks and moments in pinned host memory, AdamW on the "
                      "host" if self.host else "the run is on the CPU already; nothing moves")
        specs = [fg.flat_spec(i) for fg in self.trained for i in range(len(fg.params))]
        specs += [get_spec(p) for p in self.unsharded]  # every tensor of the stage, held here or not
        zero = optimizer.ZeroOptimizer(list(params), self.shards, cfg.optim, self._after_step,
                                       masters_apart=apart, segments=segments, mesh=self.mesh, specs=specs)
        # (cast: it has what the core calls of a torch optimizer, step, zero_grad, param_groups, state and
        # state_dict, without deriving from torch.optim.Optimizer)
        return cast(torch.optim.Optimizer, zero)

    @torch.no_grad()
    def _after_step(self) -> None:
        """Stages 1-2: every rank's updated chunks, all-gathered into the whole parameters."""
        if self.stage == 3:
            return
        for fg, full, master in zip(self.flats, self.full, self.masters):
            assert full is not None  # stages 1-2 keep the whole flat buffer (of parameters that train)
            mine = full[fg.lo:fg.hi]
            if mine.data_ptr() != master.data_ptr():
                mine.copy_(master)
            fg.group.communicator().all_gather(full, mine)


def zero_config(cfg: Any) -> ZeroConfig:
    return plugin_section(cfg, "parallel.zero", ZeroConfig)


# -- hooks -----------------------------------------------------------------------
@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["dp"]}


@hookimpl
def hpctrain_benchmarks() -> Dict[str, str]:
    return {"zero": "hpctrain_zero.bench"}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"parallel.zero": ZeroConfig}


@hookimpl
def hpctrain_claim_axis(cfg: Any) -> Optional[bool]:
    return zero_config(cfg).stage > 0


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> Optional[List[str]]:
    z = zero_config(cfg)
    problems = []
    if z.stage not in (0, 1, 2, 3):
        problems.append(f"parallel.zero.stage={z.stage} is not one of 0, 1, 2, 3")
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(z, key) not in DTYPES:
            problems.append(f"parallel.zero.{key}={getattr(z, key)!r} is not one of {', '.join(DTYPES)}")
    if z.reduce_dtype == "none":
        problems.append("parallel.zero.reduce_dtype=none: name the reduction dtype (fp32, bf16 or fp16)")
    if z.shard_group not in SHARD_GROUPS:
        problems.append(f"parallel.zero.shard_group={z.shard_group!r} is not one of {', '.join(SHARD_GROUPS)}")
    if z.offload not in OFFLOADS:
        problems.append(f"parallel.zero.offload={z.offload!r} is not one of {', '.join(OFFLOADS)}")
    if z.offload != "none" and z.stage > 0 and cfg.optim.name != "adamw":
        problems.append(f"parallel.zero.offload={z.offload} offloads AdamW's moments only; with "
                        f"optim={cfg.optim.name} set parallel.zero.offload=none or use optim=adamw")
    if z.stage > 0 and cfg.optim.name not in OPTIMIZERS:
        # its shards are flat pieces of many tensors: an optimizer has to know the ShardSpecs to update them
        problems.append(f"optim.name={cfg.optim.name!r} (a plugin's optimizer) with parallel.zero.stage={z.stage}: "
                        f"ZeRO builds the optimizer of its shards itself and knows {', '.join(OPTIMIZERS)}; use one "
                        "of those, or parallel.zero.stage=0 (the plugin's optimizer over whole tensors)")
    if z.stage > 0 and OmegaConf.select(cfg, "optim.outer.name", default="none") == "diloco":
        # a replica trains alone, so its optimizer state cannot be cut over the other replicas
        problems.append(f"parallel.zero.stage={z.stage} with optim.outer=diloco: DiLoCo's dp replicas train alone, "
                        "so there is no data group to shard over; use parallel.zero.stage=0")
    return problems or None


@hookimpl
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any, run_dir: Optional[str]) -> Optional[Zero]:
    z = zero_config(cfg)
    units = model_units(model)
    flats: List[FlatGroup] = []
    unit_flats: Dict[str, List[FlatGroup]] = {}
    unsharded: List[nn.Parameter] = []
    for unit in units:
        by_group: Dict[str, Tuple[Any, List[nn.Parameter]]] = {}
        for p in unit.params:
            if not p.requires_grad and z.stage < 3:  # frozen: nothing to shard (no gradient, no state)
                continue
            group = mesh.group(mesh.reduction_axes(get_spec(p).split_axes))
            if group.size == 1:
                if p.requires_grad:
                    unsharded.append(p)
                continue
            # a copy held by two pipeline stages (tied embeddings) is a flat group of its own, cut alike at
            # both ends, so the ends can sum their gradient shards element for element
            key = group.name + ("@tied" if _tied_across_stages(p) else "") + ("" if p.requires_grad else "@frozen")
            by_group.setdefault(key, (group, []))[1].append(p)
        unit_flats[unit.name] = [FlatGroup(f"{unit.name}@{name}", ps, *_shard_groups(mesh, group, z))
                                 for name, (group, ps) in by_group.items()]
        flats += unit_flats[unit.name]
    shapes = {fg.name: [p.shape for p in fg.params] for fg in flats}
    if z.stage == 3:
        _shard_parameters(model, flats, units)
    zero = Zero(model, mesh, z, float(cfg.comm.bucket_mb), run_dir, units, flats, unit_flats, shapes,
                unsharded)
    zero.optim = cfg.optim
    return zero


def _tied_across_stages(p: nn.Parameter) -> bool:
    return len(dict(get_spec(p).held_on).get("pp", ())) > 1


def _shard_groups(mesh: Mesh, group: Group, z: ZeroConfig) -> Tuple[Group, Tuple[int, ...], Optional[Group]]:
    """(group the chunks are cut over, numels (default), replicas across nodes)
    for parameters averaged over ``group``."""
    if z.shard_group != "node":
        return group, (), None
    local, across = mesh.node_local(group.axes), mesh.across_nodes(group.axes)
    size = local.size
    start = group.ranks.index(local.ranks[0])
    if group.size % size or local.ranks != group.ranks[start:start + size] or start % size:
        raise PluginError(
            f"parallel.zero.shard_group=node needs every node to hold the same number of consecutive ranks of "
            f"group {group.name} (this node holds ranks {list(local.ranks)} of {list(group.ranks)}); launch the "
            "same number of ranks per node, keep tp/cp/ep inside nodes, or use parallel.zero.shard_group=world")
    return local, (), across


def _shard_parameters(model: nn.Module, flats: List[FlatGroup], units: List[Unit]) -> None:
    """Stage 3, on the meta model: each parameter becomes the flat shard this
    rank holds (its spec a flat split), so materialisation draws only that."""
    new: Dict[int, nn.Parameter] = {}
    for fg in flats:
        for i, p in enumerate(fg.params):
            a, b = fg.held(i)
            q = nn.Parameter(torch.empty(b - a, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            set_spec(q, fg.flat_spec(i))
            new[id(p)] = q
            fg.params[i] = q
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in new:
                module._parameters[name] = new[id(param)]
    for unit in units:
        unit.params = [new.get(id(p), p) for p in unit.params]


def _flat_buffers(fg: FlatGroup, param_dtype: Optional[torch.dtype], host: bool = False
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stages 1-2: the whole flat parameter buffer (the parameters become
    views of it) and the owned chunk the optimizer updates: a view of the
    buffer, or an fp32 copy when the parameters compute in ``param_dtype``
    or the optimizer runs on the host (``host``: offload=cpu on a GPU)."""
    first = fg.params[0]
    flat32 = torch.zeros(fg.total, dtype=first.dtype, device=first.device)
    for p, off, n in zip(fg.params, fg.offsets, fg.numels):
        flat32[off:off + n].copy_(p.detach().reshape(-1))
    if (param_dtype is None or param_dtype == first.dtype) and not host:
        full, master = flat32, flat32[fg.lo:fg.hi]
    else:
        full = flat32.to(param_dtype) if param_dtype is not None else flat32
        master = flat32[fg.lo:fg.hi].to("cpu").pin_memory() if host else flat32[fg.lo:fg.hi].clone()
    for p, off, n in zip(fg.params, fg.offsets, fg.numels):
        p.data = full[off:off + n].view(p.shape)
    return full, master


def _master_chunk_stage3(fg: FlatGroup, host: bool = False) -> torch.Tensor:
    """Stage 3: the owned chunk (fp32) holds every parameter's shard; the
    parameters become views of it (padding stays zero). ``host``: in pinned
    host memory (offload=cpu on a GPU; gathers copy it up)."""
    first = fg.params[0]
    chunk = torch.zeros(fg.chunk, dtype=torch.float32, device="cpu" if host else first.device,
                        pin_memory=host)
    for i, p in enumerate(fg.params):
        view = chunk[fg.shard_slice(i)]
        view.copy_(p.detach().reshape(-1))
        p.data = view
    return chunk
