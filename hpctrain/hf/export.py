"""Write a Hugging Face model directory: ``config.json``, ``generation_config.json``
and the weights as safetensors shards of at most a chosen size with their
index (``model.safetensors.index.json``; one ``model.safetensors`` when it
fits), through the ``safetensors`` library, as ``save_pretrained`` lays it
out; ``transformers.AutoModelForCausalLM.from_pretrained`` loads it with no
missing or unexpected keys (tests/unit/hf/test_hf_export.py).

The checkpoint format gives the tensors by logical name and shape, and a
function that reads one (``Entry``): the plan (which tensor goes to which
shard) is made from the shapes alone, then each shard is read and written
in turn, so at most one shard is held in memory. Our stacked experts become
one tensor per expert and q/k rows go to rotate_half order
(``hpctrain.hf.names``). The vocabulary is the logical one: tensor
parallelism's padding is never in a checkpoint.

The architecture follows the model: MoE blocks -> MixtralForCausalLM (a
softmax router with top-k >= 2 renormalised, in every block, no shared
experts: what Mixtral computes), or with qk-norm Qwen3MoeForCausalLM (a
softmax router, its ``norm_topk_prob``, MoE every ``decoder_sparse_step``-th
block with dense ones of ``intermediate_size`` between and the first
``model.moe.first_dense_blocks`` dense (``mlp_only_layers``), experts of
``moe_intermediate_size``, no shared experts); latent attention -> DeepseekV3ForCausalLM (with MoE blocks:
the sigmoid router, its selection bias written as ``e_score_correction_bias`` from the checkpoint's buffers,
groups, scaling and shared experts; ``model.mtp_depth`` multi-token prediction modules as DeepSeek's extra layers
``model.layers.<num_hidden_layers + k>`` with ``num_nextn_predict_layers``, ``hpctrain.hf.names``: transformers'
DeepseekV3ForCausalLM leaves them out of its forward, its ``MtpModel`` reads them; other architectures have no
place for them and refuse them); q/k/v biases
(``model.qkv_bias``) -> Qwen2ForCausalLM;
qk-norm (``model.qk_norm``) -> Qwen3ForCausalLM (without biases: its
``attention_bias`` would put one on o_proj too); otherwise LlamaForCausalLM
(a Mistral without a sliding window is a Llama). Both options together, or
with experts, have no architecture and are refused in one line. RoPE is
written in the spelling published checkpoints use (``rope_theta``,
``rope_scaling``), which every transformers reads; Qwen's sliding window is
written off.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from hpctrain.data.indexed import prefix_of, read_description
from hpctrain.errors import ConfigError
from hpctrain.hf.names import hf_tensor, moe_family, mtp_copies, rope_row_permutation
from hpctrain.hf.weights import INDEX, SINGLE
from hpctrain.model.shapes import ModelShape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size as transformers spells it (``5GB`` = 5e9, ``500MiB``, a plain number of bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(text).upper())
    if m is None:
        raise ConfigError(f"--max-shard-size={text!r} is not a size; give e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


_Planned = Tuple["Entry", str, Callable[[torch.Tensor], torch.Tensor]]
"""One Hugging Face tensor of a shard: its entry, its name, how to take it from the entry's tensor."""


@dataclass
class Entry:
    """One logical tensor to export."""

    logical: str
    shape: Tuple[int, ...]
    read: Callable[[], torch.Tensor]
    """The whole logical tensor (called once, when its shard is written)."""


