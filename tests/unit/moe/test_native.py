"""The C plan's build: cached per source and compiler, and a plan in torch where it cannot be built."""
from __future__ import annotations

import pytest
import torch

from hpctrain_moe import dispatch as D
from hpctrain_moe import native

N, K, E = 32, 2, 8


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """``native`` as in a new process, its cache in ``tmp_path``."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setenv("HPCTRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path


def _plan():
    g = torch.Generator().manual_seed(3)
    experts = torch.randint(0, E, (N, K), generator=g)
    return D.plan_dispatch(experts, torch.rand(N, K, generator=g), None, E, None)


def test_built_once_into_the_cache(fresh):
    first = native.build()
    assert first.parent == fresh and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # not compiled again
    assert [p.name for p in fresh.iterdir()] == [first.name]  # no partial file left behind
    assert native.library() is not None


@pytest.mark.parametrize("how", ["no compiler", "turned off"])
def test_without_the_c_plan_the_plan_runs_in_torch(fresh, monkeypatch, how):
    with_c = _plan()
    assert native.library() is not None
    monkeypatch.setattr(native, "_tried", False)  # a new process again, with an empty cache
    monkeypatch.setenv("HPCTRAIN_CACHE_DIR", str(fresh / "empty"))
    if how == "no compiler":
        monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    else:
        monkeypatch.setenv("HPCTRAIN_MOE_NATIVE", "0")
    assert native.library() is None
    assert not (fresh / "empty").exists() or not list((fresh / "empty").glob("*.so"))
    in_torch = _plan()
    for field in ("token", "kept_position", "bag_rows", "offsets", "kept_weight"):
        assert torch.equal(getattr(with_c, field), getattr(in_torch, field)), field
    assert with_c.segments == in_torch.segments


def test_the_compiler_python_names_is_used_only_where_it_exists(monkeypatch):
    """A Python built elsewhere may name a compiler this machine lacks: then ``cc``."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.sysconfig, "get_config_var", lambda name: "no-such-cc-here -pthread")
    assert native.compiler() == ["cc"]
    monkeypatch.setattr(native.sysconfig, "get_config_var", lambda name: "sh -pthread")  # (sh: on every PATH)
    assert native.compiler() == ["sh", "-pthread"]
    monkeypatch.setenv("CC", "mycc -O1")
    assert native.compiler() == ["mycc", "-O1"]
