"""Layout-independent initialisation through every ShardSpec split kind.

Every rank of a layout is simulated in this one process: the tiny model is
built on the meta device, some of its parameters are re-specced with a split
kind and narrowed to their local shape (as a parallelising plugin does), and
``materialize`` fills them for that rank's coordinates. Each piece must equal
the same box of ``init_logical`` (and of the one-process model), padding
must be zero, and a rank must draw only the random tiles its pieces touch.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import hpctrain.model.build as build
from hpctrain.boxes import box_slices
from hpctrain.model.build import TILE, build_model, init_box, init_logical, materialize
from hpctrain.shard import Block, ShardSpec, get_spec, replicated_spec, set_spec

SEED, STD, LAYERS = 1234, 0.02, 2


def _all_coords(sizes):
    axes = sorted(sizes)
    for values in itertools.product(*(range(sizes[a]) for a in axes)):
        yield dict(zip(axes, values))


def _respec(model: nn.Module, name: str, spec: ShardSpec, coords, sizes) -> None:
    """Replace parameter ``name`` by a meta parameter of its local shape carrying ``spec``."""
    mod_name, attr = name.rsplit(".", 1) if "." in name else ("", name)
    module = model.get_submodule(mod_name)
    new = nn.Parameter(torch.empty(spec.local_shape(coords, sizes), device="meta"))
    set_spec(new, spec)
    setattr(module, attr, new)


def _padding_mask(spec: ShardSpec, local: torch.Tensor, coords, sizes) -> torch.Tensor:
    """True at local positions no piece covers (padding)."""
    index = torch.arange(local.numel()).reshape(local.shape)
    mask = torch.ones(local.numel(), dtype=torch.bool)
    for piece in spec.pieces(coords, sizes):
        mask[piece.take(index).reshape(-1)] = False
    return mask.reshape(local.shape)


def _materialize_rank(model: nn.Module, specs, coords, sizes) -> nn.Module:
    for name, spec in specs.items():
        _respec(model, name, spec, coords, sizes)
    return materialize(model, torch.device("cpu"), SEED, STD, LAYERS, coords, sizes)


_LOGICAL = {}


def _logical(spec: ShardSpec) -> torch.Tensor:
    """``init_logical`` of a spec's tensor (drawn once per tensor and init)."""
    key = (spec.logical_name, spec.global_shape, spec.init)
    if key not in _LOGICAL:
        _LOGICAL[key] = init_logical(spec, SEED, STD, LAYERS)
    return _LOGICAL[key]


def _check_and_rebuild(params, coords, sizes, rebuilt):
    """Every piece equals the slice of ``init_logical``; padding is zero; pieces go into ``rebuilt``."""
    for p in params:
        spec = get_spec(p)
        want = _logical(spec)
        if spec.logical_name not in rebuilt:
            rebuilt[spec.logical_name] = torch.full(spec.global_shape, float("nan"))
        for piece in spec.pieces(coords, sizes):
            got = piece.take(p.detach())
            assert torch.equal(got, want[piece.slices]), f"{spec.logical_name} at {coords}: {piece.box}"
            rebuilt[spec.logical_name][piece.slices] = got
        pad = _padding_mask(spec, p.detach(), coords, sizes)
        assert torch.all(p.detach()[pad] == 0), f"{spec.logical_name} at {coords}: padding is not zero"


# -- the tiny model, a parameter per split kind -------------------------------

