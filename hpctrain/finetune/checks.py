"""LoRA's settings checked before any collective (``hpctrain.config.validate``)."""
from __future__ import annotations

from typing import Any, List

from hpctrain.errors import ConfigError
from hpctrain.finetune.lora import lora_config
from hpctrain.model.build import build_model


def lora_problems(cfg: Any, pm: Any) -> List[str]:
    """Validation before any collective: with ``finetune=lora``, the targets name a projection of this model
    (built on the meta device, nothing allocated)."""
    if lora_config(cfg) is None:
        return []
    try:
        build_model(cfg, pm)
    except ConfigError as e:
        return [str(e)] if "finetune.lora" in str(e) else []
    except Exception:  # noqa: BLE001 (a model config the other checks reject: they say why)
        return []
    return []