def _architecture(model: Any) -> str:
    s = ModelShape.from_config(model)
    depth = int(model.get("mtp_depth", 0) or 0)
    if depth and s.mla is None:
        raise ConfigError(f"model.mtp_depth={depth}: only DeepseekV3ForCausalLM (latent attention, "
                          "model.attention_kind=mla) has multi-token prediction layers; export a model trained with "
                          "mtp_depth=0")
    if s.mla is not None:
        if model.ffn == "moe":
            _deepseek_v3_moe_problems(model.moe)
        elif depth:
            raise ConfigError(f"model.mtp_depth={depth} with every block dense: DeepSeek-V3's multi-token prediction "
                              "layers are MoE layers (transformers' MtpModel builds them so); export a model with "
                              "MoE blocks (model.ffn=moe) or trained with mtp_depth=0")
        return "DeepseekV3ForCausalLM"
    if model.ffn != "moe":
        if s.qkv_bias and s.qk_norm:
            raise ConfigError("this model has no Hugging Face architecture: model.qkv_bias=true with "
                              "model.qk_norm=true (Qwen2 has q/k/v biases without qk-norm; Qwen3 qk-norm, and "
                              "biases on o_proj too when it has any)")
        return "Qwen2ForCausalLM" if s.qkv_bias else "Qwen3ForCausalLM" if s.qk_norm else "LlamaForCausalLM"
    moe = model.moe
    if moe_family(model) == "qwen3_moe":
        return _qwen3_moe_architecture(s, moe)
    problems = []
    if s.qkv_bias:
        problems.append("model.qkv_bias=true (Mixtral has no biases; Qwen3-MoE: qk-norm without them)")
    if moe.router != "softmax" or int(moe.top_k) < 2 or not moe.get("norm_topk_prob", True):
        problems.append(f"model.moe.router={moe.router} with top_k={moe.top_k}, norm_topk_prob="
                        f"{str(moe.get('norm_topk_prob', True)).lower()} (Mixtral: softmax, top_k >= 2, renormalised)")
    if int(moe.shared_experts):
        problems.append(f"model.moe.shared_experts={moe.shared_experts} (Mixtral has none)")
    if int(moe.every) != 1 or int(moe.get("first_dense_blocks", 0)):
        problems.append(f"model.moe.every={moe.every}, first_dense_blocks={moe.get('first_dense_blocks', 0)} "
                        "(Mixtral has experts in every block; with dense blocks, set model.qk_norm=true for Qwen3-MoE)")
    if problems:
        raise ConfigError(f"this model has no Hugging Face architecture: {'; '.join(problems)}")
    return "MixtralForCausalLM"


def _deepseek_v3_moe_problems(moe: Any) -> None:
    """Refuse (one line) MoE blocks DeepseekV3ForCausalLM does not compute: it routes with sigmoid scores and
    the expert bias over n_group groups (``hpctrain_moe.router.route``), MoE in every block after the dense ones."""
    problems = []
    if moe.router != "sigmoid":
        problems.append(f"model.moe.router={moe.router} (DeepSeek-V3's is sigmoid)")
    if int(moe.every) != 1:
        problems.append(f"model.moe.every={moe.every} (DeepSeek-V3 has experts in every block after "
                        "first_dense_blocks)")
    if problems:
        raise ConfigError("this model has no Hugging Face architecture: latent attention with MoE blocks is "
                          f"DeepseekV3ForCausalLM, which cannot hold {'; '.join(problems)}")


def _qwen3_moe_architecture(s: ModelShape, moe: Any) -> str:
    problems = []
    if s.qkv_bias:
        problems.append("model.qkv_bias=true (Qwen3-MoE's attention_bias would put one on o_proj too)")
    if moe.router != "softmax":
        problems.append(f"model.moe.router={moe.router} (Qwen3-MoE: softmax)")
    if int(moe.shared_experts):
        problems.append(f"model.moe.shared_experts={moe.shared_experts} (Qwen3-MoE has none)")
    if problems:
        raise ConfigError(f"this model has no Hugging Face architecture: {'; '.join(problems)}")
    return "Qwen3MoeForCausalLM"


MODEL_TYPES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}
"""config.json's model_type of each architecture an export writes."""


