"""Divergence is caught (``reliability.*``): a non-finite loss or gradient
norm stops the run before the update (or, with ``skip``, drops the update
and stops after ``max_skips`` in a row); weights stay finite; metrics.jsonl
stays JSON; loss spikes are flagged. ``optim.lr=1e6`` makes the tiny model's
gradient norm NaN at step 2."""
from __future__ import annotations

import json
import math

import pytest
import torch

from hpctrain.errors import TrainingDiverged
from hpctrain.train.guard import LossSpikes, NonFiniteGuard

DIVERGING = ("optim.lr=1e6", "trainer.steps=6", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
             "trainer.seq_len=32", "trainer.progress=off", "trainer.log_every=100")


def test_guard_policies():
    stop = NonFiniteGuard("stop", 3)
    assert stop.update_allowed(1, 2.0, 1.0)
    with pytest.raises(TrainingDiverged, match="step 2: loss nan"):
        stop.update_allowed(2, math.nan, 1.0)
    skip = NonFiniteGuard("skip", 2)
    assert not skip.update_allowed(1, 1.0, math.inf)
    assert skip.update_allowed(2, 1.0, 1.0) and skip.in_a_row == 0  # a finite step resets the count
    assert not skip.update_allowed(3, math.nan, 1.0)
    with pytest.raises(TrainingDiverged, match="2 steps in a row"):
        skip.update_allowed(4, math.nan, 1.0)
    assert skip.skipped == 3


def test_loss_spikes():
    spikes = LossSpikes(window=10, zscore=4.0)
    flagged = [spikes.check(3.0 + 0.01 * (i % 3)) for i in range(10)]
    assert flagged == [None] * 10
    assert spikes.check(3.5) is not None and spikes.check(3.01) is None
    assert spikes.check(math.nan) is None


def _trainer(pm, *extra, run_dir=None):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    return reference_trainer(compose_resolved(DIVERGING + extra, pm), pm, run_dir)


def _finite(trainer) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_stop_ends_the_run_before_the_update(pm):
    trainer = _trainer(pm)
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(TrainingDiverged, match=r"step 2: .*gradient norm nan.*reliability.nonfinite=stop"):
        trainer.train_step()
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters())) and _finite(trainer)


def test_skip_drops_updates_then_stops_and_metrics_stay_json(pm, tmp_path):
    trainer = _trainer(pm, "reliability.nonfinite=skip", "reliability.max_skips=3", run_dir=str(tmp_path))
    with pytest.raises(TrainingDiverged, match="3 steps in a row"):
        trainer.fit()
    assert _finite(trainer) and trainer.guard.skipped == 3

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")
    rows = [json.loads(line, parse_constant=no_constants)
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the step that stopped the run is not logged
    assert rows[1]["grad_norm"] is None and rows[2]["skipped_steps"] == 2
