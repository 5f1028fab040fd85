"""What a checkpoint holds of a ``TrainState`` (``describe``), and the conversions
between tensors and the numpy arrays h5py reads and writes.

The tree (``h5ls -r`` shows it)::

    /model/<logical name>               every parameter, logical shape
    /optim/<state key>/<logical name>   optimizer state per parameter: tensors
                                        shaped like the parameter share its
                                        ShardSpec (Adam's exp_avg, exp_avg_sq);
                                        scalars (Adam's step) are 0-d datasets
    /meta/config                        the resolved config, YAML text
    /meta/rng/torch_cpu                 (world size, state bytes) uint8, row = world rank
    /meta/rng/torch_cuda                the same for the rank's GPU generator (GPU runs)
    /meta  attributes                   format, format_version, step,
                                        consumed_samples, world_size, layout,
                                        optimizer (optim.name), scheduler,
                                        data_cursor, trainer_state
                                        (``TrainState.extra_state()``, JSON),
                                        versions, provenance (software, job,
                                        config and data hashes:
                                        ``hpctrain.provenance``), created_unix, ...

Each dataset carries ``torch_dtype``, ``checksum`` and, for tensors,
``splits`` (the saving layout's ShardSpec splits, JSON); its path names
the tensor and its kind, so nothing else is repeated per dataset (every
attribute is a collective metadata write). bfloat16 is
stored as its 16-bit pattern (``uint16``) with ``torch_dtype=bfloat16``.
The learning-rate schedule is a pure function of the step, so the step
restores it; the ``scheduler`` attribute records the schedule and the next
LR for people and tools, and a load warns when the run's schedule differs.

RNG states on load: restored row by row when the world size is unchanged.
With another world size there is no meaningful mapping from old ranks to
new ones, so they are not restored (a warning says so); training consumes
no random numbers today (dropout is 0, the data order is a function of the
sample index), so the losses are unaffected.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import h5py
import numpy as np
import torch
from omegaconf import OmegaConf

import hpctrain
from hpctrain.log import get_logger
from hpctrain.mesh import Mesh
from hpctrain.provenance import ATTR as PROVENANCE_ATTR
from hpctrain.shard import SPEC_ATTR, Piece, ShardSpec, get_spec, replicated_spec
from hpctrain.train.lr_schedule import lr_at

from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.layout import FORMAT_NAME, FORMAT_VERSION, Box, DatasetDecl, splits_json

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState

log = get_logger(__name__)

TORCH_TO_NUMPY: Dict[torch.dtype, str] = {
    torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2", torch.bfloat16: "<u2",
    torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
    torch.bool: "|b1",
}
NAME_TO_TORCH: Dict[str, torch.dtype] = {str(t).replace("torch.", ""): t for t in TORCH_TO_NUMPY}

Data = Union[torch.Tensor, np.ndarray]


@dataclass
class StateView:
    """This rank's share of the checkpoint, referencing live tensors (no copies yet)."""

    decls: List[DatasetDecl] = field(default_factory=list)
    boxes: Dict[str, List[Box]] = field(default_factory=dict)
    data: Dict[str, List[Data]] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)
    """Must be equal on every rank (checked by the Plan)."""
    attrs: Dict[str, Any] = field(default_factory=dict)
    """/meta attributes (rank 0's are written)."""

    def add(self, decl: DatasetDecl, box: Box, data: Data) -> None:
        if decl.path not in self.boxes:
            self.decls.append(decl)
        self.boxes.setdefault(decl.path, []).append(box)
        self.data.setdefault(decl.path, []).append(data)


