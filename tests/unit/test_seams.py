"""The seams later plugins need exist and are used: replaceable attention and
feed-forward, a replaceable step schedule and optimizer, lifecycle hooks."""
import torch

from hpctrain import hookimpl
from hpctrain.model.attention import SdpaAttention
from hpctrain.model.transformer import SwiGLU
from hpctrain.run import reference_run
from hpctrain.train.schedule import GradAccumulation


class CountingAttention(SdpaAttention):
    calls = 0

    def forward(self, q, k, v):
        CountingAttention.calls += 1
        return super().forward(q, k, v)


class Recorder:
    def __init__(self):
        self.events = []
        self.schedule_runs = 0
        self.ffn_layers = []

    @hookimpl
    def hpctrain_capabilities(self):
        return {"model.attention": ["counting"], "model.ffn": ["wide"]}

    @hookimpl
    def hpctrain_make_module(self, kind, name, cfg, layer_index):
        if kind == "attention" and name == "counting":
            return CountingAttention()
        if kind == "ffn" and name == "wide":
            from hpctrain.model.shapes import ModelShape
            import dataclasses

            self.ffn_layers.append(layer_index)
            shape = ModelShape.from_config(cfg.model)
            return SwiGLU(dataclasses.replace(shape, ffn_hidden=2 * shape.ffn_hidden))
        return None

    @hookimpl
    def hpctrain_step_schedule(self, cfg, mesh):
        outer = self

        class Counting(GradAccumulation):
            def run(self, *a, **kw):
                outer.schedule_runs += 1
                return super().run(*a, **kw)

        return Counting()

    @hookimpl
    def hpctrain_make_optimizer(self, params, mesh, cfg):
        return torch.optim.SGD(params, lr=cfg.optim.lr)

    @hookimpl
    def hpctrain_on_train_start(self, trainer):
        self.events.append(("start", type(trainer.optimizer).__name__))

    @hookimpl
    def hpctrain_before_backward(self, model, microbatch, num_microbatches):
        self.events.append(("backward", microbatch, num_microbatches))

    @hookimpl
    def hpctrain_on_step_end(self, trainer, step, metrics):
        self.events.append(("step", step))

    @hookimpl
    def hpctrain_on_train_end(self, trainer, metrics):
        self.events.append(("end", metrics["step"]))


def test_plugin_parts_and_hooks_are_used(pm, make_config):
    rec = Recorder()
    pm.register(rec)
    cfg = make_config("trainer.steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                      "model.attention=counting", "model.ffn=wide")
    CountingAttention.calls = 0
    hist = reference_run(cfg, pm)
    assert len(hist) == 2
    # 2 steps x 2 micro-batches x 2 layers
    assert CountingAttention.calls == 8
    assert rec.ffn_layers == [0, 1]
    assert rec.schedule_runs == 2
    assert rec.events[0] == ("start", "SGD")
    assert [e for e in rec.events if e[0] == "backward"] == [("backward", 0, 2), ("backward", 1, 2)] * 2
    assert [e for e in rec.events if e[0] in ("step", "end")] == [("step", 1), ("step", 2), ("end", 2)]


class SeamRecorder:
    """Records what the newer seams hand a plugin."""

    def __init__(self):
        self.seen = {}

    @hookimpl
    def hpctrain_make_module(self, kind, name, cfg, layer_index, mesh):
        self.seen.setdefault("module_mesh", []).append(mesh)

    @hookimpl
    def hpctrain_after_materialize(self, model, mesh, cfg):
        self.seen["materialized"] = all(p.device.type != "meta" for p in model.parameters())
        self.seen["mesh"] = mesh

    @hookimpl
    def hpctrain_make_optimizer(self, params, model, mesh, cfg):
        self.seen["optimizer_model"] = model
        return None  # the core's AdamW

    @hookimpl
    def hpctrain_step_metrics(self, trainer, step, metrics):
        assert "loss" in metrics and "grad_norm" in metrics
        return {"seams.step_twice": 2.0 * step}


def test_newer_seams_get_the_mesh_the_model_and_add_metrics(pm, make_config, tmp_path):
    import json

    from hpctrain.run import reference_trainer

    rec = SeamRecorder()
    pm.register(rec)
    trainer = reference_trainer(make_config("trainer.steps=2", "trainer.global_batch_size=4",
                                            "trainer.micro_batch_size=2"), pm, run_dir=str(tmp_path))
    assert rec.seen["module_mesh"] == [trainer.mesh] * 4  # attention + ffn, 2 layers
    assert rec.seen["materialized"] and rec.seen["mesh"] is trainer.mesh
    assert rec.seen["optimizer_model"] is trainer.model
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["seams.step_twice"] for r in rows] == [2.0, 4.0]


def test_a_step_metric_may_not_replace_a_core_metric(pm, make_config):
    import pytest

    from hpctrain.errors import PluginError
    from hpctrain.run import reference_trainer

    class Clobber:
        @hookimpl
        def hpctrain_step_metrics(self, trainer, step, metrics):
            return {"loss": 0.0}

    pm.register(Clobber())
    trainer = reference_trainer(make_config("trainer.steps=1", "trainer.global_batch_size=2",
                                            "trainer.micro_batch_size=2"), pm)
    with pytest.raises(PluginError, match="'loss', which is already a metric"):
        trainer.train_step()
