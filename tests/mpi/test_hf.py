"""Hugging Face models in and out at any layout (tiny models made and saved in the test).

- A Llama (GQA 4:1, Llama 3.1 rope scaling), the same tied, and a Mixtral (4
  experts, top-2) loaded with ``checkpoint.init_from=hf:DIR`` train at tp 2,
  pp 2, cp 2, (Mixtral) ep 2 and ZeRO-3 exactly as one process loaded the same way
  (losses and the gradient of every parameter), and the first step's loss is
  transformers' own on that step's batch.
- After 3 steps at tp 2 x pp 2 the export loads in transformers and gives the
  logits hpctrain computes from that checkpoint, and the export loaded back
  at another layout (cp 2 x dp 2) trains as the checkpoint does in one process.
- A model in 3 safetensors shards imports at tp 2 x pp 2 with each rank
  reading exactly the bytes of its own pieces (every slice read through
  ``safetensors`` counted).
- A vocabulary of 32001 tokens imports at tp 4 (padded to 32256 inside) and
  exports unpadded, computing the original's logits.

Tolerances as tests/mpi/test_tp.py (fp32: the layouts only regroup sums).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from mpi4py import MPI

from hf_models import batch, hf_logits, hf_model, llama_config, mixtral_config, save
from parity import assert_parity, record, reference_of, shared_reference, world_trainer

STEPS = 2
BASE = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=32", "trainer.device=cpu",
        "trainer.progress=off", "trainer.log_every=100", "reliability.hang_timeout_s=0")
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-6


def _on_rank0(make, directory):
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        make(directory)
    comm.Barrier()
    return str(directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    comm = MPI.COMM_WORLD
    root = comm.bcast(str(tmp_path_factory.mktemp("hf")) if comm.Get_rank() == 0 else None, root=0)
    makers = {"llama": lambda d: save(llama_config(), d), "tied": lambda d: save(llama_config(tie=True), d),
              "mixtral": lambda d: save(mixtral_config(), d),
              "sharded": lambda d: save(llama_config(), d, max_shard_size="150KB")}
    return {name: _on_rank0(make, os.path.join(root, name)) for name, make in makers.items()} | {"root": root}


CASES = [("llama", "parallel.tp=2"), ("llama", "parallel.pp=2"), ("llama", "parallel.cp=2"),
         ("tied", "parallel.tp=2"), ("tied", "parallel.pp=2"), ("mixtral", "parallel.ep=2"),
         ("mixtral", "parallel.tp=2"), ("llama", "parallel.zero.stage=3")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("which,layout", CASES, ids=[f"{w}-{lay.split('.', 1)[1].split('=')[0]}" for w, lay in CASES])
def test_an_imported_model_trains_like_one_process_at_any_layout(world, pm, hf_dirs, which, layout):
    model = hf_model(hf_dirs[which])
    trainer = world_trainer(pm, *BASE, *model, layout)
    assert trainer.step == 0 and trainer.cursor.consumed_samples == 0  # weights only
    first_batch = trainer.orders.train[0].batch(range(4))  # step 1's global batch (samples 0-3)
    got = record(trainer, STEPS)
    assert_parity(got, shared_reference(BASE + model, STEPS), LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)
    # and the first step's loss (the language-model loss, the router's balance loss apart) is transformers' own
    logits = hf_logits(hf_dirs[which], first_batch[:, :-1])
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), first_batch[:, 1:].flatten()))
    assert abs(got[0].loss - want) <= 1e-5 * want, (got[0].loss, want)


@pytest.mark.mpi(min_size=4)
def test_export_after_training_at_tp2_pp2_loads_in_transformers_and_back_at_another_layout(world, pm, hf_dirs):
    from hpctrain.config import compose_resolved
    from hpctrain.run import reference_trainer

    from hpctrain_h5ckpt import cli

    root = os.path.join(hf_dirs["root"], "trained")
    ckpt, out = os.path.join(root, "ck"), os.path.join(root, "export")
    trainer = world_trainer(pm, *BASE, *hf_model(hf_dirs["llama"]), "parallel.tp=2", "parallel.pp=2",
                            "trainer.steps=3", "checkpoint.every=3", f"checkpoint.dir={ckpt}")
    trainer.fit()
    saved = os.path.join(ckpt, "step_00000003.h5")
    if world.Get_rank() == 0:
        assert cli.main(["export", ckpt, "--to", out]) == 0
        ours = reference_trainer(compose_resolved(
            BASE + ("model=hf", f"model.hf_dir={hf_dirs['llama']}", f"checkpoint.init_from={saved}"), pm), pm).model
        ours.eval()
        ids = batch()
        with torch.no_grad():
            want = ours(ids)
        got = hf_logits(out, ids)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert (got - hf_logits(hf_dirs["llama"], ids)).abs().max() > 1e-3  # three steps changed the model
    world.Barrier()
    back = world_trainer(pm, *BASE, *hf_model(out), "parallel.cp=2")
    from_checkpoint = reference_of(
        BASE + ("model=hf", f"model.hf_dir={hf_dirs['llama']}", f"checkpoint.init_from={saved}"), STEPS, pm)
    assert_parity(record(back, STEPS), from_checkpoint, LOSS_RTOL, GRAD_RTOL, GRAD_ATOL)


class _Counting:
    """A safetensors file whose slices count the bytes they return (the reads stay real)."""

    def __init__(self, real, counts):
        self.real, self.counts = real, counts

    def __enter__(self):
        self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.real.keys()

    def get_slice(self, name):
        return _CountingSlice(self.real.get_slice(name), self.counts)


class _CountingSlice:
    def __init__(self, real, counts):
        self.real, self.counts = real, counts

    def get_shape(self):
        return self.real.get_shape()

    def __getitem__(self, index):
        out = self.real[index]
        self.counts.append(out.numel() * out.element_size())
        return out


@pytest.mark.mpi(min_size=4)
def test_three_shards_import_at_tp2_pp2_each_rank_reading_only_its_slices(world, pm, hf_dirs, monkeypatch):
    import hpctrain.hf.weights as weights
    from hpctrain.shard import get_spec

    path = hf_dirs["sharded"]
    index = json.load(open(os.path.join(path, weights.INDEX)))
    assert len(set(index["weight_map"].values())) == 3
    counts: list = []
    real_open = weights.safe_open
    monkeypatch.setattr(weights, "safe_open", lambda p, framework="pt": _Counting(real_open(p, framework), counts))
    trainer = world_trainer(pm, *BASE, *hf_model(path), "parallel.tp=2", "parallel.pp=2")
    mesh = trainer.mesh
    mine, seen = 0, set()
    for p in trainer.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            for piece in get_spec(p).pieces(mesh.coords, mesh.sizes):
                mine += int(torch.Size([b - a for a, b in piece.box]).numel()) * 4  # fp32 in the files
    total = sum(os.path.getsize(os.path.join(path, f)) for f in set(index["weight_map"].values()))
    assert sum(counts) == mine, (sum(counts), mine)
    assert mine < total / 2  # a quarter of the blocks' weights, half the embedding or head
    everyone = world.allgather(sum(counts))
    assert all(n > 0 for n in everyone)
    # and the weights are the file's: the same losses as one process loading it
    assert_parity(record(trainer, 1), shared_reference(BASE + hf_model(path), STEPS)[:1], LOSS_RTOL, GRAD_RTOL,
                  GRAD_ATOL)


@pytest.mark.mpi(min_size=4)
def test_a_vocabulary_tp_does_not_divide_imports_padded_and_exports_unpadded(world, pm, hf_dirs):
    from hpctrain_h5ckpt import cli

    root = os.path.join(hf_dirs["root"], "vocab")
    src = _on_rank0(lambda d: save(llama_config(vocab=32001), d), os.path.join(root, "src"))
    ckpt, out = os.path.join(root, "ck"), os.path.join(root, "export")
    trainer = world_trainer(pm, *BASE, *hf_model(src), "parallel.tp=4", "checkpoint.every=1", f"checkpoint.dir={ckpt}")
    emb = trainer.model.tok_embeddings.weight
    assert emb.shape[0] * 4 == 32256  # padded to a multiple of tp x 64 inside
    trainer.save_checkpoint()
    if world.Get_rank() == 0:
        assert cli.main(["export", ckpt, "--to", out]) == 0
        assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == 32001
        ids = batch(vocab=32001)
        torch.testing.assert_close(hf_logits(out, ids), hf_logits(src, ids), rtol=1e-5, atol=1e-6)
    world.Barrier()