def _tiny_kinds(model: nn.Module, tp: int):
    g = lambda n: get_spec(model.get_parameter(n))  # noqa: E731
    kv = min(2, tp)
    return {
        # padded vocab: 250 rows padded to 256 (the last tp rank holds 58 real rows at tp=4)
        "tok_embeddings.weight": g("tok_embeddings.weight").split(0, "tp", padded=256),
        # padded so far that the last rank at tp=4 (rows [264, 352)) is all padding
        "output.weight": g("output.weight").split(0, "tp", padded=352),
        "layers.0.attn.wq.weight": g("layers.0.attn.wq.weight").split(0, "tp", unit=16),
        "layers.0.attn.wk.weight": g("layers.0.attn.wk.weight").split(0, "tp", pieces=kv, unit=16),
        "layers.0.attn.wv.weight": g("layers.0.attn.wv.weight").split(0, "tp", pieces=kv, unit=16).flat_split("dp"),
        "layers.0.attn.wo.weight": g("layers.0.attn.wo.weight").split(1, ("dp", "tp")),
        "layers.0.ffn.w1.weight": g("layers.0.ffn.w1.weight").split_blocks(
            0, "tp", [Block(64), Block(128, pieces=kv, unit=32)]),
        "layers.0.ffn.w2.weight": g("layers.0.ffn.w2.weight").flat_split("dp"),
        "layers.0.ffn.w3.weight": g("layers.0.ffn.w3.weight").split(0, "tp").flat_split("dp"),
        # one flat group of 128 over dp: at dp=2 each rank holds one norm and nothing of the other
        "layers.0.attn_norm.weight": g("layers.0.attn_norm.weight").flat_split("dp", offset=0, total=128),
        "layers.0.ffn_norm.weight": g("layers.0.ffn_norm.weight").flat_split("dp", offset=64, total=128),
    }


@pytest.mark.parametrize("sizes", [{"tp": 4, "dp": 2}, {"tp": 2, "dp": 4}], ids=["tp4-dp2", "tp2-dp4"])
def test_every_split_kind_materializes_the_one_process_values(make_config, sizes):
    cfg = make_config("model.vocab_size=250")
    reference = materialize(build_model(cfg), torch.device("cpu"), SEED, STD, LAYERS)
    one_process = {get_spec(p).logical_name: p.detach() for p in reference.parameters()}
    rebuilt = {}
    specs = _tiny_kinds(build_model(cfg), sizes["tp"])
    for coords in _all_coords(sizes):
        model = _materialize_rank(build_model(cfg), specs, coords, sizes)
        for name, spec in specs.items():
            p = model.get_parameter(name)
            assert get_spec(p) is spec and tuple(p.shape) == spec.local_shape(coords, sizes)
        _check_and_rebuild(list(model.parameters()), coords, sizes, rebuilt)
    assert sorted(rebuilt) == sorted(one_process)
    for name, tensor in one_process.items():
        assert torch.equal(rebuilt[name], tensor), name  # every element, from some rank, as in one process


def test_all_padding_rank_and_empty_flat_range(make_config):
    cfg = make_config("model.vocab_size=250")
    sizes = {"tp": 4, "dp": 2}
    specs = _tiny_kinds(build_model(cfg), 4)
    model = _materialize_rank(build_model(cfg), specs, {"tp": 3, "dp": 1}, sizes)
    out = model.get_parameter("output.weight")
    assert tuple(out.shape) == (88, 64) and torch.all(out == 0)
    assert get_spec(out).pieces({"tp": 3, "dp": 1}, sizes) == []
    # dp=1 holds [64, 128) of the flat group: all of ffn_norm, nothing of attn_norm
    assert tuple(model.get_parameter("layers.0.attn_norm.weight").shape) == (0,)
    assert torch.all(model.get_parameter("layers.0.ffn_norm.weight") == 1)


def test_materialize_rejects_a_parameter_not_narrowed_to_its_local_shape(make_config):
    cfg = make_config()
    model = build_model(cfg)
    p = model.get_parameter("layers.0.attn.wq.weight")
    set_spec(p, get_spec(p).split(0, "tp"))  # spec updated, shape not
    with pytest.raises(RuntimeError, match=r"layers.0.attn.wq.weight: ShardSpec gives a local shape \(32, 64\)"):
        materialize(model, torch.device("cpu"), SEED, STD, LAYERS, {"tp": 0}, {"tp": 2})


