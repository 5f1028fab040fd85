import pytest
import torch

from hpctrain.optimizers.adamw import param_groups
from hpctrain.train.lr_schedule import lr_at


class Sched:
    lr, min_lr_ratio, warmup_steps = 1.0, 0.1, 4


def test_warmup_then_cosine_to_floor():
    lrs = [lr_at(s, Sched, 20) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(20, Sched, 20) == pytest.approx(0.1)
    assert lr_at(12, Sched, 20) == pytest.approx(0.55)  # cosine midpoint


def test_decay_only_on_matrices():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(m.parameters(), 0.1)
    assert [p.dim() for p in decay["params"]] == [2]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
