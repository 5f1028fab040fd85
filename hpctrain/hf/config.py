"""A Hugging Face ``config.json`` (Llama 2/3/3.1/3.2, Mistral, Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE) as our
model config.

``read_hf_config(dir)`` returns the ``model`` overrides the directory
implies, or the problems: one line per field the model does not implement
(another architecture, Llama's attention or MLP bias, Qwen3's
``attention_bias`` (o_proj too), a sliding window a layer uses and the
sequence reaches, qk-norm outside Qwen3, another RoPE type, another
activation, dropout, router jitter, an odd head size), each naming the field
and what to do. Nothing else of the file matters to the forward (e.g.
``pretraining_tp`` only changes how Meta's code sliced its matmuls).

The families are options of one decoder (``hpctrain.model.transformer``):
Qwen2 is a Llama with biases on q/k/v (``model.qkv_bias``, always on in
transformers' Qwen2, which has no field for it), Qwen3 one with an RMSNorm
over each query and key head before RoPE (``model.qk_norm``). A
``head_dim`` other than hidden_size / num_attention_heads (Qwen3 0.6B, 4B,
32B; Llama 3.2 writes it equal) becomes ``model.head_dim``.

Qwen3-MoE is a Qwen3 whose MoE blocks (``model.ffn=moe``) route with a
softmax over all experts, keep the top k and renormalise them only with
``norm_topk_prob`` (``model.moe.norm_topk_prob``); its experts have their own
width (``moe_intermediate_size`` -> ``model.moe.ffn_hidden``) and the blocks
between MoE blocks (``decoder_sparse_step`` -> ``model.moe.every``) a dense
MLP of ``intermediate_size``. Dense layers named in ``mlp_only_layers`` are
the first blocks (``model.moe.first_dense_blocks``) when they lead the
model, and refused between MoE blocks where ``decoder_sparse_step`` does not
already make them dense;
``router_aux_loss_coef`` becomes the balance loss coefficient (transformers
adds it only with ``output_router_logits``; the logged loss is the
language-model loss either way).

DeepseekV3 (``DeepseekV3ForCausalLM``): multi-head latent attention
(``model.attention_kind=mla``, ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` -> ``model.mla``)
with yarn RoPE scaling as transformers computes it (``hpctrain.model.yarn``);
its layers from ``first_k_dense_replace`` on are MoE blocks (``_deepseek_v3``:
the MoE plugin's sigmoid router with the expert bias, groups and shared experts).

RoPE parameters come in two spellings: transformers 4's top-level
``rope_theta`` + ``rope_scaling`` (what published checkpoints carry) and
transformers 5's ``rope_parameters`` (what ``save_pretrained`` writes now);
both are read.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "DeepseekV3ForCausalLM": "deepseek_v3"}
"""The Hugging Face architectures our decoder computes exactly, with their model_type."""

QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Qwen's windowing fields (use_sliding_window, max_window_layers, layer_types) rule their sliding window."""

_REFUSED_TRUE = {
    "attention_bias": "biases on the attention projections",
    "mlp_bias": "biases on the MLP projections",
    "qk_norm": "qk-norm",
    "use_qk_norm": "qk-norm",
}


def config_path(hf_dir: str) -> str:
    return os.path.join(hf_dir, "config.json")


def load_json(hf_dir: str) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """The parsed config.json of ``hf_dir``, or why not."""
    path = config_path(hf_dir)
    if not os.path.isdir(hf_dir):
        return None, [f"model.hf_dir={hf_dir}: no such directory; give a Hugging Face model directory "
                      "(config.json and *.safetensors)"]
    if not os.path.isfile(path):
        return None, [f"model.hf_dir={hf_dir} has no config.json; give a Hugging Face model directory "
                      "(as save_pretrained or huggingface-cli download writes it)"]
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return None, [f"{path} is not readable JSON ({e}); download or copy it again"]
    if not isinstance(data, dict):
        return None, [f"{path} is not a JSON object; download or copy it again"]
    return data, []


