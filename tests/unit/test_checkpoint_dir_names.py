"""The default checkpoint directory's name must not change between versions
for the same experiment: a job relaunched after an upgrade with
``checkpoint.resume=auto`` would otherwise start again from step 0 in a new
directory. The names below were computed by the code before ``model.head_dim``,
``model.qkv_bias`` and ``model.qk_norm`` existed (commit 665fe90)."""
import pytest

from hpctrain.checkpoint import default_checkpoint_dir

NAMES = {
    (): "tiny-64a7e0a7",
    ("model=tiny-moe",): "tiny-moe-ffcfd88b",
    ("model=llama3-8b",): "llama3-8b-cdb4a9e5",
}


@pytest.mark.parametrize("overrides", list(NAMES), ids=lambda o: o[0] if o else "default")
def test_an_experiment_keeps_its_directory_name(make_config, overrides):
    got = default_checkpoint_dir(make_config(*overrides), "/launch").rsplit("/", 1)[1]
    assert got == NAMES[overrides], (
        f"the default checkpoint directory of {overrides or 'the default config'} is now {got}, not "
        f"{NAMES[overrides]}: a new key in the model, data or optim sections changes every run's name; "
        "add it with its default to hpctrain.checkpoint.LATER_KEYS_AT_DEFAULT")


@pytest.mark.parametrize("change", ["model.qk_norm=true", "model.qkv_bias=true", "model.head_dim=16",
                                    "optim.lr=0.001"])
def test_a_changed_value_is_another_experiment(make_config, change):
    assert default_checkpoint_dir(make_config(change), "/launch") != default_checkpoint_dir(make_config(), "/launch")


@pytest.mark.parametrize("change", ["model.moe.norm_topk_prob=false", "model.moe.ffn_hidden=32"])
def test_a_changed_key_of_a_plugin_section_is_another_experiment(make_config, change):
    """LATER_KEYS_AT_DEFAULT reaches into model.moe: left out at its default only."""
    moe = default_checkpoint_dir(make_config("model=tiny-moe"), "/launch")
    assert default_checkpoint_dir(make_config("model=tiny-moe", change), "/launch") != moe
