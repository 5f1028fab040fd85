"""Indexed shards through the whole trainer, against one process.

Two sources in Megatron's indexed format (``books``: three shards named by a
glob, ``web``: one), blended 70/30, with ``data.split`` holding documents
out for validation:

- at tp 2 x dp 2 the per-step losses and the gradient of every parameter
  equal one process's, so do the validation losses (per source and their
  blend-weighted mean), validation touches neither gradients nor weights,
  and the samples the ranks draw, put together, are the one-process
  stream: its source shares are within one sample of 70/30 at every prefix;
- the same at pp 2 x dp 2 with ZeRO-3 (validation runs the pipeline's
  forward-only program over sharded weights);
- a run stopped at step 2 (checkpoint) and resumed at another layout draws
  exactly the sample ids (source, index in that source) the uninterrupted
  run draws at steps 3 and 4 (ids compared, not only losses);
- ``data.document_mask=true`` read from the shards (segments and positions
  made by the cursor, cut for cp's zigzag) at cp 2 x dp 2 equals one
  process.

Tolerances (fp32) as tests/mpi/test_tp.py: losses 1e-6 relative, gradients
1e-5 relative plus 1e-6 of the largest element at step 1 and
``parity.ADAM_DRIFT`` afterwards; validation losses 1e-6 relative (one
forward, reduced once).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI

from parity import assert_parity, record, world_trainer

VOCAB = 320
STEPS = 3
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL, VAL_RTOL = 1e-6, 1e-5, 1e-6, 1e-6
BASE = ("data=indexed", f"model.vocab_size={VOCAB}", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.seq_len=32", "trainer.device=cpu", "trainer.progress=off", "trainer.log_every=100",
        "trainer.eval_batches=1", "data.split=0.15", "data.index_cache=false")


def _write_shard(prefix, rng, documents, low, high):
    from hpctrain.data.indexed import IndexedWriter

    with IndexedWriter(prefix, np.uint16) as w:  # finished on leaving the block
        for _ in range(documents):
            w.add_document(np.append(rng.integers(low, high, size=int(rng.integers(5, 60))), 0))  # EOS = 0
    with open(prefix + ".json", "w") as f:
        json.dump({"vocab_size": VOCAB, "eos_id": 0}, f)


@pytest.fixture(scope="module")
def shards():
    """(blend override, directory) of the two sources, written by rank 0.
    The sources use disjoint token ranges, so a loss mixes them only
    through the blend."""
    comm = MPI.COMM_WORLD
    path = tempfile.mkdtemp(prefix="hpctrain-blend-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path, root=0)
    if comm.Get_rank() == 0:
        rng = np.random.default_rng(7)
        for i in range(3):
            _write_shard(f"{path}/books-{i}", rng, 20, 1, 160)
        _write_shard(f"{path}/web", rng, 40, 160, VOCAB)
    comm.Barrier()
    blend = (f"data.blend=[{{paths:[{path}/books-*],weight:0.7,name:books}},"
             f"{{paths:[{path}/web],weight:0.3,name:web}}]")
    yield blend, path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _one_process(pm, *overrides):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    return reference_trainer(compose_resolved(BASE + overrides, pm), pm)


def _drawn(trainer, steps):
    """Train ``steps`` steps recording parity; every step's global samples
    (rows of (source, index), in stream order) gathered from the ranks."""
    drawn = []
    train_step = trainer.train_step

    def step():
        out = train_step()
        mine = (trainer.mesh.sample_rank, trainer.cursor.last_samples)
        everyone = [mine] if trainer.mesh.world_size == 1 else MPI.COMM_WORLD.allgather(mine)
        by_rank = dict(everyone)  # tensor/pipeline ranks of one sample rank hold the same samples
        drawn.append(np.concatenate([by_rank[r] for r in sorted(by_rank)]))
        return out

    trainer.train_step = step
    records = record(trainer, steps, MPI.COMM_WORLD if trainer.mesh.world_size > 1 else MPI.COMM_SELF)
    return records, drawn


def _validate_touches_nothing(trainer):
    """``trainer.validate()``, checking it leaves every weight and gradient as it was."""
    weights = [p.detach().clone() for p in trainer.params]
    grads = [None if p.grad is None else p.grad.clone() for p in trainer.params]
    out = trainer.validate()
    assert all(torch.equal(w, p) for w, p in zip(weights, trainer.params))
    assert all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, trainer.params))
    return out


_REFERENCE = {}


def _reference(pm, blend, *extra):
    key = (blend, *extra)
    if key not in _REFERENCE:
        trainer = _one_process(pm, blend, *extra)
        records, drawn = _drawn(trainer, STEPS)
        _REFERENCE[key] = records, drawn, trainer.validate()
    return _REFERENCE[key]


def _assert_same_validation(got, want):
    assert set(got) == set(want) == {"val_loss", "val_ppl", "val_loss.books", "val_loss.web"}, (got, want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=VAL_RTOL), key


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", [("parallel.tp=2",), ("parallel.pp=2", "parallel.zero.stage=3")],
                         ids=["tp2xdp2", "pp2xdp2-zero3"])
def test_a_blend_with_validation_trains_like_one_process(world, pm, shards, layout):
    blend, _ = shards
    want, want_drawn, want_val = _reference(pm, blend)
    trainer = world_trainer(pm, *BASE, blend, *layout)
    got, got_drawn = _drawn(trainer, STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    _assert_same_validation(_validate_touches_nothing(trainer), want_val)
    for step, (g, w) in enumerate(zip(got_drawn, want_drawn), start=1):
        np.testing.assert_array_equal(g, w, err_msg=f"step {step}: the ranks drew other samples")
    # Megatron's blend: at every prefix of the stream each source's share is within one sample of its weight
    sources = np.concatenate(got_drawn)[:, 0]
    seen = np.cumsum(np.stack([sources == 0, sources == 1], axis=1), axis=0)
    prefix = np.arange(1, len(sources) + 1)[:, None]
    assert np.all(np.abs(seen - prefix * np.array([0.7, 0.3])) <= 1.0)
    assert seen[-1].tolist() == [17, 7]  # 24 samples: both sources drawn
    # the validation sets are held-out documents: their losses differ by source and from the training loss
    assert trainer.orders.valid_names == ["books", "web"]


@pytest.mark.mpi(min_size=4)
def test_resuming_on_another_layout_draws_the_same_sample_ids(world, pm, shards, shared_tmp):
    """Steps 1-2 at tp 2 x dp 2, a checkpoint, steps 3-4 at dp 4 with
    ZeRO-1: the sample ids of each step equal the uninterrupted one-process
    run's, and so do the losses."""
    blend, _ = shards
    straight, straight_drawn = _drawn(_one_process(pm, blend), 4)
    first = world_trainer(pm, *BASE, blend, "parallel.tp=2", f"checkpoint.dir={shared_tmp}", "checkpoint.every=100")
    got, drawn = _drawn(first, 2)
    path = first.save_checkpoint(f"{shared_tmp}/step2.h5")
    first.checkpointer.close()  # lets go of the directory's lock for the resumed run
    MPI.COMM_WORLD.Barrier()
    second = world_trainer(pm, *BASE, blend, "parallel.zero.stage=1", f"checkpoint.resume={path}")
    assert second.step == 2
    more, more_drawn = _drawn(second, 2)
    for step, (g, w) in enumerate(zip(drawn + more_drawn, straight_drawn), start=1):
        np.testing.assert_array_equal(g, w, err_msg=f"step {step}: resumed run drew other samples")
    assert [r.loss for r in got + more] == pytest.approx([r.loss for r in straight], rel=LOSS_RTOL)


