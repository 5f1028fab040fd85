"""The planner's bytes per axis for a run's own config, to set beside what its communicators counted.

The planner (``hpctrain.planner.estimate``) predicts the bytes each GPU puts on
the wire per step and axis for a layout; here the layout is the run's
(sizes, micro-batch, ZeRO stage, recompute, schedule). Bytes do not depend
on the machine, so the cluster is a placeholder of the run's size.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Mapping

from omegaconf import OmegaConf

from hpctrain.pipeline.bubble import NO_PIPELINE
from hpctrain.planner.arch import Arch
from hpctrain.planner.cluster import cluster_spec
from hpctrain.planner.estimate import Workload, estimate
from hpctrain.planner.layouts import Layout
from hpctrain.planner.memory import HPCTRAIN


def predicted_bytes(cfg: Any, sizes: Mapping[str, int]) -> Dict[str, float]:
    """{axis: bus bytes per GPU per step} the planner predicts for ``cfg`` at ``sizes``."""
    world = 1
    for n in sizes.values():
        world *= int(n)
    cluster = cluster_spec(SimpleNamespace(name="run", gpus=world, gpus_per_node=world, gpu_mem_gb=1e6,
                                           peak_tflops=1.0, intra_bw_gbs=1.0, inter_bw_gbs=1.0))
    pp = int(sizes.get("pp", 1))
    pipeline = OmegaConf.select(cfg, "parallel.pipeline", default=None)
    layout = Layout(tp=int(sizes.get("tp", 1)), cp=int(sizes.get("cp", 1)), ep=int(sizes.get("ep", 1)),
                    dp=int(sizes.get("dp", 1)), pp=pp, micro_batch=int(cfg.trainer.micro_batch_size),
                    zero=int(OmegaConf.select(cfg, "parallel.zero.stage", default=0) or 0),
                    recompute=str(cfg.model.recompute),
                    schedule=str(pipeline.schedule) if pp > 1 and pipeline is not None else NO_PIPELINE,
                    vpp=int(pipeline.vpp) if pp > 1 and pipeline is not None else 1)
    work = Workload(int(cfg.trainer.global_batch_size), int(cfg.trainer.seq_len), str(cfg.trainer.precision),
                    HPCTRAIN, float(cfg.comm.bucket_mb) * 2**20)
    return dict(estimate(Arch.from_model_config(cfg.model), layout, work, cluster).comm_bytes)