def dtype_name(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")


def _decl(path: str, shape: Tuple[int, ...], dtype: torch.dtype, **attrs: str) -> DatasetDecl:
    if dtype not in TORCH_TO_NUMPY:
        raise CheckpointError(f"{path}: dtype {dtype} cannot be stored")
    attrs["torch_dtype"] = dtype_name(dtype)
    return DatasetDecl(path, tuple(int(n) for n in shape), TORCH_TO_NUMPY[dtype], tuple(sorted(attrs.items())))


@dataclass
class Held:
    """One tensor of the training state as the checkpoint sees it."""

    path: str
    """Dataset path (``/model/<name>``, ``/buffers/<name>``, ``/optim/<key>/<name>``)."""
    tensor: torch.Tensor
    """This rank's local tensor."""
    spec: ShardSpec
    """What of the logical tensor it holds (``ShardSpec.pieces``)."""

    def pieces(self, mesh: Mesh) -> List[Piece]:
        shape = self.spec.local_shape(mesh.coords, mesh.sizes)
        if tuple(shape) != tuple(self.tensor.shape):
            raise CheckpointError(f"{self.path}: ShardSpec gives a local shape {tuple(shape)} but the tensor "
                                  f"is {tuple(self.tensor.shape)}")
        return self.spec.pieces(mesh.coords, mesh.sizes)


def held_params(train_state: "TrainState") -> List[Tuple[torch.nn.Parameter, Held]]:
    """Every parameter once (tied ones once), as ``/model/<logical name>``."""
    out, seen = [], set()
    for _, p in train_state.model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            spec = get_spec(p)
            out.append((p, Held(f"/model/{spec.logical_name}", p, spec)))
    return out


def held_buffers(model: torch.nn.Module) -> List[Held]:
    """Every persistent buffer once, as ``/buffers/<logical name>``: its
    ShardSpec when it has one, else replicated and named by its path."""
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            spec = getattr(buf, SPEC_ATTR, None) or replicated_spec(f"{mod_name}.{name}" if mod_name else name,
                                                                    tuple(buf.shape), "zeros")
            out.append(Held(f"/buffers/{spec.logical_name}", buf, spec))
    return out


def optimizer_state(train_state: "TrainState") -> Any:
    state = getattr(train_state.optimizer, "state", None)
    if state is None:
        raise CheckpointError(f"optimizer {type(train_state.optimizer).__name__} has no per-parameter .state; "
                              "its plugin must expose one keyed by parameter to be checkpointed")
    return state


def state_spec(train_state: "TrainState", param: torch.nn.Parameter, key: str, shape: Tuple[int, ...]) -> ShardSpec:
    """The ShardSpec of optimizer state ``key`` of ``param`` (local ``shape``):
    the optimizer's ``state_spec(param, key)`` when it gives one (sharded
    state: ZeRO), else the parameter's own when the shapes agree."""
    given = getattr(train_state.optimizer, "state_spec", None)
    spec = given(param, key) if callable(given) else None
    if spec is not None:
        return spec
    pspec = get_spec(param)
    if tuple(shape) != tuple(param.shape):
        raise CheckpointError(f"optimizer state {key!r} of {pspec.logical_name} has shape {tuple(shape)}, neither "
                              f"the parameter's {tuple(param.shape)} nor a scalar; its optimizer must say how it is "
                              "laid out with state_spec(param, key) (hpctrain.checkpoint)")
    return pspec


def versions() -> Dict[str, str]:
    import mpi4py  # MPI starts at import: only when a save records the versions
    from mpi4py import MPI  # MPI starts at import: only when a save records the versions


    return {"hpctrain": hpctrain.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version, "mpi4py": mpi4py.__version__,
            "mpi": MPI.Get_library_version().split("\x00")[0].splitlines()[0].strip(), "python": sys.version.split()[0]}


def static_text(cfg: Any) -> Tuple[bytes, str]:
    """(resolved config YAML, library versions JSON): fixed for a run, so the
    checkpointer computes them once instead of inside every blocking save."""

    return OmegaConf.to_yaml(cfg, resolve=True).encode("utf-8") or b"\n", json.dumps(versions())


def describe(train_state: "TrainState", static: Optional[Tuple[bytes, str, str]] = None) -> StateView:
    """Every dataset this rank holds, with its box, referencing live tensors; ``static``: the config text,
    versions and provenance (``hpctrain.provenance``, JSON; empty: not recorded) the checkpointer made once."""
    mesh, cfg, view = train_state.mesh, train_state.cfg, StateView()
    text, versions_json, provenance_json = static or (*static_text(cfg), "")
    state = optimizer_state(train_state)
    for p, held in held_params(train_state):
        name = held.spec.logical_name
        _add_tensor(view, held, mesh)
        for key, value in sorted(state.get(p, {}).items()):
            path = f"/optim/{key}/{name}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                _add_tensor(view, Held(path, value, state_spec(train_state, p, key, tuple(value.shape))), mesh)
            elif isinstance(value, torch.Tensor):
                view.add(_decl(path, (), value.dtype), (), value)
            elif isinstance(value, (bool, int, float)):
                t = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
                view.add(_decl(path, (), t.dtype, python_type=type(value).__name__), (), t)
            else:
                raise CheckpointError(f"optimizer state {key!r} of {name} is a {type(value).__name__}; "
                                      "only tensors and numbers are stored (no pickle)")
    for held in held_buffers(train_state.model):
        _add_tensor(view, held, mesh)
    rng = {"torch_cpu": torch.get_rng_state()}
    if train_state.device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(train_state.device)
    for key, st in rng.items():
        row = st.reshape(1, -1)
        view.add(_decl(f"/meta/rng/{key}", (mesh.world_size, row.shape[1]), torch.uint8),
                 ((mesh.world_rank, mesh.world_rank + 1), (0, row.shape[1])), row)
    view.add(DatasetDecl("/meta/config", (), f"|S{len(text)}"), (),
             np.array(text, dtype=f"S{len(text)}"))
    cursor = train_state.cursor.state_dict()
    consumed = int(cursor["consumed_samples"])
    view.meta = {"step": int(train_state.step), "consumed_samples": consumed}
    o, total = cfg.optim, int(cfg.trainer.steps)
    view.attrs = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": int(train_state.step),
        "consumed_samples": consumed, "world_size": mesh.world_size, "model": str(cfg.model.name),
        "optimizer": str(o.name),
        "layout": json.dumps({"sizes": dict(mesh.sizes), "order": "-".join(mesh.order), "world_size": mesh.world_size}),
        "scheduler": json.dumps({"name": "warmup_cosine", "next_lr": lr_at(int(train_state.step), o, total),
                                 "lr": float(o.lr), "min_lr_ratio": float(o.min_lr_ratio),
                                 "warmup_steps": int(o.warmup_steps), "total_steps": total}),
        "data_cursor": json.dumps(cursor),  # the core cursor's whole state (a blend's counts too)
        "trainer_state": json.dumps(train_state.extra_state()),  # fp16's loss scale
        "versions": versions_json, "created_unix": time.time(),
    }
    if provenance_json:
        view.attrs[PROVENANCE_ATTR] = provenance_json
    return view


