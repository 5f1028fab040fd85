"""Tiny Qwen2, Qwen3 and Qwen3-MoE models made inside the tests with transformers' own classes (nothing
downloaded), for tests/unit/hf/test_qwen.py, test_qwen_moe.py and tests/mpi/test_qwen.py, test_qwen_moe.py.

Shapes as ``hf_models``: 8 query heads of 8 over a hidden size of 64, 2 key/value heads, vocabulary 300.
``qwen3_config(head_dim=16)`` decouples the head size (8 x 16 = 128 query dims over a hidden size of 64),
as Qwen3 0.6B, 4B and 32B do. ``save`` draws the norm weights (qk-norm's included) and the q/k/v biases
too (biases within +-0.1, the size of the projections' outputs): transformers initialises them to ones and
zeros, which would hide a norm or bias dropped or mixed up.
"""
from __future__ import annotations

from typing import Optional

import torch

from hf_models import VOCAB
from hf_models import save as save  # one way to make a model directory, biases drawn too

ROPE = {"rope_type": "default", "rope_theta": 1000000.0}


def _common(vocab: int, layers: int, tie: bool) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie,
                rope_parameters=dict(ROPE))


def qwen2_config(vocab: int = VOCAB, layers: int = 2, tie: bool = False, **fields):
    from transformers import Qwen2Config

    return Qwen2Config(**{**_common(vocab, layers, tie), **fields})


def qwen3_config(vocab: int = VOCAB, layers: int = 2, tie: bool = False, head_dim: int = 8, **fields):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_common(vocab, layers, tie), "head_dim": head_dim, **fields})


def qwen3_moe_config(vocab: int = VOCAB, layers: int = 2, norm_topk_prob: bool = True, **fields):
    """A Qwen3-MoE: 4 experts of width 32 (``moe_intermediate_size``), top 2, in every block unless
    ``decoder_sparse_step`` says otherwise (the dense blocks between: ``intermediate_size`` 96)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**_common(vocab, layers, False), "head_dim": 8, "num_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "norm_topk_prob": norm_topk_prob, **fields})


def hf_loss(path, ids: torch.Tensor, model: Optional[torch.nn.Module] = None) -> float:
    """transformers' own loss (``labels=``, which it shifts itself) of the model in ``path`` on ``ids``
    (samples of seq_len + 1 tokens, as a global batch holds them)."""
    from transformers import AutoModelForCausalLM

    model = model or AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                          attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)
