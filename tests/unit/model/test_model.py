import math

import pytest
import torch

from hpctrain.model.build import build_model, init_logical, logical_param_count, materialize, tensor_seed
from hpctrain.model.shapes import ModelShape
from hpctrain.shard import get_spec


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_tiny_builds_on_meta_and_counts_match_closed_form(make_config):
    cfg = make_config()
    model = build_model(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    shape = ModelShape.from_config(cfg.model)
    assert _count(model) == shape.total_params == logical_param_count(model)


def test_gpt2_124m_like_count(make_config):
    cfg = make_config("model=gpt2-124m")
    model = build_model(cfg)
    h, v, layers, f = 768, 50257, 12, 2048
    # tied embedding + per block (4h^2 attention, 3hf SwiGLU = GPT-2's 8h^2 MLP, 2 norms) + final norm
    expected = v * h + layers * (4 * h * h + 3 * h * f + 2 * h) + h
    assert 3 * h * f == 8 * h * h
    assert _count(model) == expected == 123_551_232


def test_llama3_8b_count_matches_published(make_config):
    cfg = make_config("model=llama3-8b")
    model = build_model(cfg)
    # Meta's Llama 3 8B: 8,030,261,248 parameters (counted from the released weights).
    assert _count(model) == 8_030_261_248
    assert logical_param_count(model) == 8_030_261_248


@pytest.mark.parametrize("preset, params", [("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)])
def test_llama3_large_presets_have_the_published_shapes(make_config, preset, params):
    """Meta's Llama 3 70B and 405B: the config.json shapes (and the paper's Table 3),
    counted on the meta device (nothing is allocated)."""
    shapes = {"llama3-70b": (8192, 80, 64, 28672), "llama3-405b": (16384, 126, 128, 53248)}[preset]
    cfg = make_config(f"model={preset}")
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_heads, m.ffn_hidden) == shapes
    assert (m.vocab_size, m.n_kv_heads, m.rope_theta, m.tie_embeddings) == (128256, 8, 500000.0, False)
    assert logical_param_count(build_model(cfg)) == params


def test_every_parameter_has_a_spec_named_by_its_path(make_config):
    model = build_model(make_config())
    names = {get_spec(p).logical_name for p in model.parameters()}
    assert "layers.0.attn.wq.weight" in names and "tok_embeddings.weight" in names
    assert get_spec(model.norm.weight).init == "ones"
    assert get_spec(model.layers[0].attn.wo.weight).init == "normal_scaled"


def test_init_is_a_function_of_seed_and_name_only(make_config):
    cfg = make_config()
    a = materialize(build_model(cfg), torch.device("cpu"), 7, 0.02, cfg.model.n_layers)
    b = materialize(build_model(cfg), torch.device("cpu"), 7, 0.02, cfg.model.n_layers)
    c = materialize(build_model(cfg), torch.device("cpu"), 8, 0.02, cfg.model.n_layers)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if get_spec(pa).init.startswith("normal"):
            assert not torch.equal(pa, pc), n
    assert tensor_seed(0, "a") != tensor_seed(0, "b")


def test_sharded_materialize_gives_slices_of_the_logical_tensor(make_config):
    """A parameter split over tp gets exactly its slice of the one-process tensor."""
    cfg = make_config()
    full = materialize(build_model(cfg), torch.device("cpu"), 3, 0.02, cfg.model.n_layers)
    for tp_rank in range(2):
        model = build_model(cfg)
        wq = model.layers[0].attn.wq
        spec = get_spec(wq.weight).with_split(0, "tp")
        wq.weight = torch.nn.Parameter(torch.empty(spec.local_shape({"tp": tp_rank}, {"tp": 2}), device="meta"))
        wq.weight.hpctrain_spec = spec
        materialize(model, torch.device("cpu"), 3, 0.02, cfg.model.n_layers, {"tp": tp_rank}, {"tp": 2})
        rows = wq.weight.shape[0]
        assert torch.equal(wq.weight, full.layers[0].attn.wq.weight[tp_rank * rows:(tp_rank + 1) * rows])


def test_mis_sized_shard_is_reported(make_config):
    cfg = make_config()
    model = build_model(cfg)
    spec = get_spec(model.layers[0].attn.wq.weight)
    model.layers[0].attn.wq.weight = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    model.layers[0].attn.wq.weight.hpctrain_spec = spec
    with pytest.raises(RuntimeError, match="must update its ShardSpec"):
        materialize(model, torch.device("cpu"), 0, 0.02, 2)


def test_tied_embeddings_stay_tied_after_materialize(make_config):
    cfg = make_config("model.tie_embeddings=true")
    model = materialize(build_model(cfg), torch.device("cpu"), 0, 0.02, cfg.model.n_layers)
    assert model.output.weight is model.tok_embeddings.weight
    assert get_spec(model.output.weight).logical_name == "tok_embeddings.weight"


def test_init_statistics():
    from hpctrain.shard import replicated_spec

    t = init_logical(replicated_spec("w", (256, 256)), 0, 0.02, 4)
    assert abs(t.std().item() - 0.02) < 0.001
    t = init_logical(replicated_spec("w", (256, 256), init="normal_scaled"), 0, 0.02, 4)
    assert abs(t.std().item() - 0.02 / math.sqrt(8)) < 0.0005


def test_forward_loss_is_near_log_vocab_at_init(make_config):
    cfg = make_config()
    model = materialize(build_model(cfg), torch.device("cpu"), 0, 0.02, cfg.model.n_layers)
    x = torch.randint(0, 256, (2, 16))
    loss = model(x, x)
    assert abs(loss.item() - math.log(256)) < 0.1
    assert model(x).shape == (2, 16, 256)


def test_gqa_and_causality(make_config):
    """Changing a later token must not change earlier logits."""
    cfg = make_config("model.n_kv_heads=1")
    model = materialize(build_model(cfg), torch.device("cpu"), 0, 0.02, cfg.model.n_layers)
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % 256
    la, lb = model(x), model(y)
    assert torch.allclose(la[:, :8], lb[:, :8], atol=1e-6)
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_bad_shapes_are_config_errors(make_config):
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match="not divisible by model.n_heads"):
        ModelShape.from_config(make_config("model.n_heads=5").model)
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ModelShape.from_config(make_config("model.n_kv_heads=3").model)


def test_materialize_keeps_parameter_identity(make_config):
    """Plugins capture parameters while the model is on meta (hooks, buckets);
    materialising must fill those same objects, not replace them."""
    cfg = make_config("model.tie_embeddings=true")
    model = build_model(cfg)
    before = [id(p) for p in model.parameters()]
    materialize(model, torch.device("cpu"), 0, 0.02, cfg.model.n_layers)
    assert [id(p) for p in model.parameters()] == before
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.output.weight is model.tok_embeddings.weight


def _materialized(cfg, seed=0):
    model = build_model(cfg)
    return materialize(model, torch.device("cpu"), seed, cfg.model.init_std, cfg.model.n_layers)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_chained_compute_the_whole_model(make_config, tied):
    """``part`` gives each stage only its parts; running them one after
    another (hidden states in, hidden states out) equals the whole model,
    loss and gradients of every parameter included."""
    cfg = make_config("model.n_layers=4", f"model.tie_embeddings={str(tied).lower()}")
    whole = _materialized(cfg)
    split = [(range(0, 1), True, False), (range(1, 3), False, False), (range(3, 4), False, True)]
    stages = [_materialized(cfg).part(layers, first, last) for layers, first, last in split]
    assert stages[0].tok_embeddings is not None and stages[0].output is None
    assert list(stages[1].layers.keys()) == ["1", "2"]
    assert stages[1].tok_embeddings is None and stages[1].output is None and stages[2].output is not None
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names <= {n for n, _ in whole.named_parameters()} | {"output.weight"}  # one-process names
    if tied:  # the last stage keeps the tied weight as output.weight, named tok_embeddings.weight
        assert get_spec(stages[2].output.weight).logical_name == "tok_embeddings.weight"

    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, 1)
    want = whole(tokens, targets)
    want.backward()
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == (2, 16, cfg.model.d_model)
    got = stages[-1](x, targets)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    grads = {}
    for s in stages:
        for p in s.parameters():
            name = get_spec(p).logical_name
            grads[name] = grads[name] + p.grad if name in grads else p.grad  # tied: summed over the two stages
    for p in whole.parameters():
        torch.testing.assert_close(grads[get_spec(p).logical_name], p.grad, rtol=1e-5, atol=1e-7)


def test_aux_loss_channel_adds_to_the_objective_not_to_the_logged_loss(make_config, pm):
    """A part adds a loss with add_aux_loss; the schedule's backward includes
    it (scaled like the main loss), the logged loss does not."""
    from hpctrain import hookimpl
    from hpctrain.data.cursor import MicroBatch
    from hpctrain.model.aux import add_aux_loss, collect_aux_losses
    from hpctrain.model.transformer import SwiGLU
    from hpctrain.parallel.handles import LocalData
    from hpctrain.train.step_runner import GradAccumulation

    class PenalisedFFN(SwiGLU):
        def forward(self, x):
            add_aux_loss("l2", 0.5 * self.w1.weight.pow(2).sum())
            return super().forward(x)

    class Parts:
        @hookimpl
        def hpctrain_capabilities(self):
            return {"model.ffn": ["penalised"]}

        @hookimpl
        def hpctrain_make_module(self, kind, name, cfg, layer_index):
            return PenalisedFFN(ModelShape.from_config(cfg.model)) if (kind, name) == ("ffn", "penalised") else None

    pm.register(Parts())
    cfg = make_config("model.ffn=penalised")
    from hpctrain.model.build import build_model as build

    model = materialize(build(cfg, pm), torch.device("cpu"), 0, cfg.model.init_std, cfg.model.n_layers)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    mbs = [MicroBatch(tokens, torch.roll(tokens, -1, 1)), MicroBatch(tokens.flip(1), tokens)]

    result = GradAccumulation().run(model, mbs, LocalData(model))
    grad = model.layers[0].ffn.w1.weight.grad.clone()
    with torch.no_grad():
        lm = [float(model(mb.inputs, mb.targets)) for mb in mbs]
    assert float(result.loss_sum) == pytest.approx(sum(v * 16 for v in lm), rel=1e-6) and result.tokens == 32
    # the same gradient by hand: mean over micro-batches of (lm + aux)
    model.zero_grad()
    for mb in mbs:
        with collect_aux_losses() as aux:
            loss = model(mb.inputs, mb.targets)
        assert [n for n, _ in aux.terms] == ["l2", "l2"]  # one per layer
        ((loss + aux.total()) / 2).backward()
    torch.testing.assert_close(model.layers[0].ffn.w1.weight.grad, grad)
    # the aux term really is in there: without it the gradient differs by w1 exactly
    model.zero_grad()
    for mb in mbs:
        (model(mb.inputs, mb.targets) / 2).backward()  # outside a collector add_aux_loss does nothing
    torch.testing.assert_close(grad - model.layers[0].ffn.w1.weight.grad, model.layers[0].ffn.w1.weight.detach(),
                               rtol=1e-5, atol=1e-6)
