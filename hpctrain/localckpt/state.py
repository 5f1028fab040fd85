"""One rank's exact state as the local tier keeps it, and its file format.

``capture`` copies to host memory what this rank holds, exactly as it holds
it (its shards; nothing is gathered or resharded): every parameter and
persistent buffer, every optimizer state tensor (through the optimizer's
``state`` mapping keyed by parameter, as ``hpctrain.checkpoint`` describes,
so ZeRO's flat shards and DiLoCo's replica state come along), the RNG
states, the data cursor, the step and the trainer's ``extra_state``. Tensors
are named by their position (``p<i>``: the i-th distinct parameter of
``model.named_parameters()``), which the same layout reproduces exactly; the
``signature`` (layout and experiment) guards against any other layout.

What a tensor is follows the state contract the persistent checkpoint reads
(``hpctrain.checkpoint``): a parameter's ShardSpec, and for optimizer state
``optimizer.state_spec(param, key)`` where the optimizer gives one (ZeRO's
flat shards, DiLoCo's replica rows), else the parameter's. The local tier
puts a rank's tensors back as they are, so for the same layout it needs no
spec; for a tensor split over ``dp`` (ZeRO's shards) ``capture`` also
records its pieces (``ShardSpec.pieces``: boxes of the logical tensor), so
that a run with another data-parallel size (``trainer.elastic``) assembles
its own shards from the old ranks' files (``restore`` with ``shards``).

``encode``/``decode``: one flat byte string, no pickle: the magic line, an
8-byte little-endian header length, a JSON header (meta, and per tensor its
name, dtype, shape, offset and length), then the raw tensor bytes and a
CRC-32 of everything before it. The same bytes go to the node-local file and
over MPI to the partners.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from hpctrain.boxes import Box, intersect
from hpctrain.checkpoint import EXPERIMENT_KEYS
from hpctrain.shard import Piece, ShardSpec

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState

MAGIC = b"HPCTRAIN-LOCAL 1\n"

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}


class LocalStateError(Exception):
    """A local-tier file that cannot be used (damaged, or another layout's)."""


@dataclass
class RankState:
    """Host copies of one rank's state, ready to encode."""

    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)


def layout(mesh: Any) -> Dict[str, Any]:
    """The mesh a state was written by: world size, axis sizes, rank order."""
    return {"world_size": mesh.world_size, "sizes": dict(mesh.sizes), "order": "-".join(mesh.order)}


def _digest(train_state: "TrainState", without_dp: bool) -> str:
    cfg, mesh = train_state.cfg, train_state.mesh
    chosen: Dict[str, Any] = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                              for k in EXPERIMENT_KEYS for v in [OmegaConf.select(cfg, k)]}
    placed, parallel = layout(mesh), dict(OmegaConf.to_container(cfg.parallel, resolve=True))  # type: ignore[arg-type]
    if without_dp:
        placed = {"sizes": {a: n for a, n in placed["sizes"].items() if a != "dp"}, "order": placed["order"]}
        parallel.pop("dp")
    chosen["layout"], chosen["parallel"] = placed, parallel
    return hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:16]


def signature(train_state: "TrainState") -> str:
    """What must match for a rank's saved state to be put back as it is: the
    world size, the mesh (sizes and order), the model, optimizer, batch,
    sequence, seed and precision (``hpctrain.checkpoint.EXPERIMENT_KEYS``)."""
    return _digest(train_state, without_dp=False)


def family(train_state: "TrainState") -> str:
    """``signature`` less the data-parallel size and the world size: what must match for another data-parallel
    replica's state to be put back on this rank (``trainer.elastic``, ``hpctrain.localckpt.reshard``)."""
    return _digest(train_state, without_dp=True)


def _params(train_state: "TrainState") -> List[torch.nn.Parameter]:
    out, seen = [], set()
    for _, p in train_state.model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _buffers(model: torch.nn.Module) -> List[torch.Tensor]:
    out, seen = [], set()
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append(buf)
    return out


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy (the caller keeps training; the copy must not alias)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _spec(train_state: "TrainState", p: torch.nn.Parameter, key: Optional[str]) -> Optional[ShardSpec]:
    """The ShardSpec of parameter ``p`` (``key`` None) or of its optimizer state ``key``, by the contract of
    ``hpctrain.checkpoint``: the optimizer's ``state_spec`` where it gives one, else the parameter's. None: the
    parameter has no spec, or a sharding optimizer holds none of it here."""
    given = getattr(train_state.optimizer, "state_spec", None) if key is not None else None
    if callable(given):
        spec = given(p, key)
        if spec is not None:
            return spec
        if getattr(train_state.optimizer, "spec_of", None) is not None:  # ZeRO: this rank holds none of ``p``
            return None
    return getattr(p, "hpctrain_spec", None)


