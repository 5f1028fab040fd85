import pytest
import torch

from hpctrain.shard import ShardSpec, get_spec, replicated_spec, set_spec


def test_replicated_spec_covers_whole_tensor():
    s = replicated_spec("w", (4, 6))
    assert s.local_slices({"tp": 1}, {"tp": 2}) == (slice(0, 4), slice(0, 6))
    assert s.is_replicated("tp") and s.split_axes == ()


def test_split_over_one_axis():
    s = replicated_spec("w", (4, 6)).with_split(1, "tp")
    assert s.local_shape({"tp": 0}, {"tp": 3}) == (4, 2)
    assert s.local_slices({"tp": 2}, {"tp": 3}) == (slice(0, 4), slice(4, 6))
    assert not s.is_replicated("tp") and s.is_replicated("dp")


def test_split_over_two_axes_outermost_first():
    s = replicated_spec("w", (8,)).with_split(0, "dp", "tp")
    sizes = {"dp": 2, "tp": 2}
    got = [s.local_slices({"dp": d, "tp": t}, sizes)[0] for d in range(2) for t in range(2)]
    assert got == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]


def test_shards_tile_the_logical_tensor():
    full = torch.arange(24).reshape(4, 6)
    s = replicated_spec("w", (4, 6)).with_split(0, "pp").with_split(1, "tp")
    sizes = {"pp": 2, "tp": 3}
    seen = torch.zeros_like(full)
    for p in range(2):
        for t in range(3):
            sl = s.local_slices({"pp": p, "tp": t}, sizes)
            seen[sl] += 1
    assert torch.all(seen == 1)


def test_indivisible_split_is_an_error():
    s = replicated_spec("w", (5,)).with_split(0, "tp")
    with pytest.raises(ValueError, match="not divisible"):
        s.local_slices({"tp": 0}, {"tp": 2})


def test_double_split_of_a_dim_is_an_error():
    with pytest.raises(ValueError, match="already split"):
        replicated_spec("w", (4,)).with_split(0, "tp").with_split(0, "dp")


def test_spec_attaches_to_parameters():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(AttributeError):
        get_spec(p)
    spec = set_spec(p, ShardSpec("x", (2,)))
    assert get_spec(p) is spec
