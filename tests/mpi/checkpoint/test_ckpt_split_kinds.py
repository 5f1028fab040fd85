"""Every ShardSpec split kind through a real Trainer's HDF5 save and a load
on a different layout of the same world.

A test plugin (``SplitKinds``, registered as ``split_kinds`` and chosen with
``parallel.impl.tp`` / ``parallel.impl.dp``) gives parameters of the tiny
model each split kind by replacing them with meta parameters of their local
shape and setting their ShardSpec, registers a persistent buffer with a
padded split, and makes an AdamW whose ``state_spec`` lays out a per-row
state (``row_sq``, not shaped like its parameter). Nothing is trained (the
shapes no longer fit the forward): every parameter, optimizer state and the
buffer get known logical values (padding filled with garbage on the saving
side), the trainer saves, and a second Trainer on another layout resumes
from the file. Every piece it holds must equal the logical values, padding
must be zero, and the file's datasets must have the logical (unpadded)
shapes and values.

Layouts (tp x dp): 2 ranks 2x1 -> 1x2; 4 ranks 4x1 -> 2x2; 8 ranks 4x2 -> 2x4.
"""
from __future__ import annotations

import functools
import math
import sys
import time
import traceback

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpctrain import hookimpl
from hpctrain.parallel.handles import AxisHandle, DataHandle
from hpctrain.parity import on_rank0
from hpctrain.plugins import get_manager
from hpctrain.shard import SPEC_ATTR, Block, ShardSpec, get_spec, replicated_spec, set_spec

from ckpt_helpers import build_trainer

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.every_size]  # the world size changes what is tested

