"""LoRA's settings checked before any collective (``hpctrain.config.validate``)."""
from __future__ import annotations

from typing import Any, List

from hpctrain.errors import ConfigError
from hpctrain.finetune.lora import DOWN_TARGETS, lora_config
from hpctrain.model.build import build_model


def lora_problems(cfg: Any, pm: Any) -> List[str]:
    """Validation before any collective: with ``finetune=lora``, the targets name a projection of this model
    (built on the meta device, nothing allocated); dropout on latent attention's down-projections needs
    sequence parallelism under tp (``_down_dropout_problem``)."""
    lora = lora_config(cfg)
    if lora is None:
        return []
    down = _down_dropout_problem(cfg, lora)
    if down:
        return [down]
    try:
        build_model(cfg, pm)
    except ConfigError as e:
        return [str(e)] if "finetune.lora" in str(e) else []
    except Exception:  # noqa: BLE001 (a model config the other checks reject: they say why)
        return []
    return []


def _down_dropout_problem(cfg: Any, lora: Any) -> str:
    """Latent attention's down-projections (targets q_a, kv_a) are whole on every tp rank (``hpctrain_tp.latent``).
    Without sequence parallelism every rank computes the same tokens' update with a dropout mask it drew itself,
    equal on every rank only while their generators stay in step (nothing enforces it): replicas of these
    adapters whose masks differed would drift apart. With it each rank masks its own tokens."""
    chosen = [t for t in lora.targets if t in DOWN_TARGETS]
    tp = int(cfg.parallel.get("tp", 1) or 1)
    if (float(lora.dropout) == 0 or not chosen or tp == 1 or bool(cfg.parallel.get("sequence_parallel", True))
            or cfg.model.get("attention_kind", "gqa") != "mla"):
        return ""
    return (f"finetune.lora.dropout={float(lora.dropout)} on latent attention's down-projections "
            f"({','.join(chosen)}) at parallel.tp={tp} without sequence parallelism: they are whole on every tp "
            "rank, each drawing its own mask of the same tokens, and replicas whose masks differ drift apart; "
            "set parallel.sequence_parallel=true, "
            f"finetune.lora.dropout=0, or leave {','.join(chosen)} out of finetune.lora.targets")
