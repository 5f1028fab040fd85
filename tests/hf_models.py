"""Tiny Hugging Face models made inside the tests (nothing downloaded), saved with
``save_pretrained`` as transformers writes real checkpoints, and their own forward.

Shapes: GQA 4:1 (8 query heads, 2 key/value heads), head size 8, two or
four layers; Llama 3.1 rope scaling with an original context of 16 tokens,
so that sequences of 32 cross all three bands of its frequencies.
"""
from __future__ import annotations

from typing import Optional

import torch

VOCAB = 300  # >= 256: the embedded byte-level corpus trains it
SEQ = 32
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def _common(vocab: int, layers: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama_config(tie: bool = False, vocab: int = VOCAB, layers: int = 2, rope: Optional[dict] = None):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(vocab, layers), tie_word_embeddings=tie,
                       rope_parameters=dict(LLAMA3_ROPE if rope is None else rope))


def mixtral_config(vocab: int = VOCAB, layers: int = 2):
    from transformers import MixtralConfig

    return MixtralConfig(**_common(vocab, layers), num_local_experts=4, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=None)


def save(config, path, seed: int = 0, max_shard_size: Optional[str] = None) -> str:
    """A randomly initialised model of ``config`` saved to ``path`` (sharded with ``max_shard_size``).
    Norm weights and biases are drawn too (transformers inits them to 1 and 0, which would hide a
    norm or bias mix-up)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.1, 0.1)  # as large as the projections' outputs: larger ones make q.k mostly bias,
                # and the attention weights' gradients small sums of large terms (fp32's noise past 1e-6 of them)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward of the model saved in ``path`` (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def batch(vocab: int = VOCAB, n: int = 2, seq: int = SEQ, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq), generator=g)


def hf_model(path) -> tuple:
    """The overrides that train the Hugging Face model in ``path``: its shape and its weights."""
    return ("model=hf", f"model.hf_dir={path}", f"checkpoint.init_from=hf:{path}")


def imported_config(base: tuple, path, pm, *more: str):
    """The one-process config that trains the model in ``path`` (``hf_model``) on top of ``base``, validated."""
    from hpctrain.config import compose_resolved
    from hpctrain.config.validate import validate

    cfg = compose_resolved(base + hf_model(path) + more, pm)
    assert validate(cfg, 1, pm) == []
    return cfg


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, rtol: float = 1e-5) -> None:
    """Elementwise within ``rtol`` of the largest reference element."""
    scale = theirs.abs().max()
    err = (ours - theirs).abs().max()
    assert err <= rtol * scale, f"max abs difference {err:.3g} > {rtol} x {scale:.3g}"


def assert_logits_equal_transformers(cfg, pm, path) -> None:
    """Our one-process model of ``cfg`` gives transformers' logits for the model in ``path`` (within 1e-5)."""
    from hpctrain.run import reference_trainer

    ids = batch()
    model = reference_trainer(cfg, pm).model
    model.eval()
    with torch.no_grad():
        ours = model(ids)
    theirs = hf_logits(path, ids)
    assert ours.shape == theirs.shape
    assert_close(ours, theirs)


def assert_export_loads_with_our_logits(out, model: torch.nn.Module, source, ignored: Optional[str] = None) -> None:
    """transformers loads the export in ``out`` with no missing or unexpected keys and gives the logits of our
    trained ``model``, which training moved away from the Hugging Face model it started from (``source``).
    ``ignored``: a name prefix whose tensors transformers' model leaves out (DeepSeek-V3's multi-token prediction
    layers): the unexpected keys are those and only those."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager",
                                                    output_loading_info=True)
    unexpected = info["unexpected_keys"]
    assert not info["missing_keys"], info
    assert (not unexpected) if ignored is None else (unexpected and all(k.startswith(ignored) for k in unexpected)), \
        info
    ids = batch()
    model.eval()
    with torch.no_grad():
        want = model(ids)
        got = hf.eval()(ids).logits
    assert_close(got, want)
    assert (got - hf_logits(source, ids)).abs().max() > 1e-3  # two steps changed the model


def export_adapter_loads_in_peft(ckpt, base, out, ours: torch.Tensor, adapted: int) -> dict:
    """``hpctrain-ckpt export --adapter out`` of the LoRA checkpoint ``ckpt``; peft loads it onto transformers'
    model in ``base`` with ``adapted`` trained B matrices (every one loaded, none left at zero) and gives our
    logits ``ours`` of ``batch()`` (within 1e-5), which the adapters change. Returns adapter_config.json."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpctrain_h5ckpt import cli

    assert cli.main(["export", str(ckpt), "--adapter", str(out)]) == 0
    config = json.load(open(f"{out}/adapter_config.json"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(model, str(out))
    peft_model.eval()
    loaded = dict(peft_model.named_parameters())
    assert sum(".lora_B." in n for n in loaded) == adapted
    assert all(p.abs().max() > 0 for n, p in loaded.items() if ".lora_B." in n)  # every B loaded, none missed
    with torch.no_grad():
        theirs = peft_model(batch()).logits
    assert_close(ours, theirs)
    with torch.no_grad(), peft_model.disable_adapter():
        assert float((peft_model(batch()).logits - theirs).abs().max()) > 1e-3  # the adapters matter
    return config


def merged_export_gives(ckpt, out, ours: torch.Tensor) -> None:
    """``hpctrain-ckpt export --to out --merge`` of the LoRA checkpoint ``ckpt`` computes our logits ``ours``."""
    from hpctrain_h5ckpt import cli

    assert cli.main(["export", str(ckpt), "--to", str(out), "--merge"]) == 0
    assert_close(ours, hf_logits(out, batch()))
