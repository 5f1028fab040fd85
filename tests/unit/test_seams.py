"""The seams later plugins need exist and are used: replaceable attention and
feed-forward, lifecycle hooks around the step (finished gradients, the
update), metrics. (The axes' seams, the handles of ``hpctrain.parallel``,
are exercised by the multi-rank tests and the example plugins.)"""
from hpctrain import hookimpl
from hpctrain.model.attention import SdpaAttention
from hpctrain.model.transformer import SwiGLU
from hpctrain.parallel.handles import LocalData
from hpctrain.run import reference_run


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
            import dataclasses

            from hpctrain.model.shapes import ModelShape

            self.ffn_layers.append(layer_index)
            shape = ModelShape.from_config(cfg.model)
            return SwiGLU(dataclasses.replace(shape, ffn_hidden=2 * shape.ffn_hidden))
        return None

    @hookimpl
    def hpctrain_on_train_start(self, state):
        self.events.append(("start", type(state.optimizer).__name__))

    @hookimpl
    def hpctrain_after_finalize_grads(self, state, step):
        params = [p for p in state.model.parameters() if p.requires_grad]
        self.events.append(("finalized", step, state.step + 1 == step and all(p.grad is not None for p in params)))

    @hookimpl
    def hpctrain_after_optimizer_step(self, state, step):
        self.events.append(("updated", step))

    @hookimpl
    def hpctrain_on_step_end(self, state, step, metrics):
        self.events.append(("step", step))

    @hookimpl
    def hpctrain_on_train_end(self, state, metrics):
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
    assert rec.events[0] == ("start", "AdamW")
    assert rec.events[1:] == [("finalized", 1, True), ("updated", 1), ("step", 1),
                              ("finalized", 2, True), ("updated", 2), ("step", 2), ("end", 2)]


class SeamRecorder:
    """Records what the newer seams hand a plugin."""

    def __init__(self):
        self.seen = {}

    @hookimpl
    def hpctrain_make_module(self, kind, name, cfg, layer_index, mesh):
        self.seen.setdefault("module_mesh", []).append(mesh)

    @hookimpl
    def hpctrain_step_metrics(self, state, step, metrics):
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
    # one process: no axis to implement, the data handle reduces nothing, the core's AdamW
    assert trainer.parallel.handles == {} and isinstance(trainer.data_handle, LocalData)
    assert all(p.device.type != "meta" for p in trainer.model.parameters())
    assert type(trainer.optimizer).__name__ == "AdamW"
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["seams.step_twice"] for r in rows] == [2.0, 4.0]


def test_a_step_metric_may_not_replace_a_core_metric(pm, make_config):
    import pytest

    from hpctrain.errors import PluginError
    from hpctrain.run import reference_trainer

    class Clobber:
        @hookimpl
        def hpctrain_step_metrics(self, state, step, metrics):
            return {"loss": 0.0}

    pm.register(Clobber(), name="clobber")
    trainer = reference_trainer(make_config("trainer.steps=1", "trainer.global_batch_size=2",
                                            "trainer.micro_batch_size=2"), pm)
    with pytest.raises(PluginError, match="plugin 'clobber': its hpctrain_step_metrics returned 'loss', which is "
                                          "already a metric"):
        trainer.train_step()
