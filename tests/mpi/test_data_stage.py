"""Data staging at 4 ranks on 2 emulated nodes of 2 (issue 59 item 3's done-when):
a run stages the shards each node's ranks read (and only those) into
``<data.stage.dir>/node_<i>`` and reads them there; the next launch reuses
them; a staged copy with a flipped byte is found by its checksum and copied
again; ``data.stage.all=true`` copies every shard; a ``data.stage.dir``
that does not exist falls back to the shared paths in one line. Every run
trains the same losses (the same tokens, read from wherever they are).

The nodes are emulated by handing the trainer a runtime whose ranks 0, 1
sit on node 0 and 2, 3 on node 1 (as ``HPCTRAIN_RANKS_PER_NODE=2`` does at
launch); the files and the collectives are real.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import List, Set

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.bootstrap import get_runtime
from hpctrain.data.indexed import IndexedWriter
from hpctrain.train import trainer as trainer_module

pytestmark = pytest.mark.mpi(min_size=4)

SHARDS = 12
RUN = ("trainer.global_batch_size=4", "trainer.micro_batch_size=1", "trainer.seq_len=16", "trainer.progress=off",
       "trainer.log_every=1", "trainer.steps=2", "model.d_model=32", "model.n_layers=1", "parallel.dp=4",
       "model.vocab_size=256", "data.source=indexed", "data.index_cache=false", "data.prefetch=false",
       "reliability.straggler_every=0", "reliability.weight_check_every=0", "checkpoint.every=0")


@pytest.fixture
def nodes(monkeypatch):
    """Ranks 0, 1 on node 0 and 2, 3 on node 1; a shared directory with 12 one-document shards."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        pytest.skip("written for 4 ranks (same at every size)")
    rank = comm.Get_rank()
    rt = get_runtime()
    emulated = dataclasses.replace(rt, rank_nodes=(0, 0, 1, 1), node_rank=rank // 2, num_nodes=2,
                                   local_rank=rank % 2, local_size=2, emulated_nodes=True)
    monkeypatch.setattr(trainer_module, "get_runtime", lambda: emulated)
    path = Path(comm.bcast(tempfile.mkdtemp(prefix="hpctrain-stage-") if rank == 0 else None, root=0))
    if rank == 0:
        rng = np.random.default_rng(5)
        for i in range(SHARDS):
            with IndexedWriter(str(path / "shared" / f"part_{i:02d}"), np.uint16) as w:
                w.add_document(rng.integers(0, 250, 40))
        (path / "local").mkdir()
    comm.Barrier()
    yield path
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _train(where: Path, *extra: str):
    from hpctrain.bootstrap import with_device
    from hpctrain.config import compose_agreed
    from hpctrain.plugins import get_manager
    from hpctrain.run import build_mesh, configure_torch
    from hpctrain.train.trainer import Trainer

    pm = get_manager()
    cfg = compose_agreed((*RUN, f"data.paths=[{where / 'shared'}]", *extra), pm, MPI.COMM_WORLD)
    rt = with_device(cfg.trainer.device)
    configure_torch(cfg, rt)
    trainer = Trainer(cfg, build_mesh(cfg, rt, pm), pm, rt.device)
    history = trainer.fit()
    return [m["loss"] for m in history], trainer, history


def _staged(root: Path) -> Set[str]:
    return {p.name for p in root.glob("*/*.bin")}


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _check(ok: bool, what: object = "") -> None:
    """Assert on every rank alike (a check failing on one rank must not leave the others in a collective)."""
    bad = [(r, w) for r, (o, w) in enumerate(MPI.COMM_WORLD.allgather((bool(ok), "" if ok else str(what)))) if not o]
    assert not bad, bad


def _lines(caplog, text: str) -> List[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_shards_are_staged_per_node_reused_checked_and_a_missing_dir_falls_back(nodes, caplog, monkeypatch):
    comm, rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    stage = ("data.stage.dir=" + str(nodes / "local"),)
    # streams close their files at the end of the run; keep the names of what each rank opened
    opened: List[str] = []
    from hpctrain.data import streams

    real_file = streams.DocumentStream._file

    def spy(self, shard):
        opened.append(self.shards[shard].bin_path)
        return real_file(self, shard)

    monkeypatch.setattr(streams.DocumentStream, "_file", spy)

    with caplog.at_level(logging.INFO):
        first, trainer, history = _train(nodes, *stage)
    node = rank // 2
    root = nodes / "local" / f"node_{node}"
    read = set(opened)
    # every shard this rank read came from its node's copies, and each node holds exactly what its ranks read
    _check(read and all(p.startswith(str(root) + os.sep) for p in read), read)
    per_node = comm.allgather({os.path.basename(p) for p in read})
    wanted = [per_node[0] | per_node[1], per_node[2] | per_node[3]]
    _check(_staged(root) == wanted[node], (_staged(root), wanted))
    assert all(len(w) < SHARDS for w in wanted) and wanted[0] != wanted[1]  # only the shards its ranks read
    _check(history[0]["data_stage_s"] > 0 and history[0]["data_stage_copied_bytes"] > 0, history[0])
    if rank == 0:
        line = _lines(caplog, "data.stage: 2 of 2 node(s) staged")
    _check(rank or (len(line) == 1 and ", 0 reused, 0 recopied" in line[0] and "data staged in" in caplog.text),
           caplog.text)  # the summary, and the start-up line
    caplog.clear()

    # the next launch reuses every staged file (checksums read again, nothing copied)
    mtimes = {p: p.stat().st_mtime_ns for p in root.glob("*/*.bin")}
    opened.clear()
    with caplog.at_level(logging.INFO):
        again, _, history = _train(nodes, *stage)
    _check(again == first, again)
    _check({p: p.stat().st_mtime_ns for p in root.glob("*/*.bin")} == mtimes, "a reused file was written")
    _check(history[0]["data_stage_copied_bytes"] == 0, history[0])
    staged = sum(len(w) for w in wanted)
    _check(rank or f": 0 copied, {staged} reused, 0 recopied" in _lines(caplog, "data.stage:")[0], caplog.text)
    caplog.clear()

    # a damaged copy on node 1 is found by its checksum and copied again
    comm.Barrier()
    victim = sorted((nodes / "local" / "node_1").glob("*/*.bin"))[0]
    if rank == 0:
        _flip(victim)
    comm.Barrier()
    with caplog.at_level(logging.INFO):
        fixed, _, _ = _train(nodes, *stage)
    _check(fixed == first, fixed)
    _check(rank or (", 1 recopied (checksum mismatch)" in _lines(caplog, "data.stage:")[0]
                    and victim.read_bytes() == (nodes / "shared" / victim.name).read_bytes()), caplog.text)
    caplog.clear()

    # data.stage.all: every shard on every node (those staged already reused)
    all_, _, _ = _train(nodes, *stage, "data.stage.all=true")
    _check(all_ == first and len(_staged(root)) == SHARDS, _staged(root))
    caplog.clear()

    # a local directory that is not there: one line, and the shared paths are read
    opened.clear()
    with caplog.at_level(logging.INFO):
        shared, _, _ = _train(nodes, f"data.stage.dir={nodes / 'missing'}")
    _check(shared == first and not (nodes / "missing").exists(), shared)
    _check(opened and all(p.startswith(str(nodes / "shared") + os.sep) for p in opened), opened)
    _check(rank or _lines(caplog, "read the shared paths") == [
        f"data.stage.dir={nodes / 'missing'} does not exist on this node: node(s) 0, 1 read the shared paths"],
        caplog.text)