def _rope(data: Dict[str, Any], path: str, yarn: bool = False) -> Tuple[float, Dict[str, Any], List[str]]:
    """(rope_theta, model.rope_scaling overrides, problems); ``yarn``: the architecture's yarn is implemented
    (DeepSeek-V3's, with its softmax mscale)."""
    params = data.get("rope_parameters")
    scaling = data.get("rope_scaling")
    if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
        theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
        scaling = params
    else:
        theta = data.get("rope_theta", 10000.0)
    if not scaling:
        return float(theta), {"type": None}, []
    if not isinstance(scaling, dict):
        return float(theta), {}, [f"{path}: rope_scaling={scaling!r} is not a mapping"]
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), {"type": None}, []
    if kind == "yarn" and yarn:
        return _yarn(float(theta), scaling, path)
    if kind != "llama3":
        return float(theta), {}, [f"{path}: rope_scaling type {kind!r} is not implemented (only llama3"
                                  f"{', yarn' if yarn else ''} and the default); this model cannot be trained here"]
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in scaling]
    if missing:
        return float(theta), {}, [f"{path}: rope_scaling (llama3) lacks {', '.join(missing)}"]
    return float(theta), {"type": "llama3", "factor": float(scaling["factor"]),
                          "low_freq_factor": float(scaling["low_freq_factor"]),
                          "high_freq_factor": float(scaling["high_freq_factor"]),
                          "original_max_seq_len": int(scaling["original_max_position_embeddings"])}, []


def _yarn(theta: float, scaling: Dict[str, Any], path: str) -> Tuple[float, Dict[str, Any], List[str]]:
    """(rope_theta, model.rope_scaling overrides, problems) of yarn scaling (``hpctrain.model.yarn``)."""
    problems = [f"{path}: rope_scaling (yarn) lacks {k}" for k in ("factor", "original_max_position_embeddings")
                if scaling.get(k) is None]
    if scaling.get("attention_factor") is not None:
        problems.append(f"{path}: rope_scaling attention_factor={scaling['attention_factor']} is not implemented "
                        "(yarn's factor here comes from factor, mscale and mscale_all_dim); remove it")
    if scaling.get("truncate", True) is False:
        problems.append(f"{path}: rope_scaling truncate=false is not implemented (yarn's ramp is rounded "
                        "outwards, as DeepSeek-V3's); remove it")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"{path}: rope_scaling partial_rotary_factor={scaling['partial_rotary_factor']} is not "
                        "implemented (RoPE on the whole rotary part)")
    if problems:
        return theta, {}, problems

    def opt(key: str) -> Optional[float]:
        return None if scaling.get(key) is None else float(scaling[key])

    return theta, {"type": "yarn", "factor": float(scaling["factor"]),
                   "original_max_seq_len": int(scaling["original_max_position_embeddings"]),
                   "beta_fast": float(scaling.get("beta_fast") or 32),
                   "beta_slow": float(scaling.get("beta_slow") or 1),
                   "mscale": opt("mscale"), "mscale_all_dim": opt("mscale_all_dim")}, []