def hf_config(model: Any, dtype: str) -> Dict[str, Any]:
    """``config.json`` for ``model`` (our model config section)."""

    s = ModelShape.from_config(model)
    arch = _architecture(model)
    out: Dict[str, Any] = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "hidden_size": s.d_model, "intermediate_size": s.ffn_hidden, "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_kv_heads, "head_dim": s.head_dim, "num_hidden_layers": s.n_layers,
        "vocab_size": s.vocab_size, "rms_norm_eps": float(model.norm_eps), "rope_theta": float(model.rope_theta),
        "max_position_embeddings": int(model.max_seq_len), "tie_word_embeddings": s.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "torch_dtype": dtype, "dtype": dtype,  # transformers 4 reads the first, 5 the second
        "bos_token_id": _plain(model.get("bos_token_id")), "eos_token_id": _plain(model.get("eos_token_id")),
        "pad_token_id": _plain(model.get("pad_token_id")),
    }
    rs = model.get("rope_scaling")
    if rs is not None and rs.type == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": float(rs.factor),
                               "original_max_position_embeddings": int(rs.original_max_seq_len),
                               "beta_fast": float(rs.beta_fast), "beta_slow": float(rs.beta_slow)}
        out["rope_scaling"].update({k: float(rs[k]) for k in ("mscale", "mscale_all_dim") if rs.get(k) is not None})
    elif rs is not None and rs.type is not None:
        out["rope_scaling"] = {"rope_type": str(rs.type), "factor": float(rs.factor),
                               "low_freq_factor": float(rs.low_freq_factor),
                               "high_freq_factor": float(rs.high_freq_factor),
                               "original_max_position_embeddings": int(rs.original_max_seq_len)}
    if arch == "MixtralForCausalLM":
        out.update(num_local_experts=int(model.moe.num_experts), num_experts_per_tok=int(model.moe.top_k),
                   router_aux_loss_coef=float(model.moe.aux_loss_coef), router_jitter_noise=0.0,
                   sliding_window=None, output_router_logits=False,
                   intermediate_size=int(model.moe.get("ffn_hidden") or s.ffn_hidden))  # no dense block
    elif arch == "Qwen3MoeForCausalLM":
        moe = model.moe
        del out["attention_bias"]  # written below, after the fields Qwen3's share
        out.update(num_experts=int(moe.num_experts), num_experts_per_tok=int(moe.top_k),
                   moe_intermediate_size=int(moe.get("ffn_hidden") or s.ffn_hidden),
                   decoder_sparse_step=int(moe.every),
                   mlp_only_layers=[i for i in range(min(int(moe.get("first_dense_blocks", 0)), s.n_layers))
                                    if (i + 1) % int(moe.every) == 0],
                   # top_k=1 keeps its probability here whatever the option (MoEConfig.norm_topk_prob)
                   norm_topk_prob=bool(moe.get("norm_topk_prob", True)) and int(moe.top_k) > 1,
                   router_aux_loss_coef=float(moe.aux_loss_coef), output_router_logits=False,
                   use_sliding_window=False, sliding_window=None, attention_bias=False)
    elif arch == "DeepseekV3ForCausalLM":
        out.update(_deepseek_v3_fields(s))
        if model.ffn == "moe":
            out.update(_deepseek_v3_moe_fields(s, model.moe))
            out["num_nextn_predict_layers"] = int(model.get("mtp_depth", 0) or 0)
        del out["head_dim"]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        del out["attention_bias"]  # Qwen2 has no such field (q/k/v biases always); Qwen3's is written below
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.n_layers)
        if arch == "Qwen3ForCausalLM":
            out["attention_bias"] = False
    else:
        out["mlp_bias"] = False
    return out


def _deepseek_v3_fields(s: ModelShape) -> Dict[str, Any]:
    """DeepseekV3's own fields for a model with latent attention whose layers are all dense (its MoE fields keep
    transformers' defaults, which no layer reads: first_k_dense_replace covers every layer). head_dim is dropped:
    DeepseekV3Config sets it to qk_rope_head_dim."""
    mla = s.mla
    assert mla is not None
    return {"num_key_value_heads": s.n_heads, "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "rope_interleave": True,
            "first_k_dense_replace": s.n_layers, "num_nextn_predict_layers": 0}