def _dp_pieces(spec: Optional[ShardSpec], t: torch.Tensor, mesh: Any) -> Optional[List[Any]]:
    """``t``'s pieces (JSON: box, local box, flat) when its spec splits it over dp; else None."""
    if spec is None or t.dim() == 0 or mesh.size("dp") == 1 or "dp" not in spec.split_axes:
        return None
    return [[list(map(list, pc.box)), list(map(list, pc.local_box)),
             [pc.flat[0], pc.flat[1], list(pc.flat[2])] if pc.flat is not None else None]
            for pc in spec.pieces(mesh.coords, mesh.sizes)]


def capture(train_state: "TrainState") -> RankState:
    """This rank's state now, copied to host memory."""
    out = capture_meta(train_state)
    capture_tensors(train_state, out)
    return out


def capture_meta(train_state: "TrainState") -> RankState:
    """What the next step changes before its optimizer step (random state, data cursor, step), now; the
    tensors follow with ``capture_tensors``, which may run during that step's forward and backward."""
    out = RankState()
    out.tensors["rng/cpu"] = torch.get_rng_state()
    if train_state.device.type == "cuda":
        out.tensors["rng/cuda"] = torch.cuda.get_rng_state(train_state.device)
    out.meta = {"step": int(train_state.step), "cursor": train_state.cursor.state_dict(),
                "extra": train_state.extra_state(), "scalars": {}, "on_cpu": [],
                "rank": train_state.mesh.world_rank, "signature": signature(train_state), "family": family(train_state),
                "layout": layout(train_state.mesh)}
    return out


def capture_tensors(train_state: "TrainState", out: RankState) -> None:
    """Host copies of the parameters, optimizer state and buffers into ``out``: nothing changes them
    until the optimizer step, so this may overlap the next forward and backward."""
    scalars: Dict[str, Any] = out.meta["scalars"]
    on_cpu: List[str] = out.meta["on_cpu"]
    pieces: Dict[str, Any] = {}
    mesh = train_state.mesh
    state = train_state.optimizer.state
    for i, p in enumerate(_params(train_state)):
        out.tensors[f"p{i}"] = _host(p)
        if (held := _dp_pieces(_spec(train_state, p, None), p, mesh)) is not None:
            pieces[f"p{i}"] = held
        for key, value in state.get(p, {}).items():
            name = f"o{i}/{key}"
            if isinstance(value, torch.Tensor):
                out.tensors[name] = _host(value)
                if (held := _dp_pieces(_spec(train_state, p, key), value, mesh)) is not None:
                    pieces[name] = held
                if value.device.type == "cpu" and p.device.type != "cpu":
                    on_cpu.append(name)
            elif isinstance(value, (bool, int, float)):
                scalars[name] = value
            else:
                raise LocalStateError(f"optimizer state {key!r} is a {type(value).__name__}; the local tier "
                                      "keeps tensors and numbers only")
    for i, b in enumerate(_buffers(train_state.model)):
        out.tensors[f"b{i}"] = _host(b)
    out.meta["pieces"] = pieces
    out.meta["dp_split"] = bool(pieces)


def _piece(saved: Any) -> Piece:
    box, local_box, flat = saved
    return Piece(tuple((int(a), int(b)) for a, b in box), tuple((int(a), int(b)) for a, b in local_box),
                 (int(flat[0]), int(flat[1]), tuple(int(n) for n in flat[2])) if flat is not None else None)


