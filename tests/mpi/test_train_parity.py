"""Invariant 1 for data parallelism: any dp size trains the same model as one
process (fp32: same per-step losses within rel 1e-5, final weights within
1e-5), and replicas hold bit-identical weights.

Runs at every session size (dp = world size 2, 4, 8). The reference runs
inside each rank (``reference_trainer``: a world of one, local
communicators), with the same global batch, seed and data order.
"""
import hashlib

import pytest
import torch

from hpctrain.parity import on_rank0
from hpctrain.run import prepare_run, reference_trainer

# fp32 on CPU: the only difference from one process is the order in which
# per-rank gradient sums are added (all-reduce), worth ~1e-7 relative per
# step; 1e-5 leaves room for 10 steps of Adam amplifying it.
REL_TOL = 1e-5


def _weights_digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("micro", [4, 2], ids=["one-microbatch", "grad-accumulation"])
def test_dp_matches_one_process(world, shared_tmp, make_config, micro):
    n = world.Get_size()
    cfg = make_config("trainer.steps=10", f"trainer.global_batch_size={4 * n}",
                      f"trainer.micro_batch_size={micro}", "trainer.log_every=100")
    trainer = prepare_run(cfg, shared_tmp)
    assert trainer.mesh.size("dp") == n
    assert trainer.cursor.num_microbatches == 4 // micro
    losses = [m["loss"] for m in trainer.fit()]

    def one_process():
        ref = reference_trainer(cfg)
        return [m["loss"] for m in ref.fit()], [q.detach() for q in ref.model.parameters()]
    ref_losses, ref_params = on_rank0(world, one_process)  # the other ranks sleep meanwhile
    assert losses == pytest.approx(ref_losses, rel=REL_TOL)
    assert losses[-1] < losses[0]
    for (name, p), q in zip(trainer.model.named_parameters(), ref_params):
        assert torch.allclose(p, q, rtol=0, atol=REL_TOL), name

    digests = world.allgather(_weights_digest(trainer.model))
    assert len(set(digests)) == 1, "replicas diverged"


@pytest.mark.mpi(min_size=2)
def test_metrics_file_written_once_by_rank_zero(world, shared_tmp, make_config):
    import json
    import os

    n = world.Get_size()
    cfg = make_config("trainer.steps=3", f"trainer.global_batch_size={2 * n}", "trainer.micro_batch_size=2")
    prepare_run(cfg, shared_tmp).fit()
    world.Barrier()
    lines = open(os.path.join(shared_tmp, "metrics.jsonl")).read().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(records[0])
    assert records[-1]["consumed_samples"] == 3 * 2 * n


@pytest.mark.mpi(min_size=2)
def test_bf16_autocast_trains(world, make_config):
    n = world.Get_size()
    cfg = make_config("trainer.steps=4", f"trainer.global_batch_size={2 * n}", "trainer.micro_batch_size=2",
                      "trainer.precision=bf16")
    hist = prepare_run(cfg).fit()
    ref = on_rank0(world, lambda: reference_trainer(cfg).fit())
    # bf16 matmuls: same ops in the same order per micro-batch, so the losses
    # still agree closely; 2e-2 relative covers bf16's 8-bit mantissa.
    assert [m["loss"] for m in hist] == pytest.approx([m["loss"] for m in ref], rel=2e-2)
    assert all(p.dtype == torch.float32 for p in prepare_run(cfg).model.parameters())


@pytest.mark.every_size  # the expected bytes are 2(n-1)/n of the gradients
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("backend", ["torch", "mpi", "hier"])
def test_comm_bytes_of_plain_dp_is_a_ring_all_reduce_of_the_gradients(world, make_config, backend):
    """nccl-tests bus bytes: an all-reduce of S bytes moves 2(n-1)/n x S per rank.
    The gradients are all the dp group moves, apart from one flag per parameter
    in each bucket and the step's 5-element float64 totals all-reduce (norm, loss, tokens, short reads,
    the fp16 overflow flag)."""
    n = world.Get_size()
    cfg = make_config("trainer.steps=2", f"trainer.global_batch_size={2 * n}", "trainer.micro_batch_size=2",
                      f"comm.backend={backend}", "comm.bucket_mb=0.05")
    trainer = prepare_run(cfg)
    grad_bytes = sum(p.numel() * p.element_size() for p in trainer.params)
    for m in trainer.fit():
        assert m["comm_bytes.dp"] == pytest.approx(2 * (n - 1) / n * grad_bytes, rel=0.01)
        assert [k for k in m if k.startswith("comm_bytes.")] == ["comm_bytes.dp"]
