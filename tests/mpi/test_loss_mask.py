"""Chat data with a loss mask trains the model of one process under every axis.

Shards with a loss mask beside them (as ``hpctrain-prepare --format chat``
writes them; here written directly: random conversations, each with a run
of "assistant" targets, some with none, some longer than a sample) are
packed whole into samples with document masking, and the loss is the mean
over the counted targets of the whole global batch. Ranks, micro-batches
and cp's halves of a sample hold different numbers of counted targets (the
test checks they do), so only a normalisation over the global count gives
one process's numbers. At 4 ranks, in one session:

- tp 2 x dp 2 (the vocabulary-parallel loss skips the masked targets),
- cp 2 x dp 2 (the zigzag halves carry their own masked targets),
- pp 2 x dp 2 (the last stage's loss; validation's forward-only program),

each equals one process: per-step losses, the gradient of every parameter
after each of 2 steps, and the validation loss over held-out conversations.

Tolerances (fp32) as tests/mpi/test_document_mask.py and test_data_blend.py:
losses 1e-6 relative, gradients 1e-5 relative plus 1e-6 of the largest
element at step 1 and ``parity.ADAM_DRIFT`` afterwards, validation 1e-6.
"""
from __future__ import annotations

import json
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from parity import assert_parity, record, world_trainer

VOCAB = 320
STEPS = 2
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL, VAL_RTOL = 1e-6, 1e-5, 1e-6, 1e-6
BASE = ("data=indexed", f"model.vocab_size={VOCAB}", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.seq_len=32", "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100",
        "trainer.eval_batches=1", "data.split=0.2", "data.index_cache=false")


def _write_chat_shard(prefix, rng, conversations):
    from hpctrain.data.indexed import IndexedWriter

    with IndexedWriter(prefix, np.uint16, loss_mask=True) as w:
        for i in range(conversations):
            n = int(rng.integers(6, 48))  # a sample holds 33 tokens: some conversations are longer
            mask = np.zeros(n, dtype=np.uint8)
            if i % 7:  # every seventh has no counted target at all
                a = int(rng.integers(1, n - 2))
                mask[a:int(rng.integers(a + 1, n + 1))] = 1  # the "assistant turn"
            w.add_document(np.append(rng.integers(1, VOCAB, size=n - 1), 0), mask)
    with open(prefix + ".json", "w") as f:
        json.dump({"vocab_size": VOCAB, "eos_id": 0, "loss_mask": {"file": ".mask", "train_on": "assistant"}}, f)


@pytest.fixture(scope="module")
def chat_data():
    comm = MPI.COMM_WORLD
    path = tempfile.mkdtemp(prefix="hpctrain-chat-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    if comm.Get_rank() == 0:
        rng = np.random.default_rng(11)
        _write_chat_shard(f"{path}/chat-0", rng, 70)
        _write_chat_shard(f"{path}/chat-1", rng, 50)
    comm.Barrier()
    yield f"data.paths=[{path}/chat-*]"
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _counted_per_rank(trainer):
    """Each rank's counted targets of the first step (read without consuming), gathered."""
    mbs = trainer.cursor.prepare(0, [0])[0]
    return MPI.COMM_WORLD.allgather([mb.counted for mb in mbs])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [("parallel.tp=2",), ("parallel.cp=2",), ("parallel.pp=2",)],
                         ids=["tp2xdp2", "cp2xdp2", "pp2xdp2"])
def test_a_masked_dataset_trains_like_one_process(world, pm, chat_data, layout):
    want, want_val = _reference(pm, chat_data)
    trainer = world_trainer(pm, *BASE, chat_data, *layout)
    assert trainer.cursor.loss_mask and trainer.cursor.document_mask
    counted = _counted_per_rank(trainer)
    flat = [c for per_rank in counted for c in per_rank]
    # the normalisation matters here: the micro-batches of the ranks hold different numbers of counted targets
    assert len(set(flat)) > 2 and sum(flat) > 0, counted
    got = record(trainer, STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    # validation over held-out conversations: the same mean over their counted targets
    assert trainer.validate()["val_loss"] == pytest.approx(want_val, rel=VAL_RTOL)


_REFERENCE = {}


def _reference(pm, chat_data):
    """One process's records of ``STEPS`` steps and its validation loss after them (rank 0 runs it once
    per job while the others wait; every rank gets them)."""
    if chat_data not in _REFERENCE:
        from hpctrain.config import compose_resolved
        from hpctrain.parity import on_rank0
        from hpctrain.run import reference_trainer

        def run():
            trainer = reference_trainer(compose_resolved(BASE + (chat_data,), pm), pm)
            return record(trainer, STEPS, MPI.COMM_SELF), trainer.validate()["val_loss"]

        _REFERENCE[chat_data] = on_rank0(MPI.COMM_WORLD, run)
    return _REFERENCE[chat_data]
