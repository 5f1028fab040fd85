"""Hugging Face directories that cannot be trained here are refused by validation,
before any collective, with one line naming the field or file and the fix:
the bad-config table (``test_bad_inputs.py``) for rows that need a model
directory on disk. Each row damages a good tiny model (made and saved in the
test) and says what the line must hold; the good model passes
(``test_a_good_model_passes``), so every row fails for its damage alone. The
export target whose parent does not exist is the row of the export command.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from deepseek_models import YARN, deepseek_config, deepseek_moe_config
from qwen_models import qwen2_config, qwen3_config, qwen3_moe_config

from hpctrain.config.validate import validate

from hf_models import llama_config, mixtral_config, save


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    return {"llama": save(llama_config(), d / "llama"), "mixtral": save(mixtral_config(), d / "mixtral"),
            "sharded": save(llama_config(), d / "sharded", max_shard_size="100KB"),
            "qwen2": save(qwen2_config(), d / "qwen2"), "qwen3": save(qwen3_config(), d / "qwen3"),
            "qwen3_moe": save(qwen3_moe_config(), d / "qwen3_moe"), "deepseek_v3": save(deepseek_config(), d / "ds"),
            "deepseek_v3_moe": save(deepseek_moe_config(), d / "ds_moe")}


def _copy(models, tmp_path, which="llama"):
    path = str(tmp_path / which)
    shutil.copytree(models[which], path)
    return path


def _edit(path, **fields):
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    data.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)


def _rows():
    def field(which="llama", **fields):
        def make(models, tmp_path):
            path = _copy(models, tmp_path, which)
            _edit(path, **fields)
            return path
        return make
    return [
        ("another_architecture", field(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
         ["architecture 'GPT2LMHeadModel' is not supported", "LlamaForCausalLM"]),
        ("attention_bias", field(attention_bias=True), ["attention_bias=True", "not implemented"]),
        ("mlp_bias", field(mlp_bias=True), ["mlp_bias=True"]),
        ("sliding_window", field(sliding_window=16), ["sliding_window=16 is not implemented", "trainer.seq_len <= 16"]),
        ("qk_norm", field(use_qk_norm=True), ["use_qk_norm=True (qk-norm)"]),
        ("another_rope_type", field(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
         ["rope_scaling type 'yarn' is not implemented"]),
        ("legacy_rope_scaling",
         field(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2}),
         ["rope_scaling type 'linear' is not implemented"]),
        ("another_activation", field(hidden_act="gelu"), ["hidden_act='gelu' is not implemented"]),
        ("odd_head_dim", field(head_dim=7), ["head_dim=7 is not an even number (RoPE rotates pairs"]),
        ("qwen3_attention_bias", field("qwen3", attention_bias=True),
         ["attention_bias=True (Qwen3: biases on q/k/v and on o_proj) is not implemented"]),
        ("qwen_sliding_window_by_layer_types",
         field("qwen2", use_sliding_window=True, sliding_window=16,
               layer_types=["full_attention", "sliding_attention"]),
         ["use_sliding_window=true with sliding_window=16 on layers 1-1 (layer_types) is not implemented",
          "trainer.seq_len <= 16"]),
        ("qwen_sliding_window_by_max_window_layers",
         field("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None),
         ["use_sliding_window=true with sliding_window=16 on layers 0-1 (max_window_layers=0) is not implemented"]),
        ("qwen_layer_type", field("qwen3", layer_types=["full_attention", "chunked_attention"]),
         ["layer_types holds chunked_attention, which is not implemented"]),
        ("qwen3_yarn_rope", field("qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                             "original_max_position_embeddings": 32}),
         ["rope_scaling type 'yarn' is not implemented"]),
        ("router_jitter", field("mixtral", router_jitter_noise=0.1), ["router_jitter_noise=0.1 is not implemented"]),
        ("mixtral_one_expert", field("mixtral", num_experts_per_tok=1),
         ["num_experts_per_tok=1 (Mixtral renormalises the one expert's weight to 1.0) is not implemented"]),
        ("qwen3_moe_mlp_only_layers", field("qwen3_moe", mlp_only_layers=[1]),
         ["mlp_only_layers=[1] makes layers [1] dense after MoE layer 0, which is not implemented",
          "model.moe.first_dense_blocks", "decoder_sparse_step=1"]),
        ("qwen3_moe_mlp_only_layers_all", field("qwen3_moe", mlp_only_layers=[0, 1]),
         ["mlp_only_layers=[0, 1] leaves no MoE layer (decoder_sparse_step=1)"]),
        ("qwen3_moe_norm_topk_prob_top1", field("qwen3_moe", norm_topk_prob=True, num_experts_per_tok=1),
         ["norm_topk_prob=true with num_experts_per_tok=1 (every weight 1.0) is not implemented"]),
        ("qwen3_moe_no_experts", field("qwen3_moe", num_local_experts=0),
         ["num_experts=0 (no MoE block) is not implemented; a dense Qwen3 is Qwen3ForCausalLM"]),
        ("qwen3_moe_attention_bias", field("qwen3_moe", attention_bias=True),
         ["attention_bias=True (biases on q/k/v and on o_proj) is not implemented"]),
        ("qwen3_moe_sliding_window", field("qwen3_moe", use_sliding_window=True, sliding_window=16),
         ["use_sliding_window=true with sliding_window=16 is not implemented", "trainer.seq_len <= 16"]),
        ("deepseek_v3_rope_type", field("deepseek_v3", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 1e4}),
         ["rope_scaling type 'linear' is not implemented (only llama3, yarn and the default)"]),
        ("deepseek_v3_yarn_attention_factor", field("deepseek_v3", rope_parameters={**YARN, "attention_factor": 1.5}),
         ["rope_scaling attention_factor=1.5 is not implemented"]),
        ("deepseek_v3_yarn_truncate", field("deepseek_v3", rope_parameters={**YARN, "truncate": False}),
         ["rope_scaling truncate=false is not implemented"]),
        ("deepseek_v3_rope_interleave", field("deepseek_v3", rope_interleave=False),
         ["rope_interleave=false (rotate_half on the rotary dims) is not implemented"]),
        ("deepseek_v3_attention_bias", field("deepseek_v3", attention_bias=True),
         ["attention_bias=True (biases on q_a_proj, kv_a_proj_with_mqa and o_proj) is not implemented"]),
        ("deepseek_v3_kv_heads", field("deepseek_v3", num_key_value_heads=2),
         ["num_key_value_heads=2 != num_attention_heads=4 is not implemented"]),
        ("no_config_json", lambda models, tmp_path: _unlink(_copy(models, tmp_path), "config.json"),
         ["has no config.json"]),
        ("missing_shard", lambda models, tmp_path: _unlink(_copy(models, tmp_path, "sharded"),
                                                           "model-00002-of-00005.safetensors"),
         ["shard model-00002-of-00005.safetensors named by model.safetensors.index.json is missing"]),
        ("no_weights", lambda models, tmp_path: _unlink(_copy(models, tmp_path), "model.safetensors"),
         ["has neither model.safetensors nor model.safetensors.index.json"]),
        ("tensor_of_the_wrong_shape", _wrong_shape,
         ["a tensor of the wrong shape: model.layers.1.mlp.up_proj.weight is [95, 64], the model needs [96, 64]",
          "/config.json, which does not describe these weights: the directory is damaged or mixed from two models; "
          "download or copy it again"]),
        ("tensor_missing", _missing_tensor, ["lacks model.layers.0.self_attn.v_proj.weight",
                                             "/config.json, which does not describe these weights"]),
        ("truncated_weights", lambda models, tmp_path: _cut(_copy(models, tmp_path), "model.safetensors", -100),
         ["/model.safetensors is truncated: ", "bytes, but its header places tensor data up to byte ",
          "download or copy it again"]),
        ("truncated_in_the_header", lambda models, tmp_path: _cut(_copy(models, tmp_path), "model.safetensors", 4),
         ["/model.safetensors is truncated: 4 bytes, less than a safetensors header's 8-byte length"]),
        ("truncated_shard", lambda models, tmp_path: _cut(_copy(models, tmp_path, "sharded"),
                                                          "model-00003-of-00005.safetensors", -1),
         ["/model-00003-of-00005.safetensors is truncated: "]),
    ]


def _cut(path, name, size):
    """File ``name`` cut to ``size`` bytes (negative: that many bytes fewer), as an interrupted copy leaves it."""
    file = os.path.join(path, name)
    os.truncate(file, size if size >= 0 else os.path.getsize(file) + size)
    return path


def _unlink(path, name):
    os.remove(os.path.join(path, name))
    return path


def _rewrite(path, change):
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def _wrong_shape(models, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    return _rewrite(_copy(models, tmp_path), lambda t: t.__setitem__(name, t[name][:95].clone()))


def _missing_tensor(models, tmp_path):
    return _rewrite(_copy(models, tmp_path), lambda t: t.pop("model.layers.0.self_attn.v_proj.weight"))


ROWS = _rows()


def _problems(make_config, pm, path):
    return validate(make_config("model=hf", f"model.hf_dir={path}", f"checkpoint.init_from=hf:{path}",
                                "trainer.seq_len=32"), 1, pm)


@pytest.mark.parametrize("name,damage,fragments", ROWS, ids=[r[0] for r in ROWS])
def test_a_bad_model_is_one_line_naming_it(make_config, pm, models, tmp_path, name, damage, fragments):
    path = damage(models, tmp_path)
    problems = _problems(make_config, pm, path)
    assert len(problems) == 1, problems
    [line] = problems
    assert "\n" not in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)


@pytest.mark.parametrize("which", ["llama", "mixtral", "sharded", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3",
                                   "deepseek_v3_moe"])
def test_a_good_model_passes(make_config, pm, models, which):
    assert _problems(make_config, pm, models[which]) == []


def test_a_qwen_sliding_window_no_layer_uses_or_the_sequence_fits_passes(make_config, pm, models, tmp_path):
    """Published Qwen2/Qwen3 configs carry sliding_window with use_sliding_window false, or a window from
    max_window_layers on past the last layer: what transformers computes is then fully causal."""
    for i, (use, window, first) in enumerate([(False, 16, 0), (True, 16, 28), (True, 32, 0)]):
        fields = dict(use_sliding_window=use, sliding_window=window, max_window_layers=first, layer_types=None)
        path = str(tmp_path / f"q{i}")
        shutil.copytree(models["qwen2"], path)
        _edit(path, **fields)
        assert _problems(make_config, pm, path) == [], fields


def test_an_explicit_override_of_the_shape_is_refused_and_of_a_training_choice_kept(make_config, pm, models):
    path = models["mixtral"]
    problems = validate(make_config("model=hf", f"model.hf_dir={path}", "trainer.seq_len=32", "model.n_layers=5",
                                    "model.moe.top_k=1"), 1, pm)
    assert len(problems) == 2, problems
    assert "model.n_layers=5 disagrees with model.hf_dir=" in problems[0] and "drop the override" in problems[0]
    assert problems[1].startswith("model.moe.top_k=1 disagrees"), problems
    cfg = make_config("model=hf", f"model.hf_dir={path}", "trainer.seq_len=32", "model.moe.aux_loss_coef=0.5")
    assert validate(cfg, 1, pm) == [] and cfg.model.moe.aux_loss_coef == 0.5  # a training choice: the user's


def test_weights_of_another_shape_name_the_fix_that_applies(make_config, pm, models):
    """Setting model.hf_dir is suggested only where it is not already the weights' directory (the
    rows above: it is, and the directory itself is at fault)."""
    llama, mixtral = models["llama"], models["mixtral"]
    [line] = validate(make_config(f"checkpoint.init_from=hf:{llama}", "trainer.seq_len=32"), 1, pm)  # model=tiny
    assert line.startswith(f"checkpoint.init_from=hf:{llama}: a tensor of the wrong shape: ")
    assert line.endswith(f"; set model=hf model.hf_dir={llama} so the model takes the directory's shape"), line
    problems = validate(make_config("model=hf", f"model.hf_dir={llama}", f"checkpoint.init_from=hf:{mixtral}",
                                    "trainer.seq_len=32"), 1, pm)
    assert problems and all(p.endswith(f"; the model's shape comes from model.hf_dir={llama}, another directory: set "
                                       f"model.hf_dir={mixtral} too, or init_from the weights of {llama}")
                            for p in problems), problems


def test_a_sliding_window_no_shorter_than_the_sequence_passes(make_config, pm, models, tmp_path):
    path = _copy(models, tmp_path)
    _edit(path, sliding_window=32)
    assert _problems(make_config, pm, path) == []


def test_our_checkpoint_of_another_model_is_one_line(make_config, pm, models, tmp_path):
    """checkpoint.init_from=<one of our checkpoints> saved by another model: the shapes, before any collective."""
    from hpctrain_h5ckpt import cli

    assert cli.main(["import-hf", models["llama"], str(tmp_path / "ck.h5")]) == 0
    problems = validate(make_config(f"checkpoint.init_from={tmp_path / 'ck.h5'}"), 1, pm)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"checkpoint.init_from={tmp_path / 'ck.h5'}: a tensor of the wrong shape: "
                                  "tok_embeddings.weight is [300, 64], the model needs [256, 64]; ")
    assert problems[0].endswith(" more; set the model it was trained with")
    (tmp_path / "not-hdf5").write_text("hello")
    problems = validate(make_config(f"checkpoint.init_from={tmp_path / 'not-hdf5'}"), 1, pm)
    assert problems == [f"checkpoint.init_from={tmp_path / 'not-hdf5'} is neither hf:<Hugging Face directory> nor "
                        "an hpctrain checkpoint (an HDF5 step_*.h5, or a directory holding committed ones)"]
    good = make_config("model=hf", f"model.hf_dir={models['llama']}", f"checkpoint.init_from={tmp_path / 'ck.h5'}",
                       "trainer.seq_len=32")
    assert validate(good, 1, pm) == []


def test_an_export_target_without_its_parent_is_one_line_exit_2(models, tmp_path, capsys):
    from hpctrain_h5ckpt import cli

    assert cli.main(["import-hf", models["llama"], str(tmp_path / "ck.h5")]) == 0
    capsys.readouterr()
    target = tmp_path / "no" / "such" / "out"
    assert cli.main(["export", str(tmp_path / "ck.h5"), "--to", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hpctrain: error: export target {target}: its parent directory {target.parent} does not exist; "
                   "create it or choose another --to"]
    assert not target.parent.exists()