def _deepseek_v3(data: Dict[str, Any], path: str) -> Tuple[Dict[str, Any], List[str]]:
    """(``model`` overrides for latent attention and the feed-forward blocks, problems) of a DeepseekV3
    config.json. Its layers from ``first_k_dense_replace`` on are MoE blocks as transformers' DeepseekV3MoE
    computes them, whatever ``topk_method`` and ``scoring_func`` say: sigmoid scores, the top-k of score + the
    expert bias (``e_score_correction_bias``, a buffer: the router's ``expert_bias``) from the ``topk_group``
    best of ``n_group`` groups, weights renormalised with ``norm_topk_prob`` and scaled by
    ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts (``model.moe``)."""
    problems = []
    n_layers = int(data.get("num_hidden_layers") or 0)
    first_dense = int(data.get("first_k_dense_replace") or 0)
    for key, what in (("attention_bias", "biases on q_a_proj, kv_a_proj_with_mqa and o_proj"),
                      ("qk_norm", "qk-norm"), ("mlp_bias", "biases on the MLP projections")):
        if data.get(key):
            problems.append(f"{path}: {key}={data[key]} ({what}) is not implemented; this model cannot be trained "
                            "here")
    if data.get("rope_interleave", True) is False:
        problems.append(f"{path}: rope_interleave=false (rotate_half on the rotary dims) is not implemented; "
                        "DeepSeek's own checkpoints interleave (true)")
    heads, kv = data.get("num_attention_heads"), data.get("num_key_value_heads")
    if kv is not None and kv != heads:
        problems.append(f"{path}: num_key_value_heads={kv} != num_attention_heads={heads} is not implemented "
                        "(latent attention expands keys and values for every head)")
    mla: Dict[str, Any] = {}
    for key, default in (("q_lora_rank", 1536), ("kv_lora_rank", 512), ("qk_nope_head_dim", 128),
                         ("qk_rope_head_dim", 64), ("v_head_dim", 128)):
        value = data.get(key, default)
        if value is None and key == "q_lora_rank":
            mla[key] = None
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            mla[key] = value
        else:
            problems.append(f"{path}: {key}={value!r} is not a positive integer")
    if isinstance(mla.get("qk_rope_head_dim"), int) and mla["qk_rope_head_dim"] % 2:
        problems.append(f"{path}: qk_rope_head_dim={mla['qk_rope_head_dim']} is not even (RoPE rotates pairs)")
    out: Dict[str, Any] = {"attention_kind": "mla", "mla": mla, "head_dim": None, "ffn": "swiglu"}
    if first_dense < n_layers:
        try:
            out.update(ffn="moe", moe={
                "num_experts": int(data.get("n_routed_experts", 256)), "top_k": int(data.get("num_experts_per_tok", 8)),
                "router": "sigmoid", "capacity_factor": None, "shared_experts": int(data.get("n_shared_experts") or 0),
                "every": 1, "aux_loss_coef": 0.0, "z_loss_coef": 0.0,  # (transformers adds no balance loss)
                "ffn_hidden": int(data.get("moe_intermediate_size", 2048)),
                "norm_topk_prob": bool(data.get("norm_topk_prob", True)),
                "expert_groups": int(data.get("n_group") or 1), "topk_groups": int(data.get("topk_group") or 1),
                "routed_scaling_factor": float(data.get("routed_scaling_factor", 2.5)),
                "first_dense_blocks": first_dense})
        except (TypeError, ValueError) as e:
            problems.append(f"{path}: a MoE field is not a number ({e}); download or copy it again")
    return out, problems


def _qwen_window_problems(data: Dict[str, Any], path: str, seq_len: Optional[int]) -> List[str]:
    """Qwen2/Qwen3's sliding window, as transformers applies it: ``sliding_window`` only with
    ``use_sliding_window``, on the layers ``layer_types`` marks sliding_attention (when the file lists them),
    else on the layers from ``max_window_layers`` on. Refused where a layer uses it and a sequence reaches it."""
    n_layers = int(data.get("num_hidden_layers") or 0)
    types = data.get("layer_types")
    if types is not None:
        unknown = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if unknown:
            return [f"{path}: layer_types holds {', '.join(unknown)}, which is not implemented (full_attention only; "
                    "sliding_attention where the sequence fits the window)"]
    window = data.get("sliding_window") if data.get("use_sliding_window", False) else None
    if window is None:
        return []
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        where = "layer_types"
    else:
        first = int(data.get("max_window_layers", 28))
        sliding = list(range(first, n_layers))
        where = f"max_window_layers={first}"
    if not sliding or (seq_len is not None and int(window) >= seq_len):
        return []
    return [f"{path}: use_sliding_window=true with sliding_window={window} on layers {sliding[0]}-{sliding[-1]} "
            f"({where}) is not implemented (attention here is fully causal); use trainer.seq_len <= {window}, where "
            "the window changes nothing"]


