"""What every backend checks before any collective: its library is installed."""
from __future__ import annotations

import importlib.util
from typing import Any, List


def missing_library(cfg: Any, backend: str, module: str, extra: str) -> List[str]:
    """[] unless ``backend`` is in ``logging.backends`` and ``module`` cannot be imported."""
    if backend not in cfg.logging.backends or importlib.util.find_spec(module) is not None:
        return []
    return [f"logging.backends includes {backend} but the {module} package is not installed; "
            f"pip install 'hpctrain[{extra}]' (or {module}), or remove {backend} from logging.backends"]
