"""Put a checkpoint back into a ``TrainState`` on its (new) layout.

Every rank asks the reader for exactly its boxes by its own ShardSpecs
(``ShardSpec.pieces``): the pieces of each parameter, persistent buffer and
optimizer state tensor it holds (a state's spec comes from the optimizer's
``state_spec`` when it shards state, else it is the parameter's), the
optimizer's scalar states, its own RNG row when the world size is
unchanged. Boxes that are contiguous host memory of the trainer (every
tensor on CPU under dp, ZeRO and FSDP's dim-0 splits) are read straight into
it and verified as they are read (``CheckpointReader.read``), the others
into host buffers and copied after verification: a load does one pass over
the bytes. A file that fails verification may therefore leave some of the
trainer's tensors overwritten: the load raises ``CheckpointError``, with
``resume=auto`` the next older checkpoint (of the same model: every tensor
read again) is loaded over them, and otherwise the run stops. The model
check, the batch-size check and the cursor come before any tensor is read.

Where state goes: into the existing tensor when there is one (in place: its
device and dtype are kept, so state an optimizer keeps on the host stays
there); a state tensor the optimizer has not created yet (torch's AdamW
creates its state at the first step) is made on the parameter's device.
Positions a rank holds no piece for (padding of a padded split) are set to zero. Scalar optimizer states
(Adam's ``step``) go back as CPU tensors, as torch keeps them.

Two refusals come before any tensor of the trainer changes, on every rank
alike, as a ConfigError (status 2), never as a CheckpointError:

- A checkpoint whose tensors do not fit this model (other shapes, tensors
  it lacks) was saved by another model configuration. Before any tensor is
  read, the message names the checkpoint, the model settings that differ
  (from its ``/meta/config``), at most three tensors and a count of the
  rest, and the fix. It is not a damaged file, so ``resume=auto`` does not
  fall back to an older checkpoint: every checkpoint of one directory was
  written by the same experiment and has the same shapes, and trying each
  would only repeat the message per file.
- A checkpoint saved with another ``trainer.global_batch_size``: the plugin only supplies the saved value (the saved
  cursor state holds it; files from before it did: ``/meta/config``); the rule (refuse unless
  ``checkpoint.allow_batch_change``, else log how the sample stream
  continues) is the core cursor's ``load_state_dict``, so every checkpoint
  format gets it.
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, cast

import numpy as np
import torch
from omegaconf import OmegaConf

from hpctrain.boxes import box_shape
from hpctrain.checkpoint import Restored
from hpctrain.errors import ConfigError
from hpctrain.log import get_logger, log_rank0
from hpctrain.provenance import ATTR as PROVENANCE_ATTR
from hpctrain.provenance import parse as parse_provenance
from hpctrain.shard import Piece

from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.layout import Box
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.snapshot import (
    NAME_TO_TORCH,
    Held,
    as_numpy,
    from_numpy,
    held_buffers,
    held_params,
    optimizer_state,
    state_spec,
)

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState


log = get_logger(__name__)


def _optim_paths(index: Dict[str, Any]) -> Dict[str, List[Tuple[str, str]]]:
    """logical name -> [(state key, dataset path)] from ``/optim/<key>/<name>``."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for path in sorted(index):
        parts = path.split("/", 3)
        if len(parts) == 4 and parts[1] == "optim":
            out.setdefault(parts[3], []).append((parts[2], path))
    return out


def _rng_wants(train_state: "TrainState", reader: CheckpointReader) -> Dict[str, List[Box]]:
    mesh, saved = train_state.mesh, reader.meta.get("world_size")
    if saved != mesh.world_size:
        log_rank0("RNG states not restored: saved by %s ranks, loading on %d (no rank mapping exists; "
                  "training draws no random numbers today, so losses are unaffected)", saved, mesh.world_size)
        return {}
    keys = ["torch_cpu"] + (["torch_cuda"] if train_state.device.type == "cuda" else [])
    out: Dict[str, List[Box]] = {}
    for key in keys:
        path = f"/meta/rng/{key}"
        if path in reader.index:
            out[path] = [((mesh.world_rank, mesh.world_rank + 1), (0, reader.index[path].shape[1]))]
    return out


