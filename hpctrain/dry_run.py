"""``hpctrain-train ... --dry-run --world N [--ranks R1,R2,...]``: ranks of an N-rank job, played in one process.

Each chosen rank runs the real code of the real job: the config's validation
at world size N, the mesh of N ranks with this process as rank R, the
composition (``hpctrain.parallel.compose``: every axis plugin), the trainer
and one training step (the pipeline's schedule, the gradients' reduction,
the global norm, one optimizer step, the step's metrics), on the meta device
(shapes, no memory) with the collective backend that records instead of
moving data (the ``comm.dry_run`` capability: ``hpctrain_comm_record``).
Nothing is allocated, read or written beyond the config's own data source.

Per rank it reports (``RankReport``): the bytes of its parameters, of the
gradients the step leaves (the ``.grad`` of its parameters and of the
optimizer's shard parameters), of its optimizer state, the peak of the
tensors saved for backward (``torch.autograd.graph.saved_tensors_hooks``:
the bytes of each saved tensor's storage, counted once while any saved
reference lives, parameters not counted; autocast's 16-bit weight copies
apart), and the collectives per group (calls, bus bytes by op and dtype,
peers), beside the planner's prediction for the same rank
(``hpctrain.planner``: the pinned layout's ``stage_memory`` for this rank's
pipeline stage and ``estimate``'s bytes per axis).

What a dry run assumes, since no value exists:
- values: every tensor computed from weights or data holds ones; small
  tensors (at most ``SHADOW_LIMIT`` elements: counts, flags, the step's
  totals) are computed for real on the CPU beside their meta twins
  (``_Values``), so the checks a step makes on them (a finite norm, no short
  read, no padding) pass as in a healthy step;
- routing: MoE tokens are spread evenly over the experts (the expert
  plugin's plan on the meta device), so an all-to-all moves what a
  balanced router's would;
- precision: bf16/fp16 autocast is CUDA's (``hpctrain.model.amp``), the
  target of a dry run being a GPU job;
- attention: ``scaled_dot_product_attention`` keeps what a GPU's flash
  kernel keeps (q, k, v, output, log-sum-exp), not the s x s scores of the
  math fallback meta tensors would otherwise take;
- not run: checkpoints (no save, no resume), loggers, ``trainer.compile``.

Recomputed tensors (``model.recompute``) live inside torch's checkpoint
during backward and are not in the activation peak; a recomputed block's
inputs are.

One module on purpose (about 810 lines): the meta-device modes (values a
step reads, functions without meta kernels), the saved-bytes counter, the
rank's replay and its report are the stages of one command, each used only
here; the next piece that grows (the report) is the one to split off.
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hpctrain.comm.counting import unwrap
from hpctrain.comm.records import CollectiveRecord, ranks_text
from hpctrain.config.validate import validate
from hpctrain.errors import ConfigError, PluginError
from hpctrain.grad_sync import GradSync
from hpctrain.mesh import AXES, DATA_AXES, Mesh, parse_order, product_str, resolve_sizes
from hpctrain.model import amp
from hpctrain.plugins import capabilities, get_manager
from hpctrain.run import backend_factory
from hpctrain.train.grad_norm import gradient_pairs
from hpctrain.train.guard import NonFiniteGuard
from hpctrain.train.outer import alone_axes
from hpctrain.train.trainer import Trainer

META = torch.device("meta")
SHADOW_LIMIT = 1024
"""Elements up to which a meta tensor's values are computed on the CPU beside it (``_Values``)."""
FALLBACK_LIMIT = 1 << 24
"""Elements up to which an operator without a meta kernel (``bincount``...) runs on the CPU twins instead."""
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS")
"""Where mpirun and srun put the number of ranks they launched, readable before MPI starts."""

_aten = torch.ops.aten
_SHADOW = "_hpctrain_dry_value"


# -- the command line ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DryRunFlags:
    """``--dry-run --world N --ranks R1,R2``: what ``hpctrain-train`` was asked to play."""

    world: int
    ranks: Tuple[int, ...] = ()
    """World ranks to play; empty: the first rank of the first and of the last pipeline stage."""


