"""Which optimizer rule a tensor gets, decided from its logical name and shape.

The decision is made on the ShardSpec (the logical tensor), never on the
local shape, so a flat ZeRO shard of a matrix is treated as the matrix.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Sequence

from hpctrain.shard import ShardSpec

OPTIMIZERS = ("adamw", "lamb", "lars", "muon")
"""Values of ``optim.name``."""

ADAPTATION_KINDS = ("norm", "bias", "embedding")
"""What ``optim.exclude_from_adaptation`` may name (LAMB, LARS)."""


def decays(spec: ShardSpec) -> bool:
    """Weight decay on matrices and embeddings (logical rank >= 2), not norms or biases (AdamW's rule)."""
    return len(spec.global_shape) >= 2


def kind_of(spec: ShardSpec) -> str:
    """``embedding`` (the token table), ``bias``, ``norm`` (other 1-D tensors), or ``matrix``."""
    name = spec.logical_name
    if name.startswith("tok_embeddings.") or ".tok_embeddings." in name:
        return "embedding"
    if name.endswith(".bias") or name == "bias":
        return "bias"
    if len(spec.global_shape) < 2:
        return "norm"
    return "matrix"


def adapted(spec: ShardSpec, excluded: Iterable[str]) -> bool:
    """LAMB/LARS: whether the tensor's update is scaled by its trust ratio
    (an excluded kind keeps ratio 1, as the papers' implementations exclude
    norms, biases and embeddings)."""
    return kind_of(spec) not in set(excluded)


def muon_matrix(spec: ShardSpec, adamw_patterns: Sequence[str]) -> bool:
    """Muon: a hidden matrix (logical rank >= 2: a stack of experts is a batch of matrices)
    whose logical name matches none of ``adamw_patterns`` (the embedding and the head by default)."""
    if len(spec.global_shape) < 2:
        return False
    return not any(fnmatch.fnmatchcase(spec.logical_name, pat) for pat in adamw_patterns)


def state_bytes_per_element(name: str, muon_share: float = 1.0) -> float:
    """Bytes of fp32 optimizer state per parameter element: AdamW and LAMB
    keep two moments (8), LARS one momentum (4), Muon one momentum on its
    matrices and AdamW's two moments on the rest (``muon_share``: the
    fraction of the elements in Muon's matrices). A plugin's optimizer
    (any other name; validation has checked that a plugin serves it) is
    counted as AdamW: its state is not known before it is made, and the
    memory estimates that use this figure are estimates."""
    if name == "lars":
        return 4.0
    if name == "muon":
        return 4.0 * muon_share + 8.0 * (1.0 - muon_share)
    return 8.0
