"""Every bad input the skeleton knows about yields one clear line naming the fix."""
from hpctrain.config.validate import validate


def _problems(make_config, pm, *overrides, world=4):
    return validate(make_config(*overrides), world, pm)


def test_default_config_is_valid(make_config, pm):
    assert _problems(make_config, pm) == []
    assert _problems(make_config, pm, world=1) == []


def test_world_size_mismatch(make_config, pm):
    (p,) = _problems(make_config, pm, "parallel.dp=3")
    assert p == "tp(1) * cp(1) * ep(1) * dp(3) * pp(1) = 3 != world size 4; launch 3 ranks or set parallel.dp=-1"


def test_batch_not_divisible(make_config, pm):
    (p,) = _problems(make_config, pm, "trainer.global_batch_size=10", "trainer.micro_batch_size=2")
    assert "trainer.global_batch_size=10 is not divisible by dp(4) x trainer.micro_batch_size(2) = 8" in p
    assert "e.g. 8 or 16" in p


def test_axis_without_plugin(make_config, pm):
    pm.unregister(name="cp")  # as if hpctrain_cp were not installed (or blocked by HPCTRAIN_DISABLE_PLUGINS)
    (p,) = _problems(make_config, pm, "parallel.cp=2")
    assert "parallel.cp=2 but no installed plugin parallelises axis 'cp'" in p


def test_tensor_parallel_shapes(make_config, pm):
    """tiny: 4 heads, 2 kv heads, SwiGLU width 192, 32-token sequences."""
    assert _problems(make_config, pm, "parallel.tp=4") == []
    (p,) = _problems(make_config, pm, "parallel.tp=4", "model.n_heads=2", "model.n_kv_heads=2")
    assert "parallel.tp=4 does not divide model.n_heads=2" in p and "use parallel.tp in {1, 2}" in p
    (p,) = _problems(make_config, pm, "parallel.tp=2", "model.n_heads=6", "model.n_kv_heads=3", "model.d_model=96",
                     "model.ffn_hidden=192")
    assert "parallel.tp=2 and model.n_kv_heads=3: one must divide the other" in p
    (p,) = _problems(make_config, pm, "parallel.tp=4", "model.ffn_hidden=190")
    assert "does not divide the SwiGLU width 190" in p
    (p,) = _problems(make_config, pm, "parallel.tp=4", "trainer.seq_len=30")
    assert "trainer.seq_len=30: sequence parallelism" in p and "parallel.sequence_parallel=false" in p
    assert _problems(make_config, pm, "parallel.tp=4", "trainer.seq_len=30", "parallel.sequence_parallel=false") == []
    (p,) = _problems(make_config, pm, "parallel.tp=4", "model.vocab_pad_to=6")
    assert "model.vocab_pad_to=6 must be a positive multiple of parallel.tp=4" in p


def test_unknown_backend_lists_choices(make_config, pm):
    (p,) = _problems(make_config, pm, "comm.backend=carrier-pigeon")
    assert "comm.backend='carrier-pigeon'" in p and "torch" in p and "gloo" in p


def test_per_axis_backend_must_name_an_axis(make_config, pm):
    (p,) = _problems(make_config, pm, "+comm.per_axis.xx=torch")
    assert "'xx' is not a mesh axis" in p


def test_missing_data_file(make_config, pm):
    (p,) = _problems(make_config, pm, "data=tokens", "data.path=/nonexistent/train.bin")
    assert "data.path=/nonexistent/train.bin does not exist" in p and "hpctrain-prepare" in p


def test_seq_len_and_precision(make_config, pm):
    ps = _problems(make_config, pm, "trainer.seq_len=1024", "trainer.precision=fp8")
    assert any("exceeds model.max_seq_len=256" in p for p in ps)
    assert any("trainer.precision='fp8'" in p for p in ps)


def test_checkpointing_needs_its_format_plugin(make_config, pm):
    ps = _problems(make_config, pm, "checkpoint.every=5", "checkpoint.format=nosuchformat")
    assert any("checkpoint.format='nosuchformat'" in p for p in ps)


def test_unknown_attention_and_ffn(make_config, pm):
    ps = _problems(make_config, pm, "model.attention=ring", "model.ffn=nosuchffn")
    assert any("model.attention='ring' is unknown" in p for p in ps)
    assert any("model.ffn='nosuchffn' is unknown" in p for p in ps)


def test_plugin_validation_hook_runs(make_config, pm):
    from hpctrain import hookimpl

    class Strict:
        @hookimpl
        def hpctrain_validate(self, cfg, world_size):
            return [f"strict plugin: world size {world_size} is odd"] if world_size % 2 else None

    pm.register(Strict())
    assert validate(make_config("trainer.global_batch_size=12"), 3, pm) == ["strict plugin: world size 3 is odd"]
    assert validate(make_config(), 4, pm) == []


def test_batch_smaller_than_one_micro_batch_per_rank(make_config, pm):
    (p,) = _problems(make_config, pm, "trainer.global_batch_size=4", "trainer.micro_batch_size=2")
    assert "use a multiple of 8 (e.g. 8 or 16)" in p


def test_a_layout_reports_every_violation_at_once(make_config, pm):
    """At 8 ranks, a five-axis layout wrong in seven ways: one line for each,
    core and plugins alike, each with its fix (not only the first)."""
    problems = _problems(make_config, pm, "model=tiny-moe", "model.n_layers=2", "trainer.seq_len=34",
                         "parallel.tp=3", "parallel.cp=2", "parallel.ep=3", "parallel.pp=3", "parallel.zero.stage=2",
                         "model.recompute=sometimes", world=8)
    expected = [
        "world size 8 is not divisible by tp(3) * cp(2) * ep(3) * pp(3) = 54",  # no dp fills the world
        "parallel.tp=3 does not divide model.n_heads=4",           # tensor parallelism: heads
        "parallel.tp=3 and model.n_kv_heads=2",                    # ... key/value heads
        "trainer.seq_len=34 is not divisible by 2 x parallel.cp = 4",  # context parallelism's zigzag chunks
        "model.recompute='sometimes' is not one of none, selective, full",
        "parallel.ep=3 does not divide model.moe.num_experts=4",   # the MoE plugin
    ]
    for want in expected:
        assert sum(want in p for p in problems) == 1, (want, problems)
    # the pipeline plugin: 2 blocks on 3 stages
    assert any("model.n_layers=2" in p and "3" in p for p in problems), problems
    for p in problems:
        assert " use " in p or " set " in p or " choose " in p or "one of" in p or "launch" in p, p