def read_hf_config(hf_dir: str, seq_len: Optional[int] = None) -> Tuple[Dict[str, Any], List[str]]:
    """(``model`` overrides, problems) for ``hf_dir``; ``seq_len`` (trainer.seq_len) decides whether a
    sliding window changes anything."""
    data, problems = load_json(hf_dir)
    if data is None:
        return {}, problems
    path = config_path(hf_dir)
    archs = data.get("architectures") or []
    arch = archs[0] if archs else None
    model_type = data.get("model_type")
    if arch not in ARCHITECTURES or (model_type is not None and model_type != ARCHITECTURES[arch]):
        return {}, [f"{path}: architecture {arch or model_type!r} is not supported; hpctrain trains "
                    f"{', '.join(ARCHITECTURES)} (Llama 2/3/3.1/3.2, Mistral, Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE, "
                    "DeepSeek-V3 with dense layers)"]
    latent: Dict[str, Any] = {}  # latent attention's keys (DeepseekV3)
    if arch in QWEN:  # transformers' Qwen2/Qwen3 read neither mlp_bias nor qk_norm; Qwen3's attention_bias is all four
        if arch == "Qwen3ForCausalLM" and data.get("attention_bias"):
            problems.append(f"{path}: attention_bias={data['attention_bias']} (Qwen3: biases on q/k/v and on o_proj) "
                            "is not implemented (only Qwen2's q/k/v biases); this model cannot be trained here")
        problems += _qwen_window_problems(data, path, seq_len)
    elif arch == "DeepseekV3ForCausalLM":
        latent, latent_problems = _deepseek_v3(data, path)
        problems += latent_problems
    elif arch == "Qwen3MoeForCausalLM":  # one window on every layer, with use_sliding_window (off by default)
        if data.get("attention_bias"):
            problems.append(f"{path}: attention_bias={data['attention_bias']} (biases on q/k/v and on o_proj) is "
                            "not implemented; this model cannot be trained here")
        window = data.get("sliding_window") if data.get("use_sliding_window", False) else None
        if window is not None and (seq_len is None or int(window) < seq_len):
            problems.append(f"{path}: use_sliding_window=true with sliding_window={window} is not implemented "
                            f"(attention here is fully causal); use trainer.seq_len <= {window}, where the window "
                            "changes nothing")
    else:
        for key, what in _REFUSED_TRUE.items():
            if data.get(key):
                problems.append(f"{path}: {key}={data[key]} ({what}) is not implemented; this model cannot be "
                                "trained here")
        window = data.get("sliding_window")
        if window is not None and data.get("use_sliding_window", True) and (seq_len is None or int(window) < seq_len):
            problems.append(f"{path}: sliding_window={window} is not implemented (attention here is fully causal); "
                            f"use trainer.seq_len <= {window}, where the window changes nothing")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"{path}: hidden_act={act!r} is not implemented (SwiGLU with silu only)")
    for key in ("attention_dropout", "hidden_dropout"):
        if data.get(key):
            problems.append(f"{path}: {key}={data[key]} is not implemented (no dropout here); set it to 0.0")
    try:
        hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
        kv = int(data.get("num_key_value_heads") or heads)
        out: Dict[str, Any] = {
            "name": f"hf-{os.path.basename(os.path.normpath(hf_dir))}", "vocab_size": int(data["vocab_size"]),
            "d_model": hidden, "n_layers": int(data["num_hidden_layers"]), "n_heads": heads, "n_kv_heads": kv,
            "ffn_hidden": int(data["intermediate_size"]), "norm_eps": float(data.get("rms_norm_eps", 1e-6)),
            "max_seq_len": int(data.get("max_position_embeddings", 2048)),
            "tie_embeddings": bool(data.get("tie_word_embeddings", False)),
            "bos_token_id": data.get("bos_token_id"), "eos_token_id": data.get("eos_token_id"),
            "pad_token_id": data.get("pad_token_id"),
        }
    except (KeyError, TypeError, ValueError) as e:
        return {}, problems + [f"{path}: field {e} is missing or not a number; download or copy it again"]
    head_dim = data.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2):
        problems.append(f"{path}: head_dim={head_dim} is not an even number (RoPE rotates pairs of a head's dims)")
    # a head size other than hidden / heads is model.head_dim; the same one is left implied (null)
    out["head_dim"] = int(head_dim) if isinstance(head_dim, int) and head_dim * heads != hidden else None
    out["qkv_bias"] = arch == "Qwen2ForCausalLM"
    out["qk_norm"] = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    out["attention_kind"] = "gqa"
    out.update(latent)  # (DeepseekV3's head_dim is qk_rope_head_dim, which model.mla holds)
    theta, scaling, rope_problems = _rope(data, path, yarn=arch == "DeepseekV3ForCausalLM")
    problems += rope_problems
    out["rope_theta"] = theta
    out["rope_scaling"] = scaling
    if arch == "MixtralForCausalLM":
        if data.get("router_jitter_noise"):
            problems.append(f"{path}: router_jitter_noise={data['router_jitter_noise']} is not implemented; "
                            "set it to 0.0")
        if int(data.get("num_experts_per_tok", 2)) == 1:  # transformers renormalises its one weight to 1.0
            problems.append(f"{path}: num_experts_per_tok=1 (Mixtral renormalises the one expert's weight to 1.0) "
                            "is not implemented; one expert per token keeps its probability here")
        out["ffn"] = "moe"
        out["moe"] = {"num_experts": int(data.get("num_local_experts", 8)),
                      "top_k": int(data.get("num_experts_per_tok", 2)), "router": "softmax",
                      "capacity_factor": None, "shared_experts": 0, "every": 1,
                      "aux_loss_coef": float(data.get("router_aux_loss_coef", 0.02)), "z_loss_coef": 0.0,
                      "ffn_hidden": None, "norm_topk_prob": True, "first_dense_blocks": 0}
    elif arch == "Qwen3MoeForCausalLM":
        moe, moe_problems = _qwen3_moe(data, path, out["n_layers"])
        problems += moe_problems
        out["ffn"] = "moe"
        out["moe"] = moe
    elif arch != "DeepseekV3ForCausalLM":  # (its ffn and moe came with latent)
        out["ffn"] = "swiglu"
    return out, problems


