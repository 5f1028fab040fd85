"""Which plugin implements an axis is decided by the config, never by the
order plugins were installed in: ``parallel.impl.<axis>`` names it, or the
only plugin serving the axis is used; two candidates without a choice is an
error naming both, found by validation before any collective."""
import pytest
import torch

from hpctrain import hookimpl
from hpctrain.comm.protocol import LocalCommunicator
from hpctrain.config.validate import validate
from hpctrain.errors import PluginError
from hpctrain.mesh import Mesh
from hpctrain.parallel.handles import AxisHandle
from hpctrain.plugins import axis_plugin, axis_plugins, parallelize_caller


@pytest.fixture(autouse=True)
def without_builtin_tp(pm):
    """The stubs below stand in for tensor-parallel plugins: take the built-in
    one out of each test's (fresh) manager so they are the only candidates."""
    if pm.get_plugin("tp") is not None:
        pm.unregister(name="tp")
    return pm


class TensorParallelStub:
    """Claims axis tp and records that it was asked; leaves the model as it is."""

    def __init__(self, tag):
        self.tag, self.asked = tag, []

    @hookimpl
    def hpctrain_capabilities(self):
        return {"parallel": ["tp"]}

    @hookimpl
    def hpctrain_parallelize(self, model, axis, mesh, cfg):
        if axis != "tp":
            return None
        self.asked.append(axis)
        handle = AxisHandle(model)
        handle.chosen_by = self.tag
        return handle


def test_one_plugin_serving_an_axis_is_used_without_a_choice(pm, make_config):
    pm.register(TensorParallelStub("a"), name="tp_a")
    assert axis_plugins(pm)["tp"] == ["tp_a"]
    assert axis_plugin(pm, make_config(), "tp") == "tp_a"
    pm.unregister(name="cp")
    assert axis_plugin(pm, make_config(), "cp") is None  # no plugin serves it


def test_two_plugins_without_a_choice_is_an_error_naming_both(pm, make_config):
    pm.register(TensorParallelStub("a"), name="tp_a")
    pm.register(TensorParallelStub("b"), name="tp_b")
    with pytest.raises(PluginError, match="'tp_a' and 'tp_b' both parallelise axis 'tp'.*parallel.impl.tp="):
        axis_plugin(pm, make_config(), "tp")
    problems = validate(make_config("parallel.tp=2"), 2, pm)
    assert any("both parallelise axis 'tp'" in p for p in problems)
    assert validate(make_config("parallel.tp=2", "parallel.impl.tp=tp_b"), 2, pm) == []


def test_a_choice_that_serves_nothing_names_the_options(pm, make_config):
    pm.register(TensorParallelStub("a"), name="tp_a")
    with pytest.raises(PluginError, match="parallel.impl.tp='nope' is not an installed plugin.*tp_a"):
        axis_plugin(pm, make_config("parallel.impl.tp=nope"), "tp")
    with pytest.raises(Exception, match="impl.xx"):  # not an axis: rejected when the config is composed
        make_config("parallel.impl.xx=dp")


def test_only_the_chosen_plugin_is_asked(pm, make_config):
    """Registered last, ``b`` would answer first under firstresult; the choice says ``a``."""
    from hpctrain.train.trainer import Trainer

    a, b = TensorParallelStub("a"), TensorParallelStub("b")
    pm.register(a, name="tp_a")
    pm.register(b, name="tp_b")
    out = parallelize_caller(pm, "tp_a")(model=torch.nn.Linear(2, 2), axis="tp", mesh=None, cfg=None, run_dir=None)
    assert out.chosen_by == "a" and b.asked == []
    # through the trainer's set-up (a 2-rank layout in one process: local stand-in communicators)
    cfg = make_config("parallel.tp=2", "parallel.impl.tp=tp_b", "trainer.global_batch_size=2",
                      "trainer.micro_batch_size=1")
    mesh = Mesh({"tp": 2}, world_rank=0, world_size=2)
    mesh.attach_backends(lambda group: LocalCommunicator())
    trainer = Trainer(cfg, mesh, pm, torch.device("cpu"))
    assert trainer.parallel.handles["tp"].chosen_by == "b" and a.asked == ["tp"] and b.asked == ["tp"]


def test_ep_of_a_dense_model_is_a_data_axis(pm, make_config):
    """The MoE plugin serves ep but declines it for a model without experts."""
    assert "moe" in axis_plugins(pm).get("ep", [])
    dense = make_config("parallel.ep=2", "parallel.dp=2")
    assert axis_plugin(pm, dense, "ep") is None
    assert axis_plugin(pm, make_config("parallel.ep=2", "model=tiny-moe"), "ep") == "moe"
    assert validate(make_config("parallel.ep=2", "parallel.dp=2", "trainer.global_batch_size=8",
                                "trainer.micro_batch_size=2"), 4, pm) == []
    problems = validate(make_config("parallel.ep=2", "parallel.dp=2", "trainer.global_batch_size=6",
                                    "trainer.micro_batch_size=1"), 4, pm)
    assert any("not divisible by dp(2) x ep(2) x trainer.micro_batch_size(1) = 4" in p for p in problems)


class ClaimingStub(TensorParallelStub):
    """Wants tp only when the config asks for its flavour (model.name == its tag here)."""

    @hookimpl
    def hpctrain_claim_axis(self, axis, cfg):
        if axis != "tp":
            return None
        return cfg.model.name == self.tag


def test_a_claim_from_the_config_picks_the_plugin(pm, make_config):
    """How parallel.zero.stage=3 selects ZeRO over plain DP without parallel.impl.dp."""
    pm.register(TensorParallelStub("plain"), name="tp_plain")
    pm.register(ClaimingStub("fancy"), name="tp_fancy")
    assert axis_plugin(pm, make_config("model.name=fancy"), "tp") == "tp_fancy"   # True beats no opinion
    assert axis_plugin(pm, make_config("model.name=tiny"), "tp") == "tp_plain"    # False steps aside
    assert axis_plugin(pm, make_config("model.name=fancy", "parallel.impl.tp=tp_plain"), "tp") == "tp_plain"
    pm.register(ClaimingStub("fancy"), name="tp_fancy2")
    with pytest.raises(PluginError, match="'tp_fancy' and 'tp_fancy2' both claim axis 'tp'"):
        axis_plugin(pm, make_config("model.name=fancy"), "tp")