def _within(inner: Box, outer: Box) -> Tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def assemble(name: str, spec: ShardSpec, mesh: Any, sources: List[RankState]) -> torch.Tensor:
    """This rank's local tensor of ``name`` under ``spec`` on ``mesh``, cut from the pieces the ``sources``
    (the old data-parallel ranks' states) recorded; LocalStateError when they do not cover it."""
    have = [(s.tensors[name], [_piece(x) for x in s.meta["pieces"][name]]) for s in sources
            if name in s.tensors and name in s.meta.get("pieces", {})]
    if not have:
        raise LocalStateError(f"{name} ({spec.logical_name}): no saved pieces")
    shape = spec.local_shape(mesh.coords, mesh.sizes)
    out = torch.zeros(shape, dtype=have[0][0].dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for piece in spec.pieces(mesh.coords, mesh.sizes):
        dst, cov = piece.take(out), piece.take(covered)
        for t, old in have:
            for o in old:
                common = intersect(piece.box, o.box)
                if common is not None:
                    dst[_within(common, piece.box)] = o.take(t)[_within(common, o.box)]
                    cov[_within(common, piece.box)] = True
        if not bool(cov.all()):
            raise LocalStateError(f"{spec.logical_name}: the saved shards do not cover this rank's")
    return out


def restore(train_state: "TrainState", saved: RankState, replica: bool = False,
            shards: Optional[List[RankState]] = None) -> int:
    """Put ``saved`` back into ``train_state``, all but its step, which is returned: this rank's own state,
    same layout; with ``replica``, the state of a rank of another data-parallel size with this rank's other
    coordinates (``family`` must match); with ``shards`` too (``saved`` among them), the states of every old
    data-parallel rank with this rank's other coordinates, from whose recorded pieces the tensors split over
    dp (ZeRO's shards) are assembled for this rank (``assemble``)."""
    meta, tensors = saved.meta, saved.tensors
    params = _params(train_state)
    buffers = _buffers(train_state.model)
    missing = [f"p{i}" for i in range(len(params)) if f"p{i}" not in tensors]
    matches = meta.get("family") == family(train_state) if replica else meta.get("signature") == signature(train_state)
    if missing or not matches or any(s.meta.get("family") != meta.get("family") for s in shards or ()):
        raise LocalStateError("written by another layout or experiment")
    sources = [saved, *(s for s in shards or () if s is not saved)]
    # split over dp where any old rank recorded pieces (a rank holding none of a parameter keeps no state for it)
    split = {name for s in sources for name in s.meta.get("pieces", {})} if shards else set()
    mesh = train_state.mesh
    train_state.cursor.load_state_dict(meta["cursor"])
    state = train_state.optimizer.state
    scalars: Dict[str, Any] = {}
    on_cpu: set = set()
    merged: Dict[str, torch.Tensor] = {}  # the first source's tensor of each name (state a rank may not hold)
    for s in sources:
        for name, value in s.meta["scalars"].items():
            scalars.setdefault(name, value)
        on_cpu.update(s.meta["on_cpu"])
        for name, t in s.tensors.items():
            merged.setdefault(name, t)
    tensors = merged if shards else tensors
    with torch.no_grad():
        for i, p in enumerate(params):
            if f"p{i}" in split:
                spec = _spec(train_state, p, None)
                assert spec is not None
                p.copy_(assemble(f"p{i}", spec, mesh, sources))
            else:
                p.copy_(tensors[f"p{i}"])
            prefix = f"o{i}/"
            restored: Dict[str, Any] = {}
            existing = state.get(p, {})
            for name, t in tensors.items():
                if not name.startswith(prefix):
                    continue
                key = name[len(prefix):]
                if name in split:
                    spec = _spec(train_state, p, key)
                    if spec is None:  # a sharding optimizer holds none of this parameter here
                        continue
                    t = assemble(name, spec, mesh, sources)
                now = existing.get(key)
                if isinstance(now, torch.Tensor) and now.shape == t.shape and now.dtype == t.dtype:
                    now.copy_(t)  # in place: state an optimizer keeps elsewhere (offloaded) stays there
                    restored[key] = now
                else:
                    # torch keeps scalar state (Adam's step) on the host
                    host = t.dim() == 0 or name in on_cpu
                    restored[key] = t.clone() if host else t.to(p.device)
            for name, value in scalars.items():
                if name.startswith(prefix):
                    restored[name[len(prefix):]] = value
            if restored:
                state[p] = restored
            elif p in state:
                del state[p]
        for i, b in enumerate(buffers):
            if f"b{i}" in tensors:
                b.copy_(tensors[f"b{i}"])
    train_state.load_extra_state(meta["extra"])
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and train_state.device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng/cuda"], train_state.device)
    return int(meta["step"])


def encode(saved: RankState) -> bytes:
    """One byte string (see the module docstring)."""
    entries: List[Tuple[str, str, List[int], int, int]] = []
    blobs: List[bytes] = []
    offset = 0
    for name, t in saved.tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entries.append((name, str(t.dtype).replace("torch.", ""), list(t.shape), offset, len(raw)))
        blobs.append(raw)
        offset += len(raw)
    header = json.dumps({"meta": saved.meta, "tensors": entries}, sort_keys=True).encode()
    body = b"".join([MAGIC, struct.pack("<Q", len(header)), header, *blobs])
    return body + struct.pack("<I", zlib.crc32(body))


def decode(data: bytes) -> RankState:
    """The state in ``data``; LocalStateError when it is damaged."""
    view = memoryview(data)
    if len(data) < len(MAGIC) + 12 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise LocalStateError("not a local-tier file")
    (crc,) = struct.unpack("<I", view[-4:])
    if zlib.crc32(view[:-4]) != crc:
        raise LocalStateError("checksum mismatch (a damaged or half-written file)")
    start = len(MAGIC)
    (n,) = struct.unpack("<Q", view[start:start + 8])
    header = json.loads(bytes(view[start + 8:start + 8 + n]))
    base = start + 8 + n
    out = RankState(meta=header["meta"])
    for name, dtype, shape, off, length in header["tensors"]:
        raw = bytearray(view[base + off:base + off + length])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        out.tensors[name] = flat.view(DTYPES[dtype]).reshape(shape)
    return out
