"""A built-in corpus with learnable structure, generated on the fly (no downloads).

Byte-level text mixing three kinds of lines a small model learns in a few
dozen steps: simple sentences from a fixed grammar, additions with their
results, and counting runs. Deterministic in (seed, size).
"""
from __future__ import annotations

import random

_ADJ = ["quick", "lazy", "small", "bright", "quiet", "large", "red", "old", "young", "cold"]
_NOUN = ["fox", "dog", "cat", "river", "node", "rank", "tensor", "model", "cluster", "bird"]
_VERB = ["sees", "follows", "sends", "trains", "finds", "greets", "reduces", "gathers"]


def _line(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        return (f"the {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} "
                f"the {rng.choice(_ADJ)} {rng.choice(_NOUN)}.")
    if kind < 0.8:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"{a} + {b} = {a + b}."
    start = rng.randrange(90)
    return "count: " + " ".join(str(start + i) for i in range(rng.randrange(3, 9))) + "."


def generate_corpus(num_bytes: int, seed: int) -> bytes:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_bytes:
        line = _line(rng) + "\n"
        parts.append(line)
        size += len(line)
    return "".join(parts).encode("ascii")[:num_bytes]
