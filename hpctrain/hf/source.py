"""``checkpoint.init_from=hf:DIR``: the core's own ``hpctrain_weight_source``.

Registered by the plugin manager as the built-in plugin ``hf``
(``hpctrain.plugins.create_manager``), so a Hugging Face directory is one
weight source among the checkpoint formats' (``hpctrain.weights``), asked
the same way: it answers paths that start with ``hf:`` and declines the
rest.
"""
from __future__ import annotations

from typing import Any, Optional

from hpctrain.hf import PREFIX
from hpctrain.hookspecs import hookimpl

NAME = "hf"
"""The built-in plugin's name (``hpctrain-train --plugins``)."""


@hookimpl
def hpctrain_weight_source(path: str, cfg: Any) -> Optional[Any]:
    if not str(path).startswith(PREFIX):
        return None
    from hpctrain.hf.weights import hf_weights_for  # heavy (torch, numpy): not at the manager's start-up

    return hf_weights_for(cfg)