# -- tensors larger than a tile: the same values under every split ------------

class _One(nn.Module):
    def __init__(self, name, shape):
        super().__init__()
        self.w = nn.Parameter(torch.empty(shape, device="meta"))
        set_spec(self.w, replicated_spec(name, shape))


def _rebuild_under(spec: ShardSpec, sizes):
    """Materialise ``spec`` on every simulated rank; the logical tensor assembled from the pieces."""
    rebuilt = {}
    for coords in _all_coords(sizes):
        m = _One(spec.logical_name, spec.global_shape)
        _materialize_rank(m, {"w": spec}, coords, sizes)
        _check_and_rebuild([m.w], coords, sizes, rebuilt)
    return rebuilt[spec.logical_name]


BIG = replicated_spec("big", (600, 300))
BIG_LAYOUTS = {
    "rows-tp4": (BIG.split(0, "tp"), {"tp": 4}),
    "cols-tp3": (BIG.split(1, "tp"), {"tp": 3}),
    "rows-cols": (BIG.split(0, "tp").split(1, "dp"), {"tp": 4, "dp": 3}),
    "rows-two-axes": (BIG.split(0, ("dp", "tp")), {"tp": 3, "dp": 2}),
    "padded-tp8": (BIG.split(0, "tp", padded=640), {"tp": 8}),
    "replicated-pieces": (BIG.split(1, "tp", pieces=2), {"tp": 4}),
    "blocks": (BIG.split_blocks(0, "tp", [Block(200), Block(400, pieces=2)]), {"tp": 4}),
    "flat-dp7": (BIG.flat_split("dp"), {"dp": 7}),
    "rows-then-flat-offset": (BIG.split(0, "tp").flat_split("dp", offset=1000, total=100000), {"tp": 2, "dp": 3}),
}


def test_big_tensor_same_values_under_every_split():
    whole = init_logical(BIG, SEED, STD, LAYERS)
    # tiles really differ (a seed that ignored the tile index would repeat them)
    assert not torch.equal(whole[:TILE, :TILE], whole[TILE:2 * TILE, :TILE])
    assert not torch.equal(whole[:TILE, :44], whole[:TILE, TILE:])
    for name, (spec, sizes) in BIG_LAYOUTS.items():
        assert torch.equal(_rebuild_under(spec, sizes), whole), name
    # and a box drawn on its own equals the slice of the whole
    box = ((250, 520), (7, 299))
    assert torch.equal(init_box(BIG, box, SEED, STD, LAYERS), whole[box_slices(box)])


def test_3d_and_1d_tensors_larger_than_a_tile():
    t3 = replicated_spec("t3", (3, 300, 270))
    whole3 = init_logical(t3, SEED, STD, LAYERS)
    assert not torch.equal(whole3[0], whole3[1])  # one tile per leading index
    for spec, sizes in [(t3.split(0, "tp").split(2, "dp"), {"tp": 3, "dp": 2}),
                        (t3.split(1, "tp", padded=304), {"tp": 4}),
                        (t3.flat_split("dp"), {"dp": 5})]:
        assert torch.equal(_rebuild_under(spec, sizes), whole3)
    t1 = replicated_spec("t1", (TILE * TILE + 100,))
    whole1 = init_logical(t1, SEED, STD, LAYERS)
    assert torch.equal(_rebuild_under(t1.split(0, "tp", padded=TILE * TILE + 104), {"tp": 4}), whole1)


# -- a rank draws only the tiles its pieces touch -----------------------------

@pytest.fixture
def drawn(monkeypatch):
    """Names of the tiles drawn (tensor#tile index) and the number of generators made."""
    record = {"tiles": [], "generators": 0}
    real_generator, real_seed = torch.Generator, build.tensor_seed

    def counting_generator(*args, **kwargs):
        record["generators"] += 1
        return real_generator(*args, **kwargs)

    def recording_seed(seed, name):
        record["tiles"].append(name)
        return real_seed(seed, name)

    monkeypatch.setattr(torch, "Generator", counting_generator)
    monkeypatch.setattr(build, "tensor_seed", recording_seed)

    def reset():
        record["tiles"].clear()
        record["generators"] = 0
        return record

    return reset