def _deepseek_v3_moe_fields(s: ModelShape, moe: Any) -> Dict[str, Any]:
    """DeepseekV3's MoE fields (``hpctrain.hf.config`` reads them back into the same ``model.moe``); the number
    of multi-token prediction layers (``num_nextn_predict_layers``) is ``hf_config``'s, from ``model.mtp_depth``."""
    return {"first_k_dense_replace": int(moe.get("first_dense_blocks", 0)), "n_routed_experts": int(moe.num_experts),
            "num_experts_per_tok": int(moe.top_k), "n_group": int(moe.get("expert_groups", 1)),
            "topk_group": int(moe.get("topk_groups", 1)), "norm_topk_prob": bool(moe.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(moe.get("routed_scaling_factor", 1.0)),
            "n_shared_experts": int(moe.shared_experts),
            "moe_intermediate_size": int(moe.get("ffn_hidden") or s.ffn_hidden)}


def _plain(value: Any) -> Any:
    """An id or a list of ids as plain JSON (OmegaConf lists are not)."""
    if value is None or isinstance(value, int):
        return value
    return [int(v) for v in value]


def generation_config(config: Dict[str, Any]) -> Dict[str, Any]:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _expert(e: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[e]


def hf_tensors(entry: Entry, n_heads: int, n_kv_heads: int, head_dim: Optional[int], num_experts: int,
               family: str = "mixtral") -> List[Tuple[str, Tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]:
    """(Hugging Face name, shape, how to take it from the logical tensor) for one entry (``family``: the MoE
    architecture's names)."""
    found = hf_tensor(entry.logical, n_heads, n_kv_heads, num_experts, family)
    if found is None:
        raise ConfigError(f"{entry.logical} has no Hugging Face name; this model cannot be exported")
    if len(found.names) > 1:
        return [(name, tuple(entry.shape[1:]), _expert(e)) for e, name in enumerate(found.names)]
    if found.rope_heads is not None:
        assert head_dim is not None  # (written for every architecture with q/k rows to permute)
        perm = torch.from_numpy(rope_row_permutation(found.rope_heads, head_dim))
        if entry.shape[0] != found.rope_heads * head_dim:
            raise ConfigError(f"{entry.logical}: {entry.shape[0]} rows is not {found.rope_heads} heads x {head_dim}")
        return [(found.names[0], tuple(entry.shape), lambda t: t[perm])]
    return [(found.names[0], tuple(entry.shape), lambda t: t)]


def check_target(out: str, overwrite: bool = False) -> None:
    """Refuse, before anything is read, an export directory that cannot be made, or one that already
    holds files unless ``overwrite`` (then ``write_hf_dir`` replaces it whole, atomically)."""
    parent = os.path.dirname(os.path.realpath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"export target {out}: its parent directory {parent} does not exist; create it or "
                          "choose another --to")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"export target {out} is a file; --to names a directory (Hugging Face model directory)")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"export target {out} is not empty (it holds {shown}); pass --overwrite to replace the "
                          "whole directory with the export, or choose another --to")


def _staging_dir(out: str) -> str:
    """A new empty directory beside ``out`` (same parent, so the same file system: a rename moves it into
    place), with the mode ``out`` has, or the one ``os.makedirs`` would give."""
    real = os.path.realpath(out)
    stage = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.", suffix=".export", dir=os.path.dirname(real))
    if os.path.isdir(real):
        shutil.copymode(real, stage)
    else:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(stage, 0o777 & ~mask)
    return stage


def _exchange(a: str, b: str) -> bool:
    """Swap directories ``a`` and ``b`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot (the caller then renames twice)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system without the flag
        return False
    raise OSError(code, os.strerror(code), b)


def _replace_dir(stage: str, out: str) -> None:
    """Put the finished export ``stage`` where ``out`` is: a rename when ``out`` is absent or empty; else
    an atomic swap (a reader sees the old directory or the new one, never a mixture), the old one then
    removed. Where the swap is not available: ``out`` renamed aside, ``stage`` renamed in, the old removed."""
    real = os.path.realpath(out)
    if not os.path.isdir(real) or not os.listdir(real):
        os.replace(stage, real)
        return
    if _exchange(stage, real):
        shutil.rmtree(stage)  # now the old directory
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.", suffix=".old", dir=os.path.dirname(real))
    os.replace(real, old)  # onto the empty directory just made
    os.replace(stage, real)
    shutil.rmtree(old)


def data_tokenizer(data: Any) -> Tuple[List[str], Dict[str, Any]]:
    """The tokenizer the run's data names (hpctrain-prepare records it in a manifest or beside each shard):
    (its files to copy, {"bos_token_id", "eos_token_id"} from the description). Nothing for other data."""

    if data is None or data.get("source") != "indexed":
        return [], {}
    paths = list(data.get("paths") or []) + [p for b in (data.get("blend") or []) for p in b.paths]
    for path in paths:
        try:
            meta = read_description(prefix_of(str(path)) if not str(path).endswith(".json") else str(path)[:-5])
        except (OSError, ValueError):
            continue
        tok = (meta or {}).get("tokenizer")
        if not isinstance(tok, dict) or not tok.get("path"):
            continue
        assert meta is not None
        file = str(tok["path"])
        files = [file] + [os.path.join(os.path.dirname(file), n) for n in TOKENIZER_FILES
                          if n != os.path.basename(file)] if tok.get("kind") == "huggingface" else [file]
        ids = {"bos_token_id": meta.get("bos_id"), "eos_token_id": meta.get("eos_id")}
        return files, ids
    return [], {}


def _readable_as_umask_allows(path: str) -> None:
    """safetensors creates its files 0600; give them the mode ``open`` gives config.json (0666 less the
    umask), so that the others on a cluster who may read the directory can load the weights too."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_hf_dir(out: str, model: Any, entries: Iterable[Entry], dtype: str = "float32",
                 max_shard_bytes: int = 5 * 10**9, tokenizer_from: Optional[List[str]] = None,
                 metadata: Optional[Dict[str, str]] = None, token_ids: Optional[Dict[str, Any]] = None,
                 overwrite: bool = False) -> List[str]:
    """Write the Hugging Face directory ``out`` for ``model`` (its config section) from ``entries``;
    returns the files written. ``tokenizer_from``: directories or files whose tokenizer files are copied;
    ``token_ids``: bos/eos ids for the ones the model config does not set (the data's tokenizer).

    The files are written into a new directory beside ``out`` (same parent), which then takes ``out``'s
    place in one rename: a directory that holds files is refused unless ``overwrite``, and then replaced
    whole, so no file of the model it held is left beside the new one (a reader such as transformers'
    ``from_pretrained`` would take a stale ``model.safetensors`` over the new shards' index). A failure
    removes the new directory and leaves ``out`` as it was."""
    check_target(out, overwrite)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype}: choose one of {', '.join(DTYPES)}")
    config = hf_config(model, dtype)
    for key, value in (token_ids or {}).items():
        if config.get(key) is None and value is not None:
            config[key] = value
    n_heads, n_kv, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config.get("head_dim")
    experts = config.get("num_local_experts", config.get("num_experts", config.get("n_routed_experts", 0)))
    family = moe_family(model)
    first_mtp = config["num_hidden_layers"]
    mtp_layers = range(first_mtp, first_mtp + int(config.get("num_nextn_predict_layers", 0)))
    torch_dtype = DTYPES[dtype]
    # the plan: (entry, [(name, shape, take)]) in shards, from the shapes alone
    shards: List[List[_Planned]] = [[]]
    used, total = 0, 0
    for entry in entries:
        planned = hf_tensors(entry, n_heads, n_kv, head_dim, experts, family)
        # DeepSeek-V3's MTP layers keep copies of the shared embedding and head (hpctrain.hf.names.MTP_SHARED)
        planned += [(name, tuple(entry.shape), _same) for name in
                    mtp_copies(entry.logical, mtp_layers, bool(config["tie_word_embeddings"]))]
        for name, shape, take in planned:
            nbytes = int(torch.Size(shape).numel()) * torch_dtype.itemsize
            if shards[-1] and used + nbytes > max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append((entry, name, take))
            used += nbytes
            total += nbytes
    files = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    stage = _staging_dir(out)  # written beside, then moved into place: a failure leaves out as it was
    try:
        written = _write_files(stage, files, shards, torch_dtype, total, config, metadata, tokenizer_from)
        _replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return written