def _check_schedule(train_state: "TrainState", reader: CheckpointReader) -> None:
    try:
        saved = json.loads(reader.meta.get("scheduler", "{}"))
    except ValueError:
        return
    o = train_state.cfg.optim
    now = {"lr": float(o.lr), "min_lr_ratio": float(o.min_lr_ratio), "warmup_steps": int(o.warmup_steps),
           "total_steps": int(train_state.cfg.trainer.steps)}
    changed = {k: (saved.get(k), v) for k, v in now.items() if k in saved and saved[k] != v}
    if changed:
        log_rank0("the LR schedule differs from the checkpoint's (%s); the LR follows this run's config from step %s",
                  ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()), reader.meta.get("step"))


def load_into(train_state: "TrainState", reader: CheckpointReader) -> Restored:
    """Read this rank's share of ``reader`` (verified), then restore ``train_state`` in place (all but its
    step, which the caller sets from the answer)."""
    index, meta, mesh = reader.index, reader.meta, train_state.mesh
    params = held_params(train_state)
    buffers = held_buffers(train_state.model)
    optim = _optim_paths(index)
    state = optimizer_state(train_state)
    wants: Dict[str, List[Box]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    targets: List[Tuple[Held, List[Piece]]] = []  # (held tensor or state to create, its pieces)

    def want(held: Held) -> None:
        pieces = held.pieces(mesh)
        wants[held.path], shapes[held.path] = [p.box for p in pieces], tuple(held.spec.global_shape)
        targets.append((held, pieces))

    for p, held in params:
        want(held)
        for key, path in optim.get(held.spec.logical_name, []):
            if not index[path].shape:
                wants[path] = [()]
                continue
            existing = state.get(p, {}).get(key)
            spec = state_spec(train_state, p, key, tuple(existing.shape) if existing is not None else tuple(p.shape))
            tensor = existing if isinstance(existing, torch.Tensor) else torch.zeros(
                spec.local_shape(mesh.coords, mesh.sizes), dtype=_stored_dtype(index[path]), device=p.device)
            want(Held(path, tensor, spec))
    missing_buffers = [b.path for b in buffers if b.path not in index]
    for held in buffers:
        if held.path in index:
            want(held)
    wants.update(_rng_wants(train_state, reader))
    refuse = getattr(train_state.optimizer, "checkpoint_problem", None)  # e.g. DiLoCo saved with other replicas
    problem = refuse({path: tuple(info.shape) for path, info in reader.index.items()}) if callable(refuse) else None
    if problem:  # the index is the same on every rank: every rank raises
        raise ConfigError(f"checkpoint {reader.path}: {problem}")
    _refuse_another_model(train_state, reader, shapes)
    saved_optimizer = meta.get("optimizer")
    if saved_optimizer is None:  # files before the attribute: from the config (parsed for them only)
        saved_optimizer = _select(_saved_config(reader), "optim.name")
    cursor_state = json.loads(meta["data_cursor"]) if "data_cursor" in meta else {}  # older files: no blend state
    cursor_state["consumed_samples"] = int(meta["consumed_samples"])
    if "global_batch_size" not in cursor_state:  # files before the cursor saved it: from the config
        saved_batch = _select(_saved_config(reader), "train_state.global_batch_size")
        if saved_batch is not None:
            cursor_state["global_batch_size"] = int(saved_batch)
    try:  # before any tensor changes: a refused batch size leaves the trainer as it was
        train_state.cursor.load_state_dict(cursor_state)
    except ConfigError as e:
        raise ConfigError(f"checkpoint {reader.path}: {e}") from None
    data = reader.read(wants, shapes, finite=("/model/", "/optim/"), into=_destinations(targets))
    _refuse_nonfinite(reader)

    held_names = set().union(*reader.comm.allgather({h.spec.logical_name for _, h in params}))
    unused = sorted(p for p in index if p.startswith("/model/") and p[len("/model/"):] not in held_names)
    if unused:
        log_rank0("checkpoint %s has %d tensors this model does not (%s%s); they are ignored", reader.path,
                  len(unused), ", ".join(unused[:3]), ", ..." if len(unused) > 3 else "")
    if missing_buffers:
        log_rank0("checkpoint %s has no %s; they keep their initial values", reader.path, ", ".join(missing_buffers))
    _check_schedule(train_state, reader)

    filled = {held.path: held.tensor for held, _ in targets}
    with torch.no_grad():
        for held, pieces in targets:
            dtype_name_ = index[held.path].attrs.get("torch_dtype", "")
            if sum(math.prod(box_shape(p.box)) for p in pieces) < held.tensor.numel():
                held.tensor.zero_()  # padding (or nothing held): zeros, as after materialize
            for piece, arr in zip(pieces, data.get(held.path, [])):
                dst = piece.take(held.tensor)
                if arr.ctypes.data == dst.data_ptr():
                    continue  # read in place (``_destinations``)
                _copy_in(dst, from_numpy(arr, dtype_name_).view(box_shape(piece.box)))
        for p, held in params:
            restored: Dict[str, Any] = {}
            for key, opath in optim.get(held.spec.logical_name, []):
                info = index[opath]
                kind = info.attrs.get("python_type")
                if info.shape:
                    restored[key] = filled[opath]
                    continue
                t = from_numpy(data[opath][0], info.attrs.get("torch_dtype", ""))
                if kind in ("float", "int", "bool"):
                    restored[key] = {"float": float, "int": int, "bool": bool}[kind](t.item())
                else:
                    restored[key] = t.clone()
            state.pop(p, None)
            if restored:
                state[p] = restored
    # older files have no extra state: the loop's objects keep their fresh state
    train_state.load_extra_state(json.loads(meta["trainer_state"]) if "trainer_state" in meta else {})
    if "/meta/rng/torch_cpu" in data:
        torch.set_rng_state(from_numpy(data["/meta/rng/torch_cpu"][0].reshape(-1), "uint8").clone())
    if "/meta/rng/torch_cuda" in data:
        cuda_state = from_numpy(data["/meta/rng/torch_cuda"][0].reshape(-1), "uint8").clone()
        torch.cuda.set_rng_state(cuda_state, train_state.device)
    step = int(meta["step"])
    log_rank0("loaded %s: step %d, %d samples consumed; saved on %s, loaded on %s", reader.path, step,
              train_state.cursor.consumed_samples, _layout_str(meta.get("layout")), train_state.mesh.describe())
    return Restored(reader.path, step, None if saved_optimizer is None else str(saved_optimizer),
                    parse_provenance(meta.get(PROVENANCE_ATTR)))


def _destinations(targets: List[Tuple[Held, List[Piece]]]) -> Dict[str, List[Any]]:
    """Where the reader may read each box straight into the train_state: the
    piece's own memory when it is a contiguous host view (the reader checks
    dtype and shape, and falls back to its own buffer otherwise). Tensors
    with padding (not covered by their pieces) are zeroed first and read
    through the reader's buffer."""
    into: Dict[str, List[Any]] = {}
    for held, pieces in targets:
        t = held.tensor.detach()
        if t.device.type != "cpu" or sum(math.prod(box_shape(p.box)) for p in pieces) < t.numel():
            continue
        views = [p.take(t) for p in pieces]
        into[held.path] = [as_numpy(v) if v.is_contiguous() else None for v in views]
    return into


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``; host to host through numpy, a plain memcpy that is
    faster than torch's ``copy_`` on one thread (docs/benchmarks.md, "Figures
    behind code and test choices", host copies)."""
    if dst.device.type == "cpu" and dst.dtype == src.dtype:
        np.copyto(as_numpy(dst.detach()), as_numpy(src))
    else:
        dst.copy_(src)


def _saved_config(reader: CheckpointReader) -> Any:
    """The config that saved the checkpoint (``/meta/config``), or None when
    it is absent or unreadable (then nothing is compared with it). Rank 0
    reads it and broadcasts it: every rank decides on the same text. It is
    verified with every other dataset by ``reader.read``. Collective: called
    by every rank alike, and only where needed (parsing the YAML costs a
    sizeable part of a load)."""
    text = None
    if reader.comm.Get_rank() == 0 and "/meta/config" in reader.index:
        try:
            raw = reader.opened["meta/config"][()]
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        except Exception:  # noqa: BLE001 - unreadable: reader.read names it
            text = None
    text = reader.comm.bcast(text, root=0)
    if not text:
        return None
    try:
        return OmegaConf.create(text)
    except Exception:  # noqa: BLE001 - damaged text: reader.read's checksum names it
        return None


def _select(cfg: Any, key: str) -> Any:
    if cfg is None:
        return None

    return OmegaConf.select(cfg, key, default=None)


MAX_TENSORS_SHOWN = 3
"""Tensors named one per line when a checkpoint does not fit the model; the rest are counted."""


def _refuse_another_model(train_state: "TrainState", reader: CheckpointReader,
                          shapes: Dict[str, Tuple[int, ...]]) -> None:
    """A ConfigError on every rank when the checkpoint's tensors do not fit
    this model (see the module docstring); agreed over the ranks, since under
    pipeline parallelism each rank holds other tensors."""
    mine = {}
    for path, shape in shapes.items():
        info = reader.index.get(path)
        if info is None or tuple(info.shape) != tuple(shape):
            mine[path] = (None if info is None else tuple(info.shape), tuple(shape))
    everyone: Dict[str, Tuple[Any, Tuple[int, ...]]] = {}
    for found in reader.comm.allgather(mine):
        everyone.update(found)
    if not everyone:
        return
    by_tensor: Dict[str, Tuple[str, Any, Tuple[int, ...]]] = {}  # logical name -> its first dataset
    for path in sorted(everyone, key=lambda p: (not p.startswith("/model/"), p)):
        name = path[len("/model/"):] if path.startswith("/model/") else path.split("/", 3)[-1]
        by_tensor.setdefault(name, (path,) + everyone[path])
    rows = [f"  {path}: " + (f"{_shape(saved)} in the checkpoint, {_shape(wanted)} in this model" if saved is not None
                             else f"not in the checkpoint (this model's is {_shape(wanted)})")
            for path, saved, wanted in list(by_tensor.values())[:MAX_TENSORS_SHOWN]]
    rest = len(by_tensor) - len(rows)
    if rest:
        rows.append(f"  and {rest} more tensor{'s' if rest > 1 else ''} differ")
    differ = _model_differences(_saved_config(reader), train_state.cfg)
    cause = (f"the model config differs from the one that saved it ({differ})" if differ else
             "the model config differs from the one that saved it")
    resume = str(train_state.cfg.checkpoint.resume)
    fix = (f"resume with the model settings it was saved with (hpctrain-ckpt inspect {reader.path} --config "
           "shows them), or start this model afresh in another checkpoint.dir")
    if resume == "auto" or os.path.isdir(resume):
        fix += (f"; checkpoint.resume={resume} tries no older checkpoint of its directory: a checkpoint that "
                "does not fit is not damaged, and the others there were saved by the same model")
    raise ConfigError("\n".join([f"checkpoint {reader.path} does not fit this model: {len(by_tensor)} "
                                  f"tensor{'s' if len(by_tensor) > 1 else ''} differ; {cause}"] + rows + [fix]))


def _shape(shape: Tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _model_differences(saved_cfg: Any, cfg: Any, limit: int = 4) -> str:
    """``model.d_model=64 there, 32 here, ...`` from the saved config; '' if unknown."""
    saved = _select(saved_cfg, "model")
    if saved is None:
        return ""

    # (casts: OmegaConf types to_container for any node; model sections are mappings)
    then = cast(Dict[str, Any], OmegaConf.to_container(saved, resolve=True)) if OmegaConf.is_config(saved) else {}
    now = cast(Dict[str, Any], OmegaConf.to_container(cfg.model, resolve=True))
    keys = [k for k in now if k in then and then[k] != now[k] and k != "name"]
    shown = [f"model.{k}={then[k]!r} there, {now[k]!r} here" for k in keys[:limit]]
    return ", ".join(shown) + (f", and {len(keys) - limit} more" if len(keys) > limit else "")


def _refuse_nonfinite(reader: CheckpointReader) -> None:
    """A checkpoint holding NaN or infinite weights or optimizer state is
    unusable (resume=auto then falls back to an older one): agreed over the
    ranks before anything of the trainer is touched. The reader checked each
    block of ``/model`` and ``/optim`` as it read it."""
    everyone = sorted(set().union(*reader.comm.allgather(reader.nonfinite)))
    if everyone:
        raise CheckpointError(f"{reader.path}: non-finite values (NaN or inf) in {len(everyone)} tensor(s): "
                              + ", ".join(everyone[:5]) + (", ..." if len(everyone) > 5 else ""))


def _stored_dtype(info: Any) -> torch.dtype:
    return NAME_TO_TORCH.get(info.attrs.get("torch_dtype", ""), torch.float32)


def _layout_str(layout: Any) -> str:
    try:
        d = json.loads(layout)
        ranks = f"{d['world_size']} rank{'s' if d['world_size'] != 1 else ''}"
        return " * ".join(f"{a}={d['sizes'][a]}" for a in d["order"].split("-")) + f" ({ranks})"
    except (TypeError, ValueError, KeyError):
        return "an unknown layout"