def _add_tensor(view: StateView, held: Held, mesh: Mesh) -> None:
    """Declare ``held``'s logical dataset and add each piece this rank holds
    (a view of the live tensor; padding is never part of a piece)."""
    decl = _decl(held.path, held.spec.global_shape, held.tensor.dtype, splits=splits_json(held.spec))
    pieces = held.pieces(mesh)
    if not pieces:  # holds nothing of it (an empty flat range): still declares it, like every holder
        view.decls.append(decl)
        view.boxes.setdefault(held.path, [])
        view.data.setdefault(held.path, [])
    for piece in pieces:
        view.add(decl, piece.box, piece.take(held.tensor))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (bfloat16 as uint16); no gradient."""
    return t.view(torch.int16).numpy().view("<u2") if t.dtype == torch.bfloat16 else t.numpy()


def host_copy(t: Data, copy: bool = True, buffer: Optional[torch.Tensor] = None,
              non_blocking: bool = False) -> np.ndarray:
    """``t`` in host memory (an async save's staging copy; see ``staging``).

    ``buffer``: a host tensor of the same shape and dtype to copy into
    (reused from the previous save, so its pages are already mapped; on GPU
    it is pinned). ``copy=False``: a contiguous CPU tensor is returned as a
    zero-copy view, for a synchronous save that writes it before training
    can change it. ``non_blocking``: a device-to-host copy is only queued on
    the current CUDA stream; the caller synchronises that stream before
    reading the result.
    """
    if isinstance(t, np.ndarray):
        return t
    src = t.detach()
    if not copy and src.device.type == "cpu" and src.is_contiguous():
        return as_numpy(src)
    if buffer is None:
        buffer = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.device.type == "cuda")
    if src.device.type == "cpu" and src.is_contiguous() and buffer.is_contiguous():
        # host to host: numpy's copy is a plain memcpy, faster than torch's copy_ on
        # one thread (docs/benchmarks.md, "Figures behind code and test choices"), and
        # this copy is what the training step waits for
        np.copyto(as_numpy(buffer), as_numpy(src))
    else:
        buffer.copy_(src, non_blocking=non_blocking and buffer.is_pinned())
    return as_numpy(buffer)


def from_numpy(arr: np.ndarray, dtype_name_: str) -> torch.Tensor:
    dtype = NAME_TO_TORCH.get(dtype_name_)
    if dtype is None:
        raise CheckpointError(f"unknown torch_dtype {dtype_name_!r}")
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.require(arr, requirements="C").view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.require(arr, requirements="C"))