def _write_files(stage: str, files: List[str], shards: List[List[_Planned]], torch_dtype: torch.dtype, total: int,
                 config: Dict[str, Any], metadata: Optional[Dict[str, str]],
                 tokenizer_from: Optional[List[str]]) -> List[str]:
    """Every file of the export, into the (new, empty) directory ``stage``."""
    from safetensors.torch import save_file  # optional: the hf extra

    weight_map: Dict[str, str] = {}
    cached: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)
    for file, shard in zip(files, shards):
        tensors: Dict[str, torch.Tensor] = {}
        for entry, name, take in shard:
            if cached[0] != entry.logical:  # an entry's experts are consecutive: read it once
                cached = (entry.logical, entry.read())
            whole = cached[1]
            assert whole is not None
            if tuple(whole.shape) != tuple(entry.shape):
                raise ConfigError(f"{entry.logical}: stored as {list(whole.shape)}, expected {list(entry.shape)}")
            tensors[name] = take(whole).to(torch_dtype, copy=True).contiguous()  # a copy: experts are views
            weight_map[name] = file
        save_file(tensors, os.path.join(stage, file), metadata={"format": "pt", **(metadata or {})})
        _readable_as_umask_allows(os.path.join(stage, file))
    written = list(files)
    if len(files) > 1:
        with open(os.path.join(stage, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(INDEX)
    with open(os.path.join(stage, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(stage, "generation_config.json"), "w") as f:
        json.dump(generation_config(config), f, indent=2)
    written += ["config.json", "generation_config.json"]
    for src in tokenizer_from or []:  # a later source's file replaces an earlier one's of the same name
        for path in ([os.path.join(src, n) for n in TOKENIZER_FILES] if os.path.isdir(src) else [src]):
            if os.path.isfile(path):
                shutil.copy(path, os.path.join(stage, os.path.basename(path)))
                if os.path.basename(path) not in written:
                    written.append(os.path.basename(path))
    return written
