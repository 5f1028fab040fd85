"""``trainer.elastic``: what it changes in the config before validation."""
from hpctrain.train.elastic import adapt


def test_elastic_recomputes_dp_and_caps_the_local_copies(make_config):
    cfg = make_config("trainer.elastic=true", "parallel.dp=4", "checkpoint.local.every=3",
                      "checkpoint.local.replicas=1")
    notes = adapt(cfg, 2, 1)
    assert cfg.parallel.dp == -1 and cfg.checkpoint.local.replicas == 0
    assert notes == ["trainer.elastic=true: parallel.dp=4 is recomputed from the world size (2 ranks)",
                     "trainer.elastic=true: checkpoint.local.replicas=1 lowered to 0: 1 node(s) remain"]


def test_without_elastic_nothing_changes(make_config):
    cfg = make_config("parallel.dp=4", "checkpoint.local.every=3", "checkpoint.local.replicas=1")
    assert adapt(cfg, 2, 1) == [] and cfg.parallel.dp == 4 and cfg.checkpoint.local.replicas == 1