def _draw_at(spec, coords, sizes):
    m = _One(spec.logical_name, spec.global_shape)
    _materialize_rank(m, {"w": spec}, coords, sizes)
    return m


def test_a_rank_draws_only_the_tiles_it_touches(drawn):
    rec = drawn()
    init_logical(BIG, SEED, STD, LAYERS)
    assert rec["generators"] == 6 and sorted(rec["tiles"]) == [f"big#{i},{j}" for i in range(3) for j in range(2)]

    grid = BIG.split(0, "tp").split(1, "dp")  # boxes of 150 x 100
    sizes = {"tp": 4, "dp": 3}
    rec = drawn()
    _draw_at(grid, {"tp": 0, "dp": 0}, sizes)
    assert rec["tiles"] == ["big#0,0"] and rec["generators"] == 1
    rec = drawn()
    _draw_at(grid, {"tp": 1, "dp": 2}, sizes)  # rows [150, 300), cols [200, 300): four tiles
    assert sorted(rec["tiles"]) == ["big#0,0", "big#0,1", "big#1,0", "big#1,1"] and rec["generators"] == 4

    rec = drawn()  # all padding: draws nothing
    _draw_at(BIG.split(0, "tp", padded=1024), {"tp": 3}, {"tp": 4})
    assert rec["tiles"] == [] and rec["generators"] == 0

    rec = drawn()  # a flat range: elements [90200, 90300) = row 300, cols [200, 300)
    flat = BIG.flat_split("dp")
    _draw_at(flat, {"dp": 902}, {"dp": 1800})
    assert rec["tiles"] == ["big#1,0", "big#1,1"]

    rec = drawn()  # init ones/zeros draws nothing
    init_logical(replicated_spec("n", (600, 300), "ones"), SEED, STD, LAYERS)
    assert rec["generators"] == 0


def test_tiny_model_rank_never_draws_a_whole_sharded_tensor(make_config, drawn):
    cfg = make_config("model.vocab_size=250")
    sizes = {"tp": 4, "dp": 2}
    coords = {"tp": 3, "dp": 1}
    specs = _tiny_kinds(build_model(cfg), 4)
    model = build_model(cfg)
    rec = drawn()
    _materialize_rank(model, specs, coords, sizes)
    names = [t.split("#")[0] for t in rec["tiles"]]
    assert "output.weight" not in names  # all padding on this rank
    assert "layers.0.attn_norm.weight" not in names  # ones, and an empty flat range
    assert len(names) == rec["generators"]
    # every drawn tile belongs to a tensor this rank holds a piece of
    held = {get_spec(p).logical_name for p in model.parameters() if get_spec(p).pieces(coords, sizes)}
    assert set(names) <= held


def test_default_init_is_skipped_on_meta_tensors_only():
    """``build_model`` builds under ``_NoInitOnMeta``: torch.nn.init on a meta tensor
    never runs (``materialize`` initialises later), on a real tensor it still does.
    A recording mode under it sees what gets through."""
    from torch.overrides import TorchFunctionMode

    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.inits = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__module__", None) == "torch.nn.init":
                target = args[0] if args else (kwargs or {}).get("tensor")
                self.inits.append((func.__name__, target.device.type))
            return func(*args, **(kwargs or {}))

    real = torch.zeros(64)
    with Record() as seen, torch.device("meta"), build._NoInitOnMeta():
        layer = nn.Linear(4, 4)
        nn.Embedding(8, 4)
        nn.init.normal_(real, std=1.0)
    assert layer.weight.is_meta and real.std() > 0.5
    assert seen.inits == [("normal_", "cpu")]
