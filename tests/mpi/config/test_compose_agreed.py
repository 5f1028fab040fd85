"""``compose_agreed``: rank 0 composes, every rank gets its config or its error."""
import pytest
from omegaconf import OmegaConf

import hpctrain.config.store as store
from hpctrain.config import compose_agreed, compose_resolved
from hpctrain.errors import ConfigError

OVERRIDES = ["model=tiny", "trainer.seed=7", "optim.lr=0.002"]


@pytest.mark.mpi(min_size=2)
def test_every_rank_gets_rank0s_config_and_only_rank0_composes(world, pm, monkeypatch):
    if world.Get_rank() != 0:  # the others must not compose: a composition there fails the test
        def refuse(*_args, **_kwargs):
            raise AssertionError("a rank other than 0 composed the config")
        monkeypatch.setattr(store, "compose_resolved", refuse)
    try:
        cfg = compose_agreed(OVERRIDES, pm, world)
        mine = OmegaConf.to_yaml(cfg, resolve=True)
    except AssertionError as e:  # (every rank reaches the allgather: a failure here fails, never hangs)
        mine = f"failed: {e}"
    everyone = world.allgather(mine)
    monkeypatch.undo()
    assert not any(c.startswith("failed") for c in everyone), everyone
    assert set(everyone) == {mine}
    assert mine == OmegaConf.to_yaml(compose_resolved(OVERRIDES, pm), resolve=True)
    assert cfg.trainer.seed == 7 and cfg.optim.lr == 0.002
    cfg.trainer.seed = 8  # every rank's copy is its own, writable as compose_resolved's is


@pytest.mark.mpi(min_size=2)
def test_a_composition_error_is_the_same_config_error_on_every_rank(world, pm):
    with pytest.raises(ConfigError) as raised:
        compose_agreed(["trainer.no_such_key=1"], pm, world)
    message = str(raised.value)
    assert "trainer.no_such_key" in message
    assert set(world.allgather(message)) == {message}


@pytest.mark.mpi(min_size=2)
def test_an_unexpected_failure_on_rank0_reaches_every_rank(world, pm, monkeypatch):
    def broken(*_args, **_kwargs):
        raise KeyError("the plugin's bug")
    monkeypatch.setattr(store, "compose_resolved", broken)
    if world.Get_rank() == 0:
        with pytest.raises(KeyError):
            compose_agreed(OVERRIDES, pm, world)
    else:
        with pytest.raises(RuntimeError, match="rank 0 could not compose the config: KeyError"):
            compose_agreed(OVERRIDES, pm, world)


@pytest.mark.mpi(min_size=2)
def test_a_config_rank0_cannot_send_fails_on_every_rank(world, pm, monkeypatch):
    """(A plugin value pickle refuses, such as an Enum defined inside a function.)"""
    import pickle

    def refuse(_obj):
        raise pickle.PicklingError("Can't pickle <enum 'Local'>")
    monkeypatch.setattr(store.pickle, "dumps", refuse)
    if world.Get_rank() == 0:
        with pytest.raises(pickle.PicklingError):
            compose_agreed(OVERRIDES, pm, world)
    else:
        with pytest.raises(RuntimeError, match="rank 0 could not compose the config: PicklingError"):
            compose_agreed(OVERRIDES, pm, world)
