"""Pipeline-parallel plugin: ``parallel.pp`` stages, scheduled by
``parallel.pipeline.schedule`` (gpipe, 1f1b, interleaved, zb-h1).

``hpctrain_parallelize(axis="pp")`` runs after tp, cp and ep on the meta
model: rank r keeps the blocks of its virtual stages r, r + p, ... (one
chunk each, ``Transformer.part``: the first stage also holds the
embedding, the last the final norm, the output and the loss), and every
parameter's ShardSpec records that only pp coordinate r holds it (tied
embeddings: the first and the last). Its handle (``Pipeline``) gives the
trainer the step runner (``executor.PipelineRunner``) for the rank's program
(``hpctrain.pipeline.schedules.actions``) and, after training, gathers the
last step's timeline (``parallel.pipeline.timeline``) into the run
directory.

Validation, before any collective: the schedule can run with the step's
micro-batches (m = global batch / (micro-batch x dp x ep) >= pp; a
multiple of pp for interleaved) and the blocks split as asked.

Tied embeddings: the first and last stage each hold a copy; the core's
``finalize_grads`` sums their gradients after the data axes' reduction,
whoever reduces those (plain data parallelism or ZeRO's shards).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from torch import nn

from hpctrain import hookimpl
from hpctrain.config import plugin_section
from hpctrain.config.validate import resolve_sizes
from hpctrain.errors import ConfigError
from hpctrain.log import log_rank0
from hpctrain.mesh import Mesh
from hpctrain.model.transformer import Transformer
from hpctrain.parallel.handles import PipelineHandle
from hpctrain.parallel.tokens import token_placement
from hpctrain.pipeline.bubble import formula_bubble
from hpctrain.pipeline.schedules import check, check_busy
from hpctrain.pipeline.split import model_end_cost, stage_layers
from hpctrain.shard import get_spec, set_spec

from hpctrain_pp import timeline
from hpctrain_pp.config import PipelineConfig
from hpctrain_pp.executor import PipelineRunner

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.train.state import TrainState


class PipelineChunks(nn.Module):
    """A rank's model chunks under the interleaved schedule (virtual stages r, r + p, ...)."""

    def __init__(self, chunks: List[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


def pipeline_config(cfg: Any) -> PipelineConfig:
    return plugin_section(cfg, "parallel.pipeline", PipelineConfig)


def microbatches_per_step(cfg: Any, world_size: int) -> Optional[int]:
    try:
        sizes = resolve_sizes({a: cfg.parallel[a] for a in ("tp", "cp", "ep", "dp", "pp")}, world_size,
                              cfg.parallel.order)
    except ConfigError:
        return None  # the core reports the layout
    t = cfg.trainer
    return t.global_batch_size // (t.micro_batch_size * sizes["dp"] * sizes["ep"])


@hookimpl
def hpctrain_capabilities() -> Dict[str, List[str]]:
    return {"parallel": ["pp"], "pipeline.schedule": ["gpipe", "1f1b", "interleaved", "zb-h1"]}


@hookimpl
def hpctrain_config_sections() -> Dict[str, type]:
    return {"parallel.pipeline": PipelineConfig}


@hookimpl
def hpctrain_validate(cfg: Any, world_size: int) -> Optional[List[str]]:
    pp = cfg.parallel.pp
    pc = pipeline_config(cfg)
    if pp == 1:
        return None if pc.vpp == 1 else [f"parallel.pipeline.vpp={pc.vpp} needs parallel.pp > 1"]
    problems = []
    m = microbatches_per_step(cfg, world_size)
    if m is not None:
        why = check(pc.schedule, pp, pc.vpp, m)
        if why:
            problems.append(why)
        elif check_busy(pp, m):
            problems.append(check_busy(pp, m))
    try:
        stage_layers(pc.layers, cfg.model.n_layers, pp * pc.vpp)
    except ValueError as e:
        problems.append(str(e))
    return problems or None


class Pipeline(PipelineHandle):
    """This rank's stage(s), the runner that runs them, and its timeline."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Any):
        super().__init__(model)
        self.mesh, self.cfg = mesh, cfg
        self.runner: Optional[PipelineRunner] = None
        """The step runner, once made (``step_runner``)."""

    def step_runner(self) -> PipelineRunner:
        cfg, mesh = self.cfg, self.mesh
        pc = pipeline_config(cfg)
        # where a block's tokens live across tp (the core's rule): a stage sends its share of each sequence
        split = token_placement(mesh, bool(cfg.parallel.sequence_parallel)).split
        per_token = split.size if split is not None else 1
        d_model = cfg.model.d_model

        def hidden(tokens):  # (micro-batch, this rank's tokens) -> the residual stream between stages
            return (tokens.shape[0], tokens.shape[1] // per_token, d_model)

        self.runner = PipelineRunner(pc.schedule, mesh.group("pp"), pc.vpp, hidden, timeline.Recorder(pc.timeline))
        return self.runner

    def timeline(self, num_microbatches: int, run_dir: Optional[str], log: bool = True
                 ) -> Optional[timeline.PipelineTimeline]:
        """Gather the last step's pipeline timeline (a collective over each pp
        group); world rank 0 writes the trace and the picture into ``run_dir``
        and logs the measured bubble. None when there is nothing recorded."""
        runner = self.runner
        if runner is None or not runner.recorder.enabled or not runner.recorder.times:
            return None
        tl = timeline.gather(runner.recorder, runner.schedule, runner.group, runner.v, num_microbatches)
        if self.mesh.world_rank == 0 and (log or run_dir):
            theory = formula_bubble(tl.schedule, tl.p, tl.v, tl.m)
            where = ""
            if run_dir:
                json_path, png_path = timeline.write(tl, run_dir)
                where = f"; {json_path} (Chrome trace), {png_path}"
            log_rank0("pipeline timeline (last step): measured bubble %.3f, theory %.3f (%s, p=%d, v=%d, m=%d)%s",
                      tl.bubble(), theory, tl.schedule, tl.p, tl.v, tl.m, where)
        return tl

    def after_training(self, state: "TrainState") -> None:
        self.timeline(state.cursor.num_microbatches, state.run_dir)


@hookimpl
def hpctrain_parallelize(model: nn.Module, mesh: Mesh, cfg: Any) -> Optional[Pipeline]:
    assert isinstance(model, Transformer)  # the core model, cut into stages here
    pc = pipeline_config(cfg)
    p, v, r = mesh.size("pp"), pc.vpp, mesh.coords["pp"]
    stages = p * v
    # auto: the split the planner assumes (end stages' embedding and head counted, hpctrain.pipeline.split)
    layers = stage_layers(pc.layers, model.shape.n_layers, stages, model_end_cost(model.shape))
    # the last stage holds the embedding too when the head is tied to it or multi-token prediction shares it
    tied = model.shape.tie_embeddings or model.mtp is not None
    chunks: List[nn.Module] = []
    for c in range(v):
        s = c * p + r
        chunks.append(model.part(layers[s], first=s == 0, last=s == stages - 1))
    seen = set()
    for chunk in chunks:
        for prm in chunk.parameters():
            if id(prm) in seen:
                continue
            seen.add(id(prm))
            spec = get_spec(prm)
            holders = (0, p - 1) if tied and spec.logical_name == "tok_embeddings.weight" else (r,)
            set_spec(prm, spec.on("pp", holders))
    log_rank0("pipeline: pp=%d, schedule %s%s, blocks per stage %s", p, pc.schedule,
              f" (vpp {v})" if v > 1 else "", [len(x) for x in layers])
    return Pipeline(chunks[0] if v == 1 else PipelineChunks(chunks), mesh, cfg)


@hookimpl
def hpctrain_benchmarks() -> Dict[str, str]:
    return {"pp": "hpctrain_pp.bench"}