def split_flags(argv: Sequence[str]) -> Tuple[List[str], Optional[DryRunFlags]]:
    """(the other arguments, the dry run's flags or None); ConfigError for a flag
    without its value or its ``--dry-run``, or a value that is not a count."""
    rest: List[str] = []
    dry, world, ranks = False, None, None
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        key, eq, value = a.partition("=")
        if a == "--dry-run":
            dry = True
        elif key in ("--world", "--ranks"):
            if not eq:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise ConfigError(f"{key} needs a value: --world N (the job's ranks), --ranks R1,R2,...")
                value = args[i + 1]
                i += 1
            if key == "--world":
                world = value
            else:
                ranks = value
        else:
            rest.append(a)
        i += 1
    if not dry:
        if world is not None or ranks is not None:
            raise ConfigError("--world and --ranks describe a dry run: add --dry-run (hpctrain-train ... --dry-run "
                              "--world N --ranks R1,R2)")
        return rest, None
    if world is None:
        raise ConfigError("--dry-run needs the job's size: --world N (e.g. --dry-run --world 16384 --ranks 0)")
    if not world.isdigit() or int(world) < 1:
        raise ConfigError(f"--world {world}: give the job's number of ranks, a positive integer (e.g. --world 16384)")
    chosen: List[int] = []
    for text in (ranks.split(",") if ranks else []):
        text = text.strip()
        if not text.isdigit():
            raise ConfigError(f"--ranks {ranks}: {text!r} is not a rank; give world ranks separated by commas "
                              f"(e.g. --ranks 0,{int(world) - 1})")
        chosen.append(int(text))
    return rest, DryRunFlags(int(world), tuple(chosen))


def launched_ranks() -> int:
    """How many ranks a launcher (mpirun, srun) started, from its environment (1: none)."""
    for name in LAUNCHER_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return int(value)
    return 1


def check_launch(flags: Optional[DryRunFlags], evaluate: bool = False, launched: Optional[int] = None) -> None:
    """ConfigError when the dry run was launched as a job of several ranks (``launched``: the MPI world's
    size once MPI runs; before, what the launcher's environment says) or asked of hpctrain-eval."""
    if flags is None:
        return
    if evaluate:
        raise ConfigError("hpctrain-eval has no --dry-run; use hpctrain-train ... --dry-run --world N")
    launched = launched_ranks() if launched is None else launched
    if launched > 1:
        raise ConfigError(f"--dry-run plays ranks of the {flags.world}-rank job in one process, but this launch "
                          f"started {launched} ranks; run it without mpirun or srun (hpctrain-train ... --dry-run "
                          f"--world {flags.world})")


