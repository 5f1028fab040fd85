"""LoRA adapters out of a checkpoint: as a PEFT adapter, or merged into the base weights.

``write_adapter_dir`` writes what ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the transformers
model of the base (its architecture's names, ``hpctrain.hf.names``: Llama's, DeepseekV3's for latent
attention): ``adapter_config.json`` (LoRA, r, lora_alpha,
lora_dropout, the target modules by their Hugging Face names, ``base_model_name_or_path``: the base the run
fine-tuned, ``base_of``) and ``adapter_model.safetensors`` with PEFT's keys,
``base_model.model.<base projection's name less .weight>.lora_{A,B}.weight``. B's rows of q_proj and k_proj
go to rotate_half order as the base rows do (B's rows are output features; A's are not permuted).

``merged_entries`` turns a checkpoint's tensors into those of the merged model, ``W + (alpha / r) B A`` for
each adapted projection and no adapter tensors, for ``hpctrain.hf.export.write_hf_dir`` (``--merge``).
Both read the logical tensors, so the layout that trained them does not matter.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hpctrain.errors import ConfigError
from hpctrain.finetune.adapter import ADAPTER, is_adapter_name
from hpctrain.hf.export import Entry, _replace_dir, _staging_dir, check_target, hf_tensors
from hpctrain.hf.names import hf_tensor, moe_family
from hpctrain.model.shapes import ModelShape

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's tensor names (PeftModelForCausalLM.base_model (LoraModel).model)."""


def base_of(cfg: Any) -> Optional[str]:
    """The base model a LoRA run fine-tuned: its ``checkpoint.init_from`` (hf:DIR as DIR), else
    ``model.hf_dir``; None when it started from its own init."""
    src = cfg.get("checkpoint", {}).get("init_from") if hasattr(cfg, "get") else None
    if src:
        return str(src)[3:] if str(src).startswith("hf:") else str(src)
    hf_dir = cfg.model.get("hf_dir") if hasattr(cfg.model, "get") else None
    return str(hf_dir) if hf_dir else None


def _base_name(adapter_logical: str) -> str:
    """``layers.0.attn.wq.lora.A`` -> ``layers.0.attn.wq.weight``."""
    return adapter_logical.split(f".{ADAPTER}.")[0] + ".weight"


def _shape(model: Any) -> ModelShape:
    return ModelShape.from_config(model)


def adapter_tensors(model: Any, entries: Sequence[Entry]) -> Dict[str, torch.Tensor]:
    """PEFT's name -> tensor of every adapter among ``entries`` (read whole, fp32)."""
    s = _shape(model)
    family = moe_family(model)  # (the attention's names: DeepseekV3's for latent attention)
    out: Dict[str, torch.Tensor] = {}
    for e in entries:
        if not is_adapter_name(e.logical):
            continue
        base = _base_name(e.logical)
        found = hf_tensor(base, s.n_heads, s.n_kv_heads, family=family)
        if found is None or len(found.names) != 1:
            raise ConfigError(f"{e.logical}: its projection {base} has no Hugging Face name; this adapter cannot "
                              "be exported in the PEFT format")
        stem = PREFIX + found.names[0].removesuffix(".weight")
        if e.logical.endswith(".B"):  # output rows: as the base's (rotate_half order for q/k)
            [(_, _, take)] = hf_tensors(Entry(base, e.shape, e.read), s.n_heads, s.n_kv_heads, s.head_dim, 0,
                                        family)
            out[f"{stem}.lora_B.weight"] = take(e.read()).contiguous()
        else:
            out[f"{stem}.lora_A.weight"] = e.read().contiguous()
    return out


def peft_config(lora: Any, target_modules: List[str], base: Optional[str]) -> Dict[str, Any]:
    """adapter_config.json's content (fields PEFT's LoraConfig reads; the rest take its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora.rank), "lora_alpha": float(lora.alpha),
            "lora_dropout": float(lora.dropout), "target_modules": sorted(target_modules), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base}


def write_adapter_dir(out: str, cfg: Any, entries: Sequence[Entry], overwrite: bool = False) -> List[str]:
    """Write the PEFT adapter of a LoRA run's checkpoint (``cfg``: its resolved config) to ``out``, beside it
    first and then renamed into place (``hpctrain.hf.export.write_hf_dir``'s way); returns the files."""
    from safetensors.torch import save_file  # optional: the hf extra

    lora = _lora(cfg)
    check_target(out, overwrite)
    tensors = adapter_tensors(cfg.model, entries)
    modules = sorted({name.split(".")[-3] for name in tensors})
    stage = _staging_dir(out)
    try:
        save_file(tensors, os.path.join(stage, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(stage, CONFIG), "w") as f:
            json.dump(peft_config(lora, modules, base_of(cfg)), f, indent=2)
        os.chmod(os.path.join(stage, WEIGHTS), os.stat(os.path.join(stage, CONFIG)).st_mode & 0o777)
        _replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return [CONFIG, WEIGHTS]


def _lora(cfg: Any) -> Any:
    finetune = cfg.get("finetune") if hasattr(cfg, "get") else None
    if finetune is None or finetune.get("method") != "lora":
        raise ConfigError("this checkpoint was not trained with finetune=lora: it holds no adapters; export the "
                          "whole model with --to DIR")
    return finetune.lora


def merged_entries(cfg: Any, entries: Sequence[Entry]) -> List[Entry]:
    """The merged model's tensors: each adapted projection ``W + (alpha / r) B A``, no adapter tensors."""
    lora = _lora(cfg)
    scaling = float(lora.alpha) / int(lora.rank)
    by_name = {e.logical: e for e in entries}

    def merged(e: Entry) -> Callable[[], torch.Tensor]:
        stem = e.logical.removesuffix(".weight")
        a, b = by_name[f"{stem}.{ADAPTER}.A"], by_name[f"{stem}.{ADAPTER}.B"]
        return lambda: e.read() + scaling * (b.read().double() @ a.read().double()).to(torch.float32)

    out = []
    for e in entries:
        if is_adapter_name(e.logical):
            continue
        adapted = e.logical.endswith(".weight") and f"{e.logical.removesuffix('.weight')}.{ADAPTER}.A" in by_name
        out.append(Entry(e.logical, e.shape, merged(e)) if adapted else e)
    return out