NAME = "split_kinds"
VOCAB = 250
BUF = "split_kinds.buf"
BUF_SHAPE = (10, 3)
GARBAGE = -777.0
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _specs(model: nn.Module, tp: int, dp: int):
    """parameter name -> its ShardSpec on a tp x dp layout (each split kind at least once)."""
    g = lambda n: get_spec(model.get_parameter(n))  # noqa: E731
    kv = min(2, max(1, tp // 2))  # key/value pieces: each held by 2 tp ranks (tp 2 and 4)
    flat = dp > 1
    specs = {
        # padded vocab: 250 rows padded to a multiple of tp * 8
        "tok_embeddings.weight": g("tok_embeddings.weight").split(0, "tp", padded=-(-VOCAB // (tp * 8)) * tp * 8),
        # padded so far that at tp=4 the last rank (rows [264, 352)) holds only padding
        "output.weight": g("output.weight").split(0, "tp", padded=352),
        # even
        "layers.0.attn.wq.weight": g("layers.0.attn.wq.weight").split(0, "tp", unit=16),
        "layers.0.attn.wo.weight": g("layers.0.attn.wo.weight").split(1, "tp"),
        # replicated key/value pieces (2 heads of 16 rows)
        "layers.0.attn.wk.weight": g("layers.0.attn.wk.weight").split(0, "tp", pieces=kv, unit=16),
        "layers.0.attn.wv.weight": g("layers.0.attn.wv.weight").split(0, "tp", pieces=kv, unit=16),
        # fused blocks, different pieces per block
        "layers.0.ffn.w1.weight": g("layers.0.ffn.w1.weight").split_blocks(
            0, "tp", [Block(64), Block(128, pieces=kv, unit=32)]),
        # several axes, outermost first
        "layers.1.attn.wq.weight": g("layers.1.attn.wq.weight").split(0, ("dp", "tp")),
    }
    w2 = g("layers.0.ffn.w2.weight").split(1, "tp")
    w3 = g("layers.0.ffn.w3.weight")
    wk1 = g("layers.1.attn.wk.weight").split(0, "tp", pieces=kv, unit=16)
    if flat:
        w2 = w2.flat_split("dp")  # flat after an even dim split
        w3 = w3.flat_split("dp")  # flat alone
        wk1 = wk1.flat_split("dp")  # flat after replicated pieces
        specs["output.weight"] = specs["output.weight"].flat_split("dp")  # flat over padding
        # one flat group of 128 over dp: each rank holds nothing of one of the two norms
        specs["layers.0.attn_norm.weight"] = g("layers.0.attn_norm.weight").flat_split("dp", offset=0, total=128)
        specs["layers.0.ffn_norm.weight"] = g("layers.0.ffn_norm.weight").flat_split("dp", offset=64, total=128)
    specs.update({"layers.0.ffn.w2.weight": w2, "layers.0.ffn.w3.weight": w3, "layers.1.attn.wk.weight": wk1})
    return specs


def _buffer_spec() -> ShardSpec:
    return replicated_spec(BUF, BUF_SHAPE, "zeros").split(0, "tp", padded=12)  # 12: padded on tp 1, 2 and 4


#: Parameters with a per-row optimizer state (none of them is ever flat-split).
ROW_STATE = ("tok_embeddings.weight", "layers.0.attn.wk.weight", "layers.0.ffn.w1.weight", "layers.1.attn.wq.weight",
             "layers.1.ffn.w1.weight")


class RowStateAdamW(torch.optim.AdamW):
    """AdamW with one more state, ``row_sq``, for the ``ROW_STATE``
    parameters: one value per row, laid out by ``state_spec`` like the
    parameter's dim 0 (padding and replicated pieces included)."""

    def state_spec(self, param, key):
        if key != "row_sq":
            return None
        return row_spec(get_spec(param))


def row_spec(spec: ShardSpec):
    """The per-row state's spec: dim 0 of the parameter's (None: no per-row state)."""
    if spec.logical_name not in ROW_STATE:
        return None
    assert spec.flat is None and len(spec.global_shape) == 2
    rows = replicated_spec(spec.logical_name + ".row_sq", spec.global_shape[:1])
    for s in spec.splits:
        if s.dim == 0:
            rows = rows.split_blocks(0, s.axes, spec._blocks(s))
    return rows


class SplitKinds:
    """Serves tp and dp: gives the tiny model's parameters every split kind."""

    @hookimpl
    def hpctrain_capabilities(self):
        return {"parallel": ["tp", "dp"]}

    @hookimpl
    def hpctrain_parallelize(self, model, axis, mesh, cfg):
        if axis not in ("tp", "dp"):
            return None
        if getattr(model, "_split_kinds_done", False):  # both axes asked: the first one does it all
            return AxisHandle(model) if axis == "tp" else DataHandle(model)
        model._split_kinds_done = True
        coords, sizes = mesh.coords, mesh.sizes
        for name, spec in _specs(model, sizes["tp"], sizes["dp"]).items():
            mod_name, attr = name.rsplit(".", 1)
            new = nn.Parameter(torch.empty(spec.local_shape(coords, sizes), device="meta"))
            set_spec(new, spec)
            setattr(model.get_submodule(mod_name), attr, new)
        spec = _buffer_spec()
        buf = torch.empty(spec.local_shape(coords, sizes), device="meta")
        setattr(buf, SPEC_ATTR, spec)
        model.register_buffer("split_kinds_buf", buf, persistent=True)
        return AxisHandle(model) if axis == "tp" else DataHandle(model)  # gradients left as they are

    @hookimpl
    def hpctrain_make_optimizer(self, params, model, mesh, cfg):
        if not getattr(model, "_split_kinds_done", False):
            return None
        return RowStateAdamW(params, lr=cfg.optim.lr)


# -- logical values ------------------------------------------------------------

def _logical(name: str, shape) -> torch.Tensor:
    """Distinct, non-zero, name-dependent values of a logical tensor."""
    salt = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % 997
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) * 0.001 + salt + 1).reshape(shape)).to(torch.float32)


def _state_logical(key: str, name: str, shape) -> torch.Tensor:
    base = _logical(name, shape)
    return {"exp_avg": 2 * base, "exp_avg_sq": base * base + 0.5, "row_sq": base * 3}[key]


def _fill(tensor: torch.Tensor, spec: ShardSpec, logical: torch.Tensor, mesh, padding: float) -> None:
    """Write ``logical``'s pieces into ``tensor``, ``padding`` everywhere else."""
    tensor.fill_(padding)
    for piece in spec.pieces(mesh.coords, mesh.sizes):
        piece.take(tensor).copy_(logical[piece.slices])


def _padding_mask(tensor: torch.Tensor, spec: ShardSpec, mesh) -> torch.Tensor:
    index = torch.arange(tensor.numel()).reshape(tensor.shape)
    mask = torch.ones(tensor.numel(), dtype=torch.bool)
    for piece in spec.pieces(mesh.coords, mesh.sizes):
        mask[piece.take(index).reshape(-1)] = False
    return mask.reshape(tensor.shape)


def _check(what: str, tensor: torch.Tensor, spec: ShardSpec, logical: torch.Tensor, mesh, problems) -> int:
    """Every piece equals ``logical``; padding is zero. Returns the padding positions seen."""
    if tuple(tensor.shape) != tuple(spec.local_shape(mesh.coords, mesh.sizes)):
        problems.append(f"{what}: local shape {tuple(tensor.shape)}")
        return 0
    for piece in spec.pieces(mesh.coords, mesh.sizes):
        if not torch.equal(piece.take(tensor.detach()), logical[piece.slices]):
            problems.append(f"{what}: piece {piece.box} differs")
    pad = _padding_mask(tensor, spec, mesh)
    if not torch.all(tensor.detach()[pad] == 0):
        problems.append(f"{what}: padding is not zero")
    return int(pad.sum())


def _agreed(side, fn, what: str, wait_s: float = 120.0, capman=None):
    """Run ``fn`` on every rank and agree on its outcome: a failure on any rank
    fails the test on every rank (so no rank goes on into a collective the
    failed one never enters). A rank that fails while others stay stuck in a
    collective inside ``fn`` (the Trainer's set-up) ends the job with
    MPI Abort after ``wait_s`` instead of hanging the session."""
    result, error = None, None
    try:
        result = fn()
    except BaseException:  # noqa: BLE001 - reported on every rank below
        error = f"rank {side.Get_rank()}: {traceback.format_exc()}"
    req, t0 = side.Ibarrier(), time.monotonic()
    while not req.Test():
        if time.monotonic() - t0 > wait_s:
            message = (f"{what} failed on this rank and the others did not come back in {wait_s:.0f} s "
                       f"(stuck in a collective): aborting the job\n{error}\n")
            if capman is not None:  # past pytest's capture, which MPI Abort would lose
                with capman.global_and_fixture_disabled():
                    sys.stderr.write(message)
                    sys.stderr.flush()
            else:
                sys.stderr.write(message)
                sys.stderr.flush()
            side.Abort(1)
        time.sleep(0.02)
    errors = [e for e in side.allgather(error) if e]
    if errors:
        raise AssertionError(f"{what} failed:\n" + "\n".join(errors))
    return result


def _layouts(world: int):
    if world & (world - 1):
        pytest.skip("the split layouts need a power-of-two world")
    save_tp = min(4, world)
    return save_tp, save_tp // 2


@pytest.fixture
def split_kinds_plugin():
    pm = get_manager()
    pm.register(SplitKinds(), name=NAME)
    try:
        yield pm
    finally:
        pm.unregister(name=NAME)


def test_every_split_kind_saves_logical_and_loads_on_another_layout(shared_tmp, split_kinds_plugin, pytestconfig):
    agreed = functools.partial(_agreed, capman=pytestconfig.pluginmanager.getplugin("capturemanager"))

    comm = MPI.COMM_WORLD
    world = comm.Get_size()
    save_tp, load_tp = _layouts(world)
    path = f"{shared_tmp}/split_kinds.h5"
    common = [f"parallel.impl.tp={NAME}", f"parallel.impl.dp={NAME}", f"model.vocab_size={VOCAB}", "trainer.steps=1"]
    side = comm.Dup()
    try:
        # -- save on tp=save_tp: known logical values, garbage in the padding -----
        saver = agreed(side, lambda: build_trainer(*common, f"parallel.tp={save_tp}", "checkpoint.every=1",
                                                    f"checkpoint.dir={shared_tmp}"), "building the saving trainer")
        logical, state_specs = agreed(side, lambda: _fill_trainer(saver, save_tp), "filling the saving trainer")
        assert sorted(state_specs) == sorted(ROW_STATE)
        assert agreed(side, lambda: saver.save_checkpoint(path), "saving")

        # -- the file: logical (unpadded) shapes and values -------------------------
        bad, shapes = on_rank0(comm, lambda: _read_file(path, logical, state_specs))
        assert not bad, bad
        assert shapes == {"tok_embeddings.weight": (VOCAB, 64), "output.weight": (VOCAB, 64)}

        # -- load on tp=load_tp -----------------------------------------------------
        loader = agreed(side, lambda: build_trainer(*common, f"parallel.tp={load_tp}", f"checkpoint.resume={path}"),
                         "building the loading trainer (and loading)")
        assert loader.mesh.size("tp") == load_tp and loader.mesh.size("dp") == world // load_tp
        problems, padding = agreed(side, lambda: _check_trainer(loader, load_tp, logical), "checking")
        # padding really was there to be checked somewhere in the world
        total_padding = side.allreduce(padding)
        every_problem = [p for mine in side.allgather(problems) for p in mine]
        assert not every_problem, every_problem[:20]
        assert total_padding > 0
    finally:
        side.Free()


def _fill_trainer(saver, save_tp: int):
    """Logical values into every parameter, optimizer state and the buffer (garbage in the padding)."""
    mesh = saver.mesh
    assert mesh.size("tp") == save_tp and isinstance(saver.optimizer, RowStateAdamW)
    logical, state_specs = {}, {}
    with torch.no_grad():
        for p in saver.model.parameters():
            spec = get_spec(p)
            logical[spec.logical_name] = _logical(spec.logical_name, spec.global_shape)
            _fill(p, spec, logical[spec.logical_name], mesh, GARBAGE)
            state = {"step": torch.tensor(3.0)}
            for key in STATE_KEYS:
                state[key] = torch.empty_like(p)
                _fill(state[key], spec, _state_logical(key, spec.logical_name, spec.global_shape), mesh, GARBAGE)
            rows = row_spec(spec)
            if rows is not None:
                state_specs[spec.logical_name] = rows
                state["row_sq"] = torch.empty(rows.local_shape(mesh.coords, mesh.sizes))
                _fill(state["row_sq"], rows, _state_logical("row_sq", spec.logical_name, rows.global_shape),
                      mesh, GARBAGE)
            saver.optimizer.state[p] = state
        buf = saver.model.split_kinds_buf
        assert get_spec(buf) == _buffer_spec()
        _fill(buf, get_spec(buf), _logical(BUF, BUF_SHAPE), mesh, GARBAGE)
    return logical, state_specs


def _read_file(path: str, logical, state_specs):
    """(problems, shapes of the two vocab tensors) from reading the whole file."""
    bad = []
    with h5py.File(path, "r") as f:
        for name, want in logical.items():
            ds = f[f"/model/{name}"]
            if ds.shape != tuple(want.shape) or not np.array_equal(ds[()], want.numpy()):
                bad.append(f"/model/{name}: {ds.shape}")
            for key in STATE_KEYS:
                ds = f[f"/optim/{key}/{name}"]
                if ds.shape != tuple(want.shape) or not np.array_equal(
                        ds[()], _state_logical(key, name, want.shape).numpy()):
                    bad.append(f"/optim/{key}/{name}: {ds.shape}")
            if f[f"/optim/step/{name}"][()] != 3.0:
                bad.append(f"/optim/step/{name}")
            if name in state_specs:
                ds = f[f"/optim/row_sq/{name}"]
                if ds.shape != want.shape[:1] or not np.array_equal(
                        ds[()], _state_logical("row_sq", name, want.shape[:1]).numpy()):
                    bad.append(f"/optim/row_sq/{name}: {ds.shape}")
            elif f"/optim/row_sq/{name}" in f:
                bad.append(f"/optim/row_sq/{name} should not exist")
        ds = f[f"/buffers/{BUF}"]
        if ds.shape != BUF_SHAPE or not np.array_equal(ds[()], _logical(BUF, BUF_SHAPE).numpy()):
            bad.append(f"/buffers/{BUF}: {ds.shape}")
        extra = sorted(set(f["model"]) - set(logical))
        if extra:
            bad.append(f"unexpected /model datasets {extra}")
        shapes = {k: f[f"/model/{k}"].shape for k in ("tok_embeddings.weight", "output.weight")}
    return bad, shapes


def _check_trainer(loader, load_tp: int, logical):
    """(problems, padding positions checked) of this rank after the load."""
    mesh = loader.mesh
    problems, padding, seen = [], 0, set()
    for p in loader.model.parameters():
        spec = get_spec(p)
        name = spec.logical_name
        seen.add(name)
        padding += _check(f"/model/{name}", p, spec, logical[name], mesh, problems)
        state = loader.optimizer.state.get(p, {})
        if "step" not in state or float(state["step"]) != 3.0:
            problems.append(f"{name}: step {state.get('step')}")
        for key in STATE_KEYS:
            if key not in state:
                problems.append(f"{name}: no {key}")
                continue
            padding += _check(f"/optim/{key}/{name}", state[key], spec,
                              _state_logical(key, name, spec.global_shape), mesh, problems)
        rows = row_spec(spec)
        if rows is not None:
            if "row_sq" not in state:
                problems.append(f"{name}: no row_sq")
            else:
                padding += _check(f"/optim/row_sq/{name}", state["row_sq"], rows,
                                  _state_logical("row_sq", name, rows.global_shape), mesh, problems)
    buf = loader.model.split_kinds_buf
    if get_spec(buf) != _buffer_spec():
        problems.append(f"buffer spec {get_spec(buf)}")
    padding += _check(f"/buffers/{BUF}", buf, get_spec(buf), _logical(BUF, BUF_SHAPE), mesh, problems)
    if seen != set(logical):
        problems.append(f"parameters {sorted(seen ^ set(logical))}")
    problems = [f"rank {mesh.world_rank}: {p}" for p in problems]
    return problems, padding
