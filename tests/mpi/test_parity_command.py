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
from hpctrain.parity_cli import check, parse_args
from hpctrain.shard import get_spec

SKIPPED = "layers.0.ffn_norm.weight"
ARGS = ["--steps", "2", "trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32",
        "trainer.device=cpu", "trainer.log_every=100", "parallel.tp=2", "parallel.dp=2"]


class SkipsOneReduction:
    """Serves axis dp like hpctrain_dp, but never reduces ``SKIPPED``'s gradient."""

    ATTR = "_skips_one_reduction"

    @hookimpl
    def hpctrain_capabilities(self) -> Dict[str, List[str]]:
        return {"parallel": ["dp"]}

    @hookimpl
    def hpctrain_parallelize(self, model: torch.nn.Module, axis: str, mesh, cfg: Any) -> Optional[torch.nn.Module]:
        if axis != "dp":
            return None
        setattr(model, self.ATTR, True)
        return model

    @hookimpl
    def hpctrain_after_materialize(self, model: torch.nn.Module, mesh, cfg: Any) -> None:
        if getattr(model, self.ATTR, False):
            engine = grad_sync.GradSync(grad_sync.reduction_comm(mesh), cap_bytes_from_mb(1.0), None, True)
            kept = [p for p in model.parameters() if p.requires_grad and get_spec(p).logical_name != SKIPPED]
            grad_sync.attach_to(model, engine.attach(kept))

    @hookimpl
    def hpctrain_before_backward(self, model: torch.nn.Module, microbatch: int, num_microbatches: int) -> None:
        if getattr(model, self.ATTR, False):
            grad_sync.of(model).begin_microbatch(microbatch, num_microbatches)

    @hookimpl
    def hpctrain_after_backward(self, model: torch.nn.Module, mesh) -> None:
        if getattr(model, self.ATTR, False):
            grad_sync.of(model).finish()


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
