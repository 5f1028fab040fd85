"""Where ``checkpoint.init_from`` takes a run's first weights from.

Every source answers ``hpctrain_weight_source(path, cfg)``: a checkpoint
format's plugin for its own files, the core's ``hpctrain.hf.source`` for
``hf:DIR``. The reader it returns is asked lazily, piece by piece, while the
model is materialised (``hpctrain.model.build.materialize``): each rank
reads only the boxes it holds. The optimizer, step and data start afresh.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from hpctrain.errors import PluginError
from hpctrain.log import log_rank0


class GivenWeights:
    """A weight reader as ``materialize``'s source; ``close`` lets go of its files."""

    def __init__(self, reader: Any):
        self.reader = reader

    def __call__(self, spec: Any, piece_box: Any) -> Optional[torch.Tensor]:
        reader = self.reader
        return reader.box(spec.logical_name, piece_box) if reader.where(spec.logical_name) is not None else None

    def close(self) -> None:
        getattr(self.reader, "close", lambda: None)()


def given_weights(cfg: Any, pm: Any) -> Optional[GivenWeights]:
    """The reader of ``checkpoint.init_from`` (each rank reads its pieces), or None when it is unset."""
    src = cfg.checkpoint.get("init_from")
    if not src:
        return None
    reader = pm.hook.hpctrain_weight_source(path=str(src), cfg=cfg)
    if reader is None:
        raise PluginError(f"checkpoint.init_from={src}: no installed plugin reads it (checkpoint.format="
                          f"{cfg.checkpoint.format}); give hf:DIR or one of our checkpoints")
    log_rank0("weights from checkpoint.init_from=%s (fresh optimizer, step 0, data from its start)", src)
    return GivenWeights(reader)
