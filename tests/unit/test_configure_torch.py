"""``configure_torch``: torch's determinism settings follow the config."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("fill", [False, True])
def test_uninitialized_memory_is_filled_only_when_asked(make_config, fill):
    """Under ``trainer.deterministic`` torch would NaN-fill every new tensor (a write of every
    activation); hpctrain turns that off unless ``debug.fill_uninitialized`` asks for it."""
    from hpctrain.bootstrap import get_runtime
    from hpctrain.run import configure_torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    try:
        configure_torch(make_config(f"debug.fill_uninitialized={str(fill).lower()}"), get_runtime())
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is fill
        new = torch.empty(4096)
        if fill:  # a read of memory never written shows
            assert bool(new.isnan().all())
    finally:
        from hpctrain import eager

        eager.prepare()  # torch's own optimizer steps and marks back (configure_torch deferred them)
        torch.use_deterministic_algorithms(before[0], warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
