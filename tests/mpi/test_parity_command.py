"""``hpctrain-parity`` (``hpctrain.parity_cli``) inside this MPI job: a
correct layout passes (exit 0, "OK"), and a layout whose data-parallel
plugin skips the gradient reduction of one parameter fails (exit 1) with
that parameter named, both as a gradient that differs from one process and
as replicas that disagree. The broken plugin is the real data-parallel
engine attached to every parameter but one."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from hpctrain import grad_sync, hookimpl
from hpctrain.grad_sync.buckets import cap_bytes_from_mb
from hpctrain.parallel.handles import DataHandle
from hpctrain.parity_cli import check, parse_args
from hpctrain.shard import get_spec

SKIPPED = "layers.0.ffn_norm.weight"
ARGS = ["--steps", "2", "trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32",
        "trainer.device=cpu", "trainer.log_every=100", "parallel.tp=2", "parallel.dp=2"]


class SkipsOne(DataHandle):
    """The real data-parallel engine attached to every parameter but ``SKIPPED``."""

    def __init__(self, model: torch.nn.Module, mesh):
        super().__init__(model)
        self.mesh = mesh

    def after_materialize(self) -> None:
        kept = [p for p in self.model.parameters() if p.requires_grad and get_spec(p).logical_name != SKIPPED]
        self.engine = grad_sync.GradSync(grad_sync.reduction_comm(self.mesh),
                                         grad_sync.SyncConfig(cap_bytes=cap_bytes_from_mb(1.0))).attach(kept)

    def before_backward(self, microbatch: int, num_microbatches: int) -> None:
        self.engine.begin_microbatch(microbatch, num_microbatches)

    def reduce_gradients(self) -> None:
        self.engine.finish()


class SkipsOneReduction:
    """Serves axis dp like hpctrain_dp, but never reduces ``SKIPPED``'s gradient."""

    @hookimpl
    def hpctrain_capabilities(self) -> Dict[str, List[str]]:
        return {"parallel": ["dp"]}

    @hookimpl
    def hpctrain_parallelize(self, model: torch.nn.Module, axis: str, mesh, cfg: Any) -> Optional[SkipsOne]:
        return SkipsOne(model, mesh) if axis == "dp" else None


@pytest.mark.mpi(min_size=4)
def test_parity_command_passes_a_correct_layout_and_names_a_broken_one(world, pm, capsys):
    if world.Get_size() != 4:
        pytest.skip("tp 2 x dp 2")
    assert check(parse_args(ARGS), pm) == 0
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        assert out.splitlines()[-1].startswith("OK: every step within tolerance"), out
        assert len([line for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]) == 2, out

    pm.register(SkipsOneReduction(), name="skip-one-reduction")
    try:
        assert check(parse_args(ARGS + ["parallel.impl.dp=skip-one-reduction"]), pm) == 1
    finally:
        pm.unregister(name="skip-one-reduction")
    out = capsys.readouterr().out
    if world.Get_rank() == 0:
        assert out.splitlines()[-1] == "FAIL: the layout does not train what one process trains", out
        assert f"step 1: gradient of {SKIPPED} differs by" in out, out
        assert f"ranks holding the same piece of {SKIPPED}'s gradient disagree" in out, out