def request_problems(cfg: Any, flags: DryRunFlags) -> List[str]:
    """The world and ranks against the layout, each with its fix (before any other check)."""
    world = flags.world
    sizes = {a: int(cfg.parallel[a]) for a in AXES}
    try:
        order = parse_order(cfg.parallel.order)
    except ConfigError:
        return []  # validation says it
    if any(n == 0 or n < -1 or (n == -1 and a != "dp") for a, n in sizes.items()):
        return []  # validation says it
    rest = math.prod(n for a, n in sizes.items() if a != "dp")
    if sizes["dp"] == -1 and world % rest:
        shown = product_str(sizes, [a for a in order if a != "dp"])
        lo = max(rest, world // rest * rest)
        return [f"--dry-run --world {world}: {world} ranks are not divisible by {shown} = {rest}; use --world a "
                f"multiple of {rest} (e.g. {lo} or {lo + rest})"]
    if sizes["dp"] != -1 and rest * sizes["dp"] != world:
        return [f"--dry-run --world {world}: {product_str(sizes, order)} = {rest * sizes['dp']} != {world} ranks; "
                f"use --world {rest * sizes['dp']} or parallel.dp=-1"]
    bad = [r for r in flags.ranks if r >= world]
    if bad:
        return [f"--ranks {','.join(map(str, flags.ranks))}: {', '.join(map(str, bad))} "
                f"{'is' if len(bad) == 1 else 'are'} outside the world of {world} ranks; choose ranks in "
                f"0..{world - 1}"]
    return []


# -- values on the meta device ---------------------------------------------------------------------------------------

def _ones_like(t: torch.Tensor) -> torch.Tensor:
    return torch.ones(t.shape, dtype=t.dtype)


def _value_of(t: torch.Tensor) -> torch.Tensor:
    """The values a meta tensor stands for: its CPU twin, or ones."""
    found = getattr(t, _SHADOW, None)
    return found if found is not None and found.shape == t.shape else _ones_like(t)


def _cpu_device(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    if isinstance(x, str) and x == "meta":
        return "cpu"
    return x


def _is_empty_factory(func: Any) -> bool:
    name = func.__name__
    return name.startswith(("empty", "new_empty"))


def _meta_tensors(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The meta tensors among an operator's arguments (tensor lists one level deep, as aten passes them)."""
    out = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            if x.is_meta:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            out += [y for y in x if isinstance(y, torch.Tensor) and y.is_meta]
    return out


class _Values(TorchDispatchMode):
    """Values of a step on the meta device (the module docstring, "values"): a read of a
    meta tensor (``.item()``, ``.tolist()``, ``float()``, a copy to the CPU) gets its
    CPU twin, or ones; an operation whose meta tensors are all small is run on their
    twins too, so counts and flags computed from Python numbers are exact."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: Set[int] = set()
        """Storages of the rank's parameters (filled once they exist)."""
        self.weight_copies: Dict[int, torch.Tensor] = {}
        """16-bit casts of them made explicitly (not by autocast's weight cache), by storage; kept for the
        step (meta tensors: no memory) so that no later tensor reuses a storage key."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and args[0].is_meta:
            return _value_of(args[0]).item()
        if func is _aten._to_copy.default and args[0].is_meta:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "meta":
                return func(_value_of(args[0]), **kwargs)
        if func is _aten._to_copy.default and args[0].is_meta and _storage_key(args[0]) in self.weights:
            out = func(*args, **kwargs)
            if out.dtype != args[0].dtype:  # a cast of a weight made outside autocast's cache (MoE expert stacks)
                self.weight_copies[_storage_key(out)] = out
            return out
        if func is _aten._to_copy.default and not args[0].is_meta:
            device = kwargs.get("device")
            out = func(*args, **kwargs)
            if device is not None and torch.device(device).type == "meta" and out.numel() <= SHADOW_LIMIT:
                setattr(out, _SHADOW, args[0].detach().to(dtype=out.dtype, copy=True))  # data moved to the device
            return out
        if func is _aten.copy_.default and not args[0].is_meta and isinstance(args[1], torch.Tensor) \
                and args[1].is_meta:
            return args[0].copy_(_value_of(args[1]))
        if func is _aten.equal.default and (args[0].is_meta or args[1].is_meta):
            return bool(torch.equal(_value_of(args[0]) if args[0].is_meta else args[0],
                                    _value_of(args[1]) if args[1].is_meta else args[1]))
        metas = _meta_tensors(args, kwargs)
        small = all(t.numel() <= SHADOW_LIMIT for t in metas)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):
            # no meta kernel, or a shape only the values give (bincount, nonzero, ...): from the twins
            if not metas or sum(t.numel() for t in metas) > FALLBACK_LIMIT:
                raise
            twin = self._twin(func, args, kwargs, metas, keep=small)
            if twin is None:
                raise
            out = tree_map(lambda s: torch.empty_strided(s.shape, s.stride(), dtype=s.dtype, device="meta")
                           if isinstance(s, torch.Tensor) else s, twin[0])
            if small:
                self._attach(out, twin[0])
            return out
        if not small:
            return out
        outs = _meta_tensors(out if isinstance(out, (list, tuple)) else (out,), {})
        if not outs or any(t.numel() > SHADOW_LIMIT for t in outs):
            return out
        if _is_empty_factory(func):
            return out  # uninitialised: ones (``_value_of``)
        twin = self._twin(func, args, kwargs, metas)
        if twin is not None:
            self._attach(out, twin[0])
        return out

    @staticmethod
    def _twin(func, args, kwargs, metas, keep: bool = True) -> Optional[Tuple[Any]]:
        """(the operation's result on the CPU twins,), or None when it cannot run there. A meta
        argument without a twin gets one (ones), kept with it (``keep``) so that a view of it and
        a change in place share it."""

        def to_cpu(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                twin = getattr(x, _SHADOW, None)
                if twin is None or twin.shape != x.shape:
                    twin = _ones_like(x)
                    if keep:
                        setattr(x, _SHADOW, twin)
                return twin
            return _cpu_device(x)

        try:
            cargs, ckwargs = tree_map(to_cpu, (args, kwargs))
            return (func(*cargs, **ckwargs),)
        except Exception:  # noqa: BLE001 - a twin is a convenience: without it the values are ones
            return None

    @staticmethod
    def _attach(out: Any, twin: Any) -> None:
        for o, s in zip(tree_flatten(out)[0], tree_flatten(twin)[0]):
            if isinstance(o, torch.Tensor) and o.is_meta and isinstance(s, torch.Tensor) and s.shape == o.shape:
                setattr(o, _SHADOW, s)


_FLASH = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on meta tensors as a GPU's flash kernel runs it: it saves q, k, v
    (k and v with their own heads), the output and the log-sum-exp, never the s x s scores."""
    assert _FLASH is not None  # (checked by the caller)
    mask = None if attn_mask is None else torch.empty(attn_mask.shape, dtype=q.dtype, device=q.device)
    return _FLASH(q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]


class _MetaFunctions(TorchFunctionMode):
    """Two functions the meta device would get wrong: ``torch.tensor(data, device="meta")`` (and
    ``torch.as_tensor``), which reach no dispatch mode, is made on the CPU and moved, so the meta
    tensor keeps the numbers as its twin (``_Values``); ``F.scaled_dot_product_attention``, which
    on meta tensors takes the math fallback and saves the s x s scores, runs as the flash kernel
    of a GPU (``_flash_attention``), in backward's recomputations too (``_run_backward``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":
                return func(*args, **{**kwargs, "device": "cpu"}).to("meta")
        elif func is F.scaled_dot_product_attention and _FLASH is not None and args and args[0].is_meta:
            return _flash_attention(*args, **kwargs)
        elif func in (torch.autograd.backward, torch.Tensor.backward):
            # a mode is off while its own handler runs, and the backward recomputes (model.recompute):
            # run the engine with this mode on again, so a recomputed block's attention is the flash kernel too
            with self:
                return _run_backward(*args, **kwargs)
        return func(*args, **kwargs)


def _run_backward(tensors: Any, grad_tensors: Any = None, retain_graph: Optional[bool] = None,
                  create_graph: bool = False, inputs: Any = None, gradient: Any = None) -> None:
    """``torch.autograd.backward`` (or ``Tensor.backward``, whose ``gradient`` it takes) as torch runs it
    after its torch-function check: the engine, on this thread, under the modes now on (torch 2.13's own
    helpers)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple  # torch's own backward's helpers
    from torch.autograd.graph import _engine_run_backward

    outs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = _tensor_or_tensors_to_tuple(gradient if grad_tensors is None else grad_tensors, len(outs))
    grads = _make_grads(outs, grads, is_grads_batched=False)
    wrt = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    _engine_run_backward(outs, grads, create_graph if retain_graph is None else retain_graph, create_graph, wrt,
                         allow_unreachable=True, accumulate_grad=True)


# -- what a step saves for backward ----------------------------------------------------------------------------------

def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Held:
    """A saved tensor, counted while this object lives (the autograd graph holds it)."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, key: int, owner: "_SavedBytes"):
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


class _SavedBytes:
    """Live and peak bytes of the tensors saved for backward (storages counted once), parameters left
    out, autocast's weight copies apart."""

    def __init__(self, exclude: Set[int], copies: Optional[Dict[int, torch.Tensor]] = None):
        self.exclude = exclude
        self.copies = copies if copies is not None else {}
        self.refs: Dict[int, List[Any]] = {}  # storage -> [references, bytes, is a weight copy]
        self.live = self.peak = 0
        self.copies_live = self.copies_peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        key = _storage_key(t)
        if key in self.exclude:
            return t
        entry = self.refs.get(key)
        if entry is not None:
            entry[0] += 1
        else:
            nbytes = t.untyped_storage().nbytes()
            copy_ = amp.is_weight_copy(t) or key in self.copies
            self.refs[key] = [1, nbytes, copy_]
            if copy_:
                self.copies_live += nbytes
                self.copies_peak = max(self.copies_peak, self.copies_live)
            else:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return _Held(t, key, self)

    @staticmethod
    def unpack(held: Any) -> Any:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[key]
            if entry[2]:
                self.copies_live -= entry[1]
            else:
                self.live -= entry[1]


class _DryTrainer(Trainer):
    """The trainer, with the gradients measured where they are most: after the step's backwards (before
    the data axes reduce them: ZeRO-1 then holds every full gradient) and after the reduction."""

    measure: Any = None
    grad_peak = 0

    def _finish_gradients(self, step: int, result: Any, scale: Optional[float]) -> Any:
        before = self.measure() if self.measure is not None else 0
        out = super()._finish_gradients(step, result, scale)
        after = self.measure() if self.measure is not None else 0
        self.grad_peak = max(self.grad_peak, before, after)
        return out


def _gradients(trainer: Trainer, params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """Every gradient the trainer holds now: its parameters' ``.grad``, the optimizer's (ZeRO's shards)
    and the buffers of the data handle's gradient-sync engine (``hpctrain.grad_sync``: the buckets the
    gradients accumulate in, and their reduced shards), when it keeps one as ``engine``."""
    out = [p.grad for p in params] + [g for g, _ in gradient_pairs(trainer.params, trainer.optimizer)]
    engine = getattr(trainer.data_handle, "engine", None)
    if isinstance(engine, GradSync):
        for bucket in engine.buckets:
            out += [getattr(bucket, "buffer", None), getattr(bucket, "shard", None)]
    return out


class _Healthy(NonFiniteGuard):
    """The dry run's step updates: it has no loss to judge (a pipeline's first stage sums no tokens, and
    the recording backend adds nothing up), so the non-finite guard always lets the update through."""

    def __init__(self) -> None:
        super().__init__("skip", 0)

    def update_allowed(self, step: int, loss: float, grad_norm: float) -> bool:
        return True


def _storages(tensors: Iterable[Optional[torch.Tensor]], seen: Set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (which gets them)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# -- the report ------------------------------------------------------------------------------------------------------

@dataclass
class GroupTraffic:
    """One group's collectives in the step, as this rank recorded them."""

    group: str
    axes: Tuple[str, ...]
    peers: str
    """The group's world ranks, compactly (``ranks_text``)."""
    calls: int = 0
    nbytes: float = 0.0
    by_op: Dict[str, float] = field(default_factory=dict)
    """Bus bytes by op."""
    calls_by_op: Dict[str, int] = field(default_factory=dict)
    dtypes: Dict[str, float] = field(default_factory=dict)
    """Bus bytes by dtype."""
    world: bool = False
    """Whether the group is every rank of the job."""

    @property
    def planner_axis(self) -> str:
        """The planner's axis for this group: one axis, ``dp`` for the data axes together, ``world`` for
        every rank of a job with other axes (the step's totals), else the group's name."""
        if self.group == "pp_ends":
            return "pp"
        if len(self.axes) == 1:
            return self.axes[0]
        if self.axes and set(self.axes) <= set(DATA_AXES):
            return "dp"
        return "world" if self.world else self.group


@dataclass
class PlannerFigures:
    """The planner's prediction for a rank (bytes), or why there is none."""

    weights: Optional[float] = None
    grads: Optional[float] = None
    optimizer: Optional[float] = None
    activations: Optional[float] = None
    buffers: Optional[float] = None
    comm: Dict[str, float] = field(default_factory=dict)
    """Bus bytes per step per axis (tp cp ep pp dp) of this rank's pipeline stage (``planner.traffic``)."""
    problem: Optional[str] = None


@dataclass
class RankReport:
    """What one rank of the job holds and sends in one step (see the module docstring)."""

    rank: int
    world: int
    coords: Dict[str, int]
    sizes: Dict[str, int]
    params: int
    """Bytes of this rank's parameters (storages: flat buffers and padding included)."""
    grads: int
    """Bytes of the gradients the step leaves (parameters' and the optimizer's shards')."""
    optimizer: int
    """Bytes of the optimizer's state (moments; the fp32 master copy where it is one)."""
    activations: int
    """Peak bytes of the tensors saved for backward (parameters and weight copies not counted)."""
    weight_copies: int
    """Peak bytes of autocast's 16-bit weight copies saved for backward."""
    traffic: List[GroupTraffic]
    seconds: float
    planner: PlannerFigures = field(default_factory=PlannerFigures)
    records: List[CollectiveRecord] = field(default_factory=list, repr=False)

    def bytes_by_axis(self) -> Dict[str, float]:
        """Bus bytes per planner axis (``GroupTraffic.planner_axis``)."""
        out: Dict[str, float] = {}
        for g in self.traffic:
            out[g.planner_axis] = out.get(g.planner_axis, 0.0) + g.nbytes
        return out

    def bytes_by_group(self) -> Dict[str, float]:
        return {g.group: g.nbytes for g in self.traffic}


def _traffic(mesh: Mesh) -> Tuple[List[GroupTraffic], List[CollectiveRecord]]:
    out, records = [], []
    for g in mesh.distinct_groups:
        if g.size == 1 or g.comm is None:
            continue
        recs: List[CollectiveRecord] = list(getattr(unwrap(g.comm), "records", []))
        if not recs:
            continue
        t = GroupTraffic(g.name, tuple(g.axes), ranks_text(g.ranks), world=g.size == mesh.world_size)
        for r in recs:
            t.calls += 1
            t.nbytes += r.nbytes
            t.by_op[r.op] = t.by_op.get(r.op, 0.0) + r.nbytes
            t.calls_by_op[r.op] = t.calls_by_op.get(r.op, 0) + 1
            dtype = str(r.dtype).replace("torch.", "")
            t.dtypes[dtype] = t.dtypes.get(dtype, 0.0) + r.nbytes
        out.append(t)
        records += recs
    return out, records


# -- the run ---------------------------------------------------------------------------------------------------------

def recording_backend(pm: Any) -> str:
    """The name of a collective backend that records instead of moving data (``comm.dry_run``)."""
    served = capabilities(pm).get("comm.dry_run", [])
    if not served:
        raise PluginError("--dry-run needs a collective backend that records (the comm.dry_run capability of the "
                          "built-in plugin comm_record); reinstall hpctrain or unblock comm_record in "
                          "HPCTRAIN_DISABLE_PLUGINS")
    return served[0]


def dry_config(cfg: Any, pm: Any) -> Any:
    """``cfg`` as a dry run runs it: the recording backend on every axis; no checkpoint saved or read,
    no compilation."""
    out = copy.deepcopy(cfg)
    out.comm.backend = recording_backend(pm)
    out.comm.per_axis = {}
    out.trainer.compile = False
    out.checkpoint.every = 0
    out.checkpoint.resume = None
    out.checkpoint.save_on_stop = False
    out.checkpoint.init_from = None
    if OmegaConf.select(out, "checkpoint.local.every", default=None) is not None:
        out.checkpoint.local.every = 0
    return out


def default_ranks(cfg: Any, world: int) -> Tuple[int, ...]:
    """The first rank of the first and of the last pipeline stage."""
    mesh_sizes = resolve_sizes({a: int(cfg.parallel[a]) for a in AXES}, world, cfg.parallel.order)
    probe = _LayoutProbe(mesh_sizes, cfg.parallel.order)
    return tuple(sorted({0, probe.rank_of({"pp": mesh_sizes["pp"] - 1})}))


class _LayoutProbe:
    """Coordinates of a layout without building its groups."""

    def __init__(self, sizes: Dict[str, int], order: str):
        self.sizes = sizes
        self.strides: Dict[str, int] = {}
        stride = 1
        for a in order.split("-"):
            a = a.strip()
            self.strides[a] = stride
            stride *= sizes[a]

    def rank_of(self, coords: Dict[str, int]) -> int:
        return sum(coords.get(a, 0) * self.strides[a] for a in AXES)


def execute(cfg: Any, flags: DryRunFlags, pm: Any = None) -> str:
    """``hpctrain-train --dry-run``: the reports as printed, with the wall time."""
    t0 = time.perf_counter()
    reports = dry_run(cfg, flags, pm)
    return report_text(cfg, reports) + f"\ndry run of {len(reports)} rank(s) in {time.perf_counter() - t0:.1f} s"


def dry_run(cfg: Any, flags: DryRunFlags, pm: Any = None) -> List[RankReport]:
    """Play ``flags.ranks`` of ``cfg``'s job at ``flags.world`` ranks (module docstring); ConfigError
    with every problem (the request's, then validation's) before anything is built."""
    pm = pm or get_manager()
    problems = request_problems(cfg, flags)
    if problems:
        raise ConfigError("\n".join(problems))
    run_cfg = dry_config(cfg, pm)
    problems = validate(run_cfg, flags.world, pm, None)
    if problems:
        raise ConfigError("\n".join(problems))
    ranks = flags.ranks or default_ranks(cfg, flags.world)
    return [play_rank(run_cfg, flags.world, r, pm) for r in ranks]


def rank_nodes(cfg: Any, world: int) -> Optional[List[int]]:
    """Each rank's node when ``cluster.gpus_per_node`` divides the world (consecutive ranks share a
    node, as a launcher places them), else None: one node."""
    per = int(OmegaConf.select(cfg, "cluster.gpus_per_node", default=0) or 0)
    return [r // per for r in range(world)] if per > 0 and world % per == 0 else None


def play_rank(cfg: Any, world: int, rank: int, pm: Any) -> RankReport:
    """One rank's set-up and step on the meta device (``cfg`` validated, from ``dry_config``)."""
    t0 = time.perf_counter()
    values = _Values()
    with _MetaFunctions(), values:
        mesh = Mesh({a: cfg.parallel[a] for a in AXES}, rank, world, cfg.parallel.order,
                    rank_nodes=rank_nodes(cfg, world), alone_axes=alone_axes(cfg))
        mesh.attach_backends(backend_factory(cfg, pm, META))
        trainer = _DryTrainer(cfg, mesh, pm, META, None)
        trainer.guard = _Healthy()
        params = list(dict.fromkeys([*trainer.model.parameters(), *trainer.params]))
        counted: Set[int] = set()
        param_bytes = _storages(params, counted)
        trainer.measure = lambda: _storages(_gradients(trainer, params), set(counted))
        values.weights = set(counted)
        saved = _SavedBytes(set(counted), values.weight_copies)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            trainer.train_step()
        grad_bytes = max(trainer.grad_peak, trainer.measure())
        _storages(_gradients(trainer, params), counted)
        state_bytes = _storages(_state_tensors(trainer.optimizer, trainer.params), counted)
    traffic, records = _traffic(mesh)
    report = RankReport(rank, world, dict(mesh.coords), dict(mesh.sizes), param_bytes, grad_bytes, state_bytes,
                        saved.peak, saved.copies_peak, traffic, time.perf_counter() - t0, records=records)
    report.planner = planner_figures(cfg, mesh)
    return report


def _state_tensors(optimizer: Any, params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    state = getattr(optimizer, "state", {})
    for p in params:
        try:
            entry = state.get(p)
        except (KeyError, TypeError):
            entry = None
        for value in (entry or {}).values():
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


# -- the planner beside it -------------------------------------------------------------------------------------------

def planner_figures(cfg: Any, mesh: Mesh) -> PlannerFigures:
    """The planner's memory for this rank's pipeline stage and its bytes per axis, for ``cfg`` pinned
    to ``mesh``'s layout; the planner's refusal or error as ``problem``."""
    try:
        return _planner_figures(cfg, mesh)
    except Exception as e:  # noqa: BLE001 - the planner's view is a comparison, never a reason to fail
        return PlannerFigures(problem=f"{type(e).__name__}: {e}".splitlines()[0])


def _planner_figures(cfg: Any, mesh: Mesh) -> PlannerFigures:
    # the planner's own pieces, as its search uses them (hpctrain.planner.search / plan)
    from hpctrain.planner.arch import Arch  # the planner: only when a dry run compares with it
    from hpctrain.planner.estimate import Workload, stage_memory  # the planner: only for a dry run
    from hpctrain.planner.layouts import Layout  # the planner: only when a dry run compares with it
    from hpctrain.planner.memory import optimizer_profile  # the planner: only when a dry run compares with it
    from hpctrain.planner.traffic import stage_bytes  # the planner: only when a dry run compares with it

    arch = Arch.from_model_config(cfg.model)
    from hpctrain.planner.lora import lora_plan  # the planner: only when a dry run compares with it

    work = Workload(int(cfg.trainer.global_batch_size), int(cfg.trainer.seq_len), str(cfg.trainer.precision),
                    optimizer_profile(str(cfg.optim.name), arch.muon_share), float(cfg.comm.bucket_mb) * 2 ** 20,
                    lora=lora_plan(cfg))
    s = mesh.sizes
    pipeline = OmegaConf.select(cfg, "parallel.pipeline", default=None)
    layers = OmegaConf.select(cfg, "parallel.pipeline.layers", default="auto")
    knobs: Dict[str, Any] = {}
    if s["pp"] > 1 and pipeline is not None:
        knobs["schedule"] = str(pipeline.schedule)
        knobs["vpp"] = int(OmegaConf.select(cfg, "parallel.pipeline.vpp", default=1) or 1)
        if layers not in (None, "auto") and not isinstance(layers, str):
            knobs["layers"] = tuple(int(n) for n in layers)
    lay = Layout(s["tp"], s["cp"], s["ep"], s["dp"], s["pp"], int(cfg.trainer.micro_batch_size),
                 int(OmegaConf.select(cfg, "parallel.zero.stage", default=0) or 0), str(cfg.model.recompute),
                 **knobs)
    mem = stage_memory(arch, lay, work, mesh.coords["pp"])
    comm = stage_bytes(arch, lay, work, mesh.coords["pp"])
    return PlannerFigures(mem.weights, mem.grads, mem.optimizer, mem.activations, mem.buffers, comm)


# -- printing --------------------------------------------------------------------------------------------------------

def _gb(x: Optional[float]) -> str:
    """Bytes in decimal units (GB, MB, kB, B)."""
    if x is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} B"


def _ratio(mine: float, theirs: Optional[float]) -> str:
    if theirs is None:
        return ""
    if theirs == 0:
        return "" if mine == 0 else "  (planner 0)"
    return f"  ({mine / theirs:.3f}x)"


def report_text(cfg: Any, reports: Sequence[RankReport]) -> str:
    """The reports as ``hpctrain-train --dry-run`` prints them."""
    lines: List[str] = []
    for r in reports:
        order = cfg.parallel.order.split("-")
        where = ", ".join(f"{a} {r.coords[a]}" for a in order if r.sizes[a] > 1) or "the only rank of each axis"
        lines.append(f"dry run: {cfg.model.name}, rank {r.rank} of {r.world} ({product_str(r.sizes, order)}; "
                     f"{where}), {cfg.trainer.precision}, {r.seconds:.1f} s")
        p = r.planner
        lines.append(f"  {'per rank':<24}{'dry run':>14}{'planner':>14}")
        rows = [("parameters", r.params, p.weights), ("gradients", r.grads, p.grads),
                ("optimizer state", r.optimizer, p.optimizer), ("activation peak", r.activations, p.activations),
                ("autocast weight copies", r.weight_copies, None)]
        for name, mine, theirs in rows:
            lines.append(f"  {name:<24}{_gb(mine):>14}{_gb(theirs):>14}{_ratio(mine, theirs)}")
        if p.buffers is not None:
            lines.append(f"  {'(planner buffers)':<24}{'':>14}{_gb(p.buffers):>14}")
        lines.append("  bytes per step by axis (bus bytes)")
        axes = r.bytes_by_axis()
        for axis in sorted(set(axes) | {a for a, v in p.comm.items() if v}):
            theirs = p.comm.get(axis) if axis in p.comm else None
            lines.append(f"  {axis:<24}{_gb(axes.get(axis, 0.0)):>14}{_gb(theirs):>14}"
                         f"{_ratio(axes.get(axis, 0.0), theirs)}")
        lines.append("  collectives by group")
        for g in r.traffic:
            ops = ", ".join(f"{op} {g.calls_by_op[op]} calls {_gb(v)}" for op, v in g.by_op.items())
            dtypes = ", ".join(f"{d} {_gb(v)}" for d, v in sorted(g.dtypes.items()))
            lines.append(f"    {g.group:<14} ranks {g.peers}: {g.calls} calls, {_gb(g.nbytes)} ({ops}; {dtypes})")
        if p.problem:
            lines.append(f"  planner: {p.problem}")
    return "\n".join(lines)