def _qwen3_moe(data: Dict[str, Any], path: str, n_layers: int) -> Tuple[Dict[str, Any], List[str]]:
    """(``model.moe`` of a Qwen3-MoE config.json, problems). transformers 5 writes the experts' count as
    num_local_experts, published checkpoints (and transformers 4) as num_experts."""
    problems = []
    experts = int(data.get("num_experts", data.get("num_local_experts", 128)) or 0)
    top_k = int(data.get("num_experts_per_tok", 8))
    every = int(data.get("decoder_sparse_step", 1) or 1)
    norm = bool(data.get("norm_topk_prob", False))
    if experts < 1:
        problems.append(f"{path}: num_experts={experts} (no MoE block) is not implemented; a dense Qwen3 is "
                        "Qwen3ForCausalLM")
    if norm and top_k == 1:
        problems.append(f"{path}: norm_topk_prob=true with num_experts_per_tok=1 (every weight 1.0) is not "
                        "implemented; one expert per token keeps its probability here")
    # transformers: MoE where a layer is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; here
    # the dense layers it lists must lead the model (model.moe.first_dense_blocks)
    dense = sorted({int(i) for i in data.get("mlp_only_layers") or []})
    steps = [i for i in range(n_layers) if (i + 1) % every == 0]
    theirs = [i for i in steps if i not in dense]
    first = 0 if theirs == steps else theirs[0] if theirs else n_layers
    inside = sorted(set(dense) & {i for i in steps if i >= first})
    if experts >= 1 and not theirs:
        problems.append(f"{path}: mlp_only_layers={dense} leaves no MoE layer (decoder_sparse_step={every}); a dense "
                        "Qwen3 is Qwen3ForCausalLM")
    elif inside:
        problems.append(f"{path}: mlp_only_layers={dense} makes layers {inside} dense after MoE layer {first}, "
                        "which is not implemented (dense layers only before the first MoE layer, "
                        f"model.moe.first_dense_blocks, or between MoE ones, decoder_sparse_step={every})")
    if data.get("router_jitter_noise"):
        problems.append(f"{path}: router_jitter_noise={data['router_jitter_noise']} is not implemented; set it to 0.0")
    moe = {"num_experts": experts, "top_k": top_k, "router": "softmax", "capacity_factor": None, "shared_experts": 0,
           "every": every, "aux_loss_coef": float(data.get("router_aux_loss_coef", 0.001)), "z_loss_coef": 0.0,
           "ffn_hidden": int(data.get("moe_intermediate_size", 768)), "norm_topk_prob": norm,
           "first_dense_blocks": first}
    return moe, problems