@pytest.mark.mpi(min_size=4)
def test_document_masking_from_the_shards_at_cp2_trains_like_one_process(world, pm, shards):
    blend, _ = shards
    masked = ("data.document_mask=true",)
    want, want_drawn, want_val = _reference(pm, blend, *masked)
    unmasked, _, _ = _reference(pm, blend)
    # masking is on: every step's loss moves by ten times the parity tolerance or more (an untrained
    # model's loss is near log(vocab) either way; here the mask moves it by 4e-5 to 8e-4 relative)
    assert all(abs(m.loss - u.loss) > 10 * LOSS_RTOL * abs(u.loss) for m, u in zip(want, unmasked))
    trainer = world_trainer(pm, *BASE, blend, *masked, "parallel.cp=2")
    got, _ = _drawn(trainer, STEPS)
    assert_parity(got, want, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    _assert_same_validation(_validate_touches_nothing(trainer), want_val)


_WATCHING = {"root": None, "seen": []}


def _audit(event, args):
    root = _WATCHING["root"]
    if root is None or event not in ("open", "os.listdir", "os.scandir", "glob.glob", "glob.glob/2"):
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(root):
        _WATCHING["seen"].append((event, os.fsdecode(path), args[1] if len(args) > 1 else None))


@pytest.mark.mpi(min_size=2)
def test_only_rank_0_lists_stats_or_reads_the_index_files(world, pm, shards, monkeypatch):
    """Building the trainer (the index, the sample orders, validation of the
    config) and two steps: ranks other than 0 open the shards' ``.bin``
    files to read tokens and touch nothing else of the data: no listing, no
    glob, no stat, no ``.idx`` or description (rank 0 read them and
    broadcast the tables). Checked with Python's audit hooks (open, listdir,
    scandir, glob) and a wrapped ``os.stat``; rank 0 is watched too, to show
    the watch sees what indexing does."""
    blend, root = shards
    sys.addaudithook(_audit)  # an audit hook stays for the process: it does nothing unless a root is set
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(root):
            _WATCHING["seen"].append(("os.stat", os.fsdecode(path), None))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    _WATCHING["root"], _WATCHING["seen"] = root, []
    try:
        from hpctrain.data import index as data_index

        data_index._BUILT.clear()  # as in a new job: rank 0 indexes during validation
        trainer = world_trainer(pm, *BASE, blend, "data.index_cache=true")
        trainer.train_step()
        trainer.train_step()
    finally:
        _WATCHING["root"] = None
    seen = _WATCHING["seen"]
    if world.Get_rank() == 0:
        assert any(p.endswith(".idx") for _, p, _ in seen) and any(e == "glob.glob" for e, _, _ in seen), seen
    else:
        others = [(e, p) for e, p, _ in seen if not (e == "open" and p.endswith(".bin"))]
        assert others == [], others
        assert any(p.endswith(".bin") for _, p, _ in seen)  # the watch works here too: the tokens were read
