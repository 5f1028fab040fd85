"""Put a checkpoint back into a trainer on the trainer's (new) layout.

Every rank asks the reader for exactly its boxes by its own ShardSpecs: its
slice of each parameter and of each parameter-shaped optimizer state, the
optimizer's scalar states, its own RNG row when the world size is
unchanged. Everything is read and verified into host buffers first and only
then copied into the model and optimizer, so a corrupt file leaves the
trainer untouched and ``resume=auto`` can fall back to an older checkpoint.
Scalar optimizer states (Adam's ``step``) go back as CPU tensors, as torch
keeps them; parameter-shaped states go to the parameter's device.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import torch

from hpctrain.log import get_logger, log_rank0
from hpctrain.shard import get_spec

from hpctrain_h5ckpt.layout import Box
from hpctrain_h5ckpt.reader import CheckpointReader
from hpctrain_h5ckpt.snapshot import optimizer_state, param_boxes, from_numpy

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
    index, meta = reader.index, reader.meta
    params = param_boxes(trainer)
    optim = _optim_paths(index)
    wants: Dict[str, List[Box]] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for name, p, box in params:
        shape = tuple(get_spec(p).global_shape)
        wants[f"/model/{name}"], shapes[f"/model/{name}"] = [box], shape
        for _, path in optim.get(name, []):
            if index[path].shape:
                wants[path], shapes[path] = [box], shape
            else:
                wants[path] = [()]
    wants.update(_rng_wants(trainer, reader))
    data = reader.read(wants, shapes)

    held = set().union(*reader.comm.allgather({n for n, _, _ in params}))
    unused = sorted(p for p in index if p.startswith("/model/") and p[len("/model/"):] not in held)
    if unused:
        log_rank0("checkpoint %s has %d tensors this model does not (%s%s); they are ignored", reader.path,
                  len(unused), ", ".join(unused[:3]), ", ..." if len(unused) > 3 else "")
    _check_schedule(trainer, reader)

    state = optimizer_state(trainer)
    with torch.no_grad():
        for name, p, _ in params:
            path = f"/model/{name}"
            p.copy_(from_numpy(data[path][0], index[path].attrs.get("torch_dtype", "")).view(p.shape))
            restored: Dict[str, Any] = {}
            for key, opath in optim.get(name, []):
                info = index[opath]
                t = from_numpy(data[opath][0], info.attrs.get("torch_dtype", ""))
                kind = info.attrs.get("python_type")
                if kind in ("float", "int", "bool"):
                    restored[key] = {"float": float, "int": int, "bool": bool}[kind](t.item())
                elif info.shape:  # the staging buffer becomes the state on CPU (no copy)
                    restored[key] = t.view(p.shape).to(p.device)
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


def _layout_str(layout: Any) -> str:
    try:
        d = json.loads(layout)
        return " * ".join(f"{a}={d['sizes'][a]}" for a in d["order"].split("-")) + f" ({d['world_size']} ranks)"
    except (TypeError, ValueError, KeyError):
        return "an unknown layout"
