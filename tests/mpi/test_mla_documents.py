"""Multi-head latent attention under context parallelism with document masking, at 2 ranks: cp 2 (ring and
all-gather attention, the zigzag split) trains as one process with the same document-masked micro-batches
(``documents.with_documents``: a newline ends a document, RoPE positions restart at each one), the same
per-step losses and the gradient of every parameter.

The model: tests/mpi/test_mla.py's shape on the tiny model (d_model 64, 4 heads; low-rank query of 24, key/value
latent of 16 with a shared rotary key of 8, q/k heads of 8 + 8 dims against value heads of 12, yarn with both
mscale terms), so ring and all-gather attention carry values of another head size than queries and keys, with
each document's tokens attending only within it and the decoupled rotary key rotated at document positions.
The one-process reference is checked to differ from the same run without the mask (the parity has teeth).
Tolerances as tests/mpi/test_document_mask.py.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
from documents import with_documents
from mpi4py import MPI

from hpctrain.parity import on_rank0

from parity import assert_parity, record, world_trainer

STEPS = 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6
MLA = ("trainer.global_batch_size=4", "trainer.micro_batch_size=2", "trainer.seq_len=32", "trainer.device=cpu",
       "trainer.progress=off", "trainer.log_every=100", "model.attention_kind=mla", "model.n_kv_heads=null",
       "model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12", "model.rope_scaling.type=yarn",
       "model.rope_scaling.factor=4", "model.rope_scaling.original_max_seq_len=16", "model.rope_scaling.mscale=1.0",
       "model.rope_scaling.mscale_all_dim=0.8")

_REFERENCE: Dict[str, List] = {}


def _one_process(pm, segments: bool = True):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    key = "masked" if segments else "unmasked"
    if key not in _REFERENCE:
        def run():
            trainer = with_documents(reference_trainer(compose_resolved(MLA, pm), pm), segments=segments)
            records = record(trainer, STEPS, MPI.COMM_SELF)
            if segments:  # several documents in a sample
                assert max(int(mb.segments.max()) for mb in trainer.step_runner.seen) >= 2
            return records
        _REFERENCE[key] = on_rank0(MPI.COMM_WORLD, run)
    return _REFERENCE[key]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_mla_cp2_with_document_masking_trains_like_one_process(world, pm, impl):
    trainer = with_documents(world_trainer(pm, *MLA, "parallel.cp=2", f"parallel.cp_impl={impl}"))
    attn = trainer.model.layers[0].attn
    assert type(attn).__name__ == "MLAttention"
    assert type(attn.core).__name__ == ("RingAttention" if impl == "ring" else "AllGatherAttention")
    assert_parity(record(trainer, STEPS), _one_process(pm), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    assert trainer.step_runner.seen[0].segments.shape == (2, 16)  # this rank's zigzag tokens, with documents


@pytest.mark.mpi(min_size=2)
def test_the_mask_changes_the_one_process_run(world, pm):
    for masked, unmasked in zip(_one_process(pm), _one_process(pm, segments=False)):
        # (the losses of a fresh tiny model sit near log(vocab) either way; the gradients tell them apart)
        assert masked.loss != unmasked.loss and abs(masked.grad_norm - unmasked.grad_norm) > 1e-3 * unmasked.grad_norm