WEIGHT_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qkv_bias", "qk_norm",
               "ffn_hidden", "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings", "ffn", "moe.num_experts",
               "moe.top_k", "moe.router", "moe.shared_experts", "moe.every", "moe.ffn_hidden", "moe.norm_topk_prob",
               "moe.first_dense_blocks", "moe.expert_groups", "moe.topk_groups", "moe.routed_scaling_factor",
               "attention_kind", "mla")
"""``model`` keys the weights and the forward depend on: an explicit override of one that disagrees with the
directory is refused (``hf_model_problems``). The others it fills (name, max_seq_len, the token ids, the MoE
loss coefficients and capacity) an explicit override sets instead: training choices, not the model's shape."""


def _model_value(cfg: Any, key: str) -> Any:
    node: Any = cfg.model
    for part in key.split("."):
        node = node.get(part) if node is not None else None
    return OmegaConf.to_container(node) if OmegaConf.is_config(node) else node


def _flat(overrides: Dict[str, Any]) -> Dict[str, Any]:
    """``{"moe": {"top_k": 2}}`` -> ``{"moe.top_k": 2}`` (sections are set, and compared, key by key)."""
    out: Dict[str, Any] = {}
    for k, v in overrides.items():
        out.update({f"{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {k: v})
    return out


def apply_hf_config(cfg: Any, explicit: Sequence[str] = ()) -> List[str]:
    """Fill ``cfg.model`` from ``model.hf_dir``'s config.json (in place); the problems instead when there
    are any (``cfg`` is then left as it is, and validation reports them). ``explicit``: the ``model.*`` keys
    the command line set, which keep their values (``WEIGHT_KEYS`` that disagree are refused by validation)."""
    hf_dir = cfg.model.get("hf_dir")
    if not hf_dir:
        return []
    overrides, problems = read_hf_config(str(hf_dir), int(cfg.trainer.seq_len))
    if problems:
        return problems
    if overrides.get("ffn") == "moe" and "moe" not in cfg.model:
        return [f"model.hf_dir={hf_dir} is a mixture of experts, but no plugin provides model.ffn=moe (install "
                "hpctrain's moe plugin or unblock it)"]
    kept = {k[len("model."):] for k in explicit if k.startswith("model.")}
    for key, value in _flat(overrides).items():
        if key in kept:
            continue
        head, _, tail = key.partition(".")
        if tail:
            cfg.model[head][tail] = value
        else:
            cfg.model[key] = value
    return []


def hf_model_problems(cfg: Any) -> List[str]:
    """Validation's check of ``model.hf_dir``: the reader's problems (none when the config was filled from it)."""
    hf_dir = cfg.model.get("hf_dir")
    if not hf_dir:
        return ["model=hf needs model.hf_dir=<a Hugging Face model directory>"] if cfg.model.name == "hf" else []
    overrides, problems = read_hf_config(str(hf_dir), int(cfg.trainer.seq_len))
    if problems:
        return problems
    flat = _flat(overrides)
    return [f"model.{key}={_model_value(cfg, key)} disagrees with model.hf_dir={hf_dir}, whose config.json gives "
            f"{value}: the weights fix it; drop the override"
            for key, value in flat.items()
            if (key in WEIGHT_KEYS or key.split(".")[0] in WEIGHT_KEYS) and _model_value(cfg, key) != value]
