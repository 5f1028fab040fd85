"""Put a checkpoint back into a trainer on the trainer's (new) layout.

Every rank asks the reader for exactly its boxes by its own ShardSpecs
(``ShardSpec.pieces``): the pieces of each parameter, persistent buffer and
optimizer state tensor it holds (a state's spec comes from the optimizer's
``state_spec`` when it shards state, else it is the parameter's), the
optimizer's scalar states, its own RNG row when the world size is
unchanged. Everything is read and verified into host buffers first and only
then copied into the model and optimizer, so a corrupt file leaves the
trainer untouched and ``resume=auto`` can fall back to an older checkpoint.

Where state goes: into the existing tensor when there is one (in place: its
device and dtype are kept, so state an optimizer keeps on the host stays
there); a state tensor the optimizer has not created yet (torch's AdamW
creates its state at the first step) is made on the parameter's device.
Positions a rank holds no piece for (padding of a padded split) are set to zero. Scalar optimizer states
(Adam's ``step``) go back as CPU tensors, as torch keeps them.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Tuple

import torch

from hpctrain.boxes import box_shape
from hpctrain.log import get_logger, log_rank0
from hpctrain.shard import Piece

from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.layout import Box
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.snapshot import (NAME_TO_TORCH, Held, from_numpy, held_buffers, held_params, optimizer_state,
                                      state_spec)

log = get_logger(__name__)


def _optim_paths(index: Dict[str, Any]) -> Dict[str, List[Tuple[str, str]]]:
    """logical name -> [(state key, dataset path)] from ``/optim/<key>/<name>``."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for path in sorted(index):
        parts = path.split("/", 3)
        if len(parts) == 4 and parts[1] == "optim":
            out.setdefault(parts[3], []).append((parts[2], path))
    return out


def _rng_wants(trainer: Any, reader: CheckpointReader) -> Dict[str, List[Box]]:
    mesh, saved = trainer.mesh, reader.meta.get("world_size")
    if saved != mesh.world_size:
        log_rank0("RNG states not restored: saved by %s ranks, loading on %d (no rank mapping exists; "
                  "training draws no random numbers today, so losses are unaffected)", saved, mesh.world_size)
        return {}
    keys = ["torch_cpu"] + (["torch_cuda"] if trainer.device.type == "cuda" else [])
    out = {}
    for key in keys:
        path = f"/meta/rng/{key}"
        if path in reader.index:
            out[path] = [((mesh.world_rank, mesh.world_rank + 1), (0, reader.index[path].shape[1]))]
    return out


def _check_schedule(trainer: Any, reader: CheckpointReader) -> None:
    try:
        saved = json.loads(reader.meta.get("scheduler", "{}"))
    except ValueError:
        return
    o = trainer.cfg.optim
    now = {"lr": float(o.lr), "min_lr_ratio": float(o.min_lr_ratio), "warmup_steps": int(o.warmup_steps),
           "total_steps": int(trainer.cfg.trainer.steps)}
    changed = {k: (saved.get(k), v) for k, v in now.items() if k in saved and saved[k] != v}
    if changed:
        log_rank0("the LR schedule differs from the checkpoint's (%s); the LR follows this run's config from step %s",
                  ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()), reader.meta.get("step"))


def load_into(trainer: Any, reader: CheckpointReader) -> None:
    """Read this rank's share of ``reader`` (verified), then restore ``trainer``."""
    index, meta, mesh = reader.index, reader.meta, trainer.mesh
    params = held_params(trainer)
    buffers = held_buffers(trainer.model)
    optim = _optim_paths(index)
    state = optimizer_state(trainer)
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
            spec = state_spec(trainer, p, key, tuple(existing.shape) if existing is not None else tuple(p.shape))
            tensor = existing if isinstance(existing, torch.Tensor) else torch.zeros(
                spec.local_shape(mesh.coords, mesh.sizes), dtype=_stored_dtype(index[path]), device=p.device)
            want(Held(path, tensor, spec))
    missing_buffers = [b.path for b in buffers if b.path not in index]
    for held in buffers:
        if held.path in index:
            want(held)
    wants.update(_rng_wants(trainer, reader))
    data = reader.read(wants, shapes)
    _refuse_nonfinite(reader, index, data)

    held_names = set().union(*reader.comm.allgather({h.spec.logical_name for _, h in params}))
    unused = sorted(p for p in index if p.startswith("/model/") and p[len("/model/"):] not in held_names)
    if unused:
        log_rank0("checkpoint %s has %d tensors this model does not (%s%s); they are ignored", reader.path,
                  len(unused), ", ".join(unused[:3]), ", ..." if len(unused) > 3 else "")
    if missing_buffers:
        log_rank0("checkpoint %s has no %s; they keep their initial values", reader.path, ", ".join(missing_buffers))
    _check_schedule(trainer, reader)

    filled = {held.path: held.tensor for held, _ in targets}
    with torch.no_grad():
        for held, pieces in targets:
            dtype_name_ = index[held.path].attrs.get("torch_dtype", "")
            if sum(math.prod(box_shape(p.box)) for p in pieces) < held.tensor.numel():
                held.tensor.zero_()  # padding (or nothing held): zeros, as after materialize
            for piece, arr in zip(pieces, data.get(held.path, [])):
                piece.take(held.tensor).copy_(from_numpy(arr, dtype_name_).view(box_shape(piece.box)))
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
    trainer.step = int(meta["step"])
    trainer.cursor.load_state_dict({"consumed_samples": int(meta["consumed_samples"])})
    if "/meta/rng/torch_cpu" in data:
        torch.set_rng_state(from_numpy(data["/meta/rng/torch_cpu"][0].reshape(-1), "uint8").clone())
    if "/meta/rng/torch_cuda" in data:
        torch.cuda.set_rng_state(from_numpy(data["/meta/rng/torch_cuda"][0].reshape(-1), "uint8").clone(), trainer.device)
    log_rank0("loaded %s: step %d, %d samples consumed; saved on %s, loaded on %s", reader.path, trainer.step,
              trainer.cursor.consumed_samples, _layout_str(meta.get("layout")), trainer.mesh.describe())


def _refuse_nonfinite(reader: CheckpointReader, index: Any, data: Dict[str, Any]) -> None:
    """A checkpoint holding NaN or infinite weights or optimizer state is
    unusable (resume=auto then falls back to an older one): agreed over the
    ranks before anything of the trainer is touched."""
    bad = []
    for path, arrays in data.items():
        if not path.startswith(("/model/", "/optim/")) or path not in index:
            continue
        dtype = index[path].attrs.get("torch_dtype", "")
        for arr in arrays:
            t = from_numpy(arr, dtype)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(path)
                break
    everyone = sorted(set().union(*reader.comm.allgather(set(bad))))
    if everyone:
        raise CheckpointError(f"{reader.path}: non-finite values (NaN or inf) in {len(everyone)} tensor(s): "
                              + ", ".join(everyone[:5]) + (", ..." if len(everyone) > 5 else ""))


def _stored_dtype(info: Any) -> torch.dtype:
    return NAME_TO_TORCH.get(info.attrs.get("torch_dtype", ""), torch.float32)


def _layout_str(layout: Any) -> str:
    try:
        d = json.loads(layout)
        return " * ".join(f"{a}={d['sizes'][a]}" for a in d["order"].split("-")) + f" ({d['world_size']} ranks)"
    except (TypeError, ValueError, KeyError):
        return "an unknown layout"
