"""``hpctrain-ckpt import-hf DIR OUT.h5``: a Hugging Face directory as one of our checkpoints.

One process builds the model ``model=hf model.hf_dir=DIR`` describes with
``checkpoint.init_from=hf:DIR`` (so the same reader and the same refusals
as a training run) and saves it as a step-0 checkpoint: logical tensors,
loadable at any layout with ``checkpoint.init_from=OUT.h5`` (weights only)
or ``checkpoint.resume=OUT.h5``. The model is held whole in this process
(in fp32); for a model larger than one node's memory, start the training
run from ``hf:DIR`` directly, where each rank reads only its slices.
"""
from __future__ import annotations

import os

from hpctrain.bootstrap import init_runtime
from hpctrain.config import compose_resolved
from hpctrain.config.validate import validate
from hpctrain.errors import ConfigError
from hpctrain.plugins import get_manager
from hpctrain.run import reference_state


def import_hf(hf_dir: str, out: str) -> str:
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"import target {out}: its parent directory {parent} does not exist; create it first")
    init_runtime()
    pm = get_manager()
    cfg = compose_resolved(["model=hf", f"model.hf_dir={os.path.abspath(hf_dir)}",
                            f"checkpoint.init_from=hf:{os.path.abspath(hf_dir)}", f"checkpoint.dir={parent}",
                            "trainer.global_batch_size=1", "trainer.micro_batch_size=1", "trainer.seq_len=8",
                            "data.embedded_bytes=1024"], pm)
    # the placeholder data (never read: no step runs) is byte-level: its check does not concern an import
    problems = [p for p in validate(cfg, 1, pm) if "embedded corpus" not in p]
    if problems:
        raise ConfigError("\n".join(problems))
    state = reference_state(cfg, pm)
    checkpointer = pm.hook.hpctrain_make_checkpointer(name="hdf5", mesh=state.mesh, cfg=cfg, run_dir=None)
    try:
        saved = checkpointer.save(state, os.path.abspath(out))
    finally:
        checkpointer.close()
    return saved
