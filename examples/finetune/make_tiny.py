"""A tiny Llama, a tokenizer with a chat template and chat JSONL (train and held-out), all made here:
the inputs of docs/finetune.md's walk-through, nothing downloaded.

    python examples/finetune/make_tiny.py OUT_DIR [--hidden 64] [--layers 2]
writes OUT_DIR/model (config.json, model.safetensors, the tokenizer) and OUT_DIR/{train,heldout}.jsonl.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

# ChatML; {% generation %} marks the assistant's tokens for transformers' return_assistant_tokens_mask
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
WORDS = "red green blue cat dog bird one two three sun moon star tree river stone".split()


def conversation(rng: random.Random) -> dict:
    """A question about a list of words and its answer: learnable, so the held-out loss falls."""
    words = rng.sample(WORDS, rng.randint(2, 5))
    ask = rng.choice(["reverse", "count", "first"])
    answer = {"reverse": " ".join(reversed(words)), "count": str(len(words)), "first": words[0]}[ask]
    return {"messages": [{"role": "system", "content": "You answer briefly."},
                         {"role": "user", "content": f"{ask}: {' '.join(words)}"},
                         {"role": "assistant", "content": answer}]}


def tokenizer(directory: Path, texts: list):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    return fast


def model(directory: Path, vocab: int, hidden: int, layers: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=3, eos_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="tiny-finetune")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    root = Path(args.out)
    (root / "model").mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    rows = [conversation(rng) for _ in range(2200)]
    for name, part in (("train", rows[:2000]), ("heldout", rows[2000:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    texts = [m["content"] for r in rows for m in r["messages"]]
    fast = tokenizer(root / "model", texts)
    model(root / "model", len(fast), args.hidden, args.layers)
    print(f"{root}/model: Llama, {args.layers} layers, width {args.hidden}, vocab {len(fast)}; "
          f"{root}/train.jsonl 2000, {root}/heldout.jsonl 200 conversations")


if __name__ == "__main__":
    main()
