"""The loader and index sections of ``hpctrain-bench data`` (see its docstring).

``loader``: the real trainer at bench size on a 70/30 blend of indexed
shards with document masking, two trainers built side by side in the same
job, one with ``data.prefetch=true`` and one reading its data inside the
step, run in alternating rounds; per contender the median step time, the
median ``data_wait_s`` (slowest rank) and its share of the step. Then the
loader alone (``DataCursor.next_step`` in a loop at the same place in the
mesh): the samples per second it can make against what a step consumes.

``index``: start-up of the data index for many small shards (default
1,000; run it under ``mpiexec -n 8``): rank 0 indexes and broadcasts
(``hpctrain.data.index.shared``), cold and from the cache file, against the
peer every other loader does, each rank indexing the shards itself. Each
time is the slowest rank's, from a barrier to every rank holding the sample
orders. The shards are freshly written, so they are in the page cache:
what is measured is the metadata work and the system calls, not a cold
parallel file system (where every rank's listing and stats would cost
more, and rank 0's alone the same).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any, Dict, List, Tuple

import numpy as np

from hpctrain.bench.common import Column, Table, print_rank0, time_interleaved
from hpctrain.bootstrap import init_runtime
from hpctrain.config import compose_resolved
from hpctrain.data import index as data_index
from hpctrain.data.indexed import IndexedWriter, token_dtype
from hpctrain.data.orders import sample_orders
from hpctrain.plugins import get_manager
from hpctrain.run import prepare_run


def add_arguments(ap: argparse.ArgumentParser) -> None:
    loader = ap.add_argument_group("loader section")
    loader.add_argument("--d-model", type=int, default=256, help="bench model width (default 256)")
    loader.add_argument("--layers", type=int, default=4, help="bench model layers (default 4)")
    loader.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256)")
    loader.add_argument("--vocab-size", type=int, default=8000, help="the shards' vocabulary (default 8000)")
    loader.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch (default 2)")
    loader.add_argument("--per-rank", type=int, default=4, help="samples per rank per step (default 4)")
    loader.add_argument("--steps", type=int, default=10, help="timed steps per contender (default 10)")
    loader.add_argument("--corpus-tokens", default=4_000_000, type=int,
                        help="tokens in the blend's shards (default 4,000,000)")
    index = ap.add_argument_group("index section")
    index.add_argument("--index-shards", type=int, default=1000, help="shards to index (default 1000)")
    index.add_argument("--index-docs", type=int, default=50, help="documents per shard (default 50)")


def write_shards(root: str, name: str, shards: int, tokens: int, vocab: int, seed: int,
                 doc_tokens: Tuple[int, int] = (20, 2000)) -> List[str]:
    """``shards`` Megatron-format shards of about ``tokens`` tokens in all
    (documents of ``doc_tokens`` tokens, EOS 0), each with the description
    hpctrain-prepare writes; their prefixes."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for s in range(shards):
        prefix = os.path.join(root, f"{name}-{s:05d}")
        with IndexedWriter(prefix, token_dtype(vocab)) as w:
            left = max(1, tokens // shards)
            while left > 0:
                n = min(left, int(rng.integers(*doc_tokens)))
                w.add_document(np.append(rng.integers(1, vocab, size=n - 1), 0))
                left -= n
        with open(prefix + ".json", "w") as f:
            json.dump({"vocab_size": vocab, "eos_id": 0}, f)
        prefixes.append(prefix)
    return prefixes


def _shared_dir(comm: Any, make) -> str:
    """A temporary directory rank 0 fills with ``make(path)``; its path on every rank."""
    path = tempfile.mkdtemp(prefix="hpctrain-bench-data-") if comm.Get_rank() == 0 else None
    if path is not None:
        make(path)
    path = comm.bcast(path, root=0)
    comm.Barrier()
    return path


def _remove(comm: Any, path: str) -> None:
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def loader_section(args: argparse.Namespace, comm: Any) -> int:
    init_runtime("cpu")  # the trainers' runtime (idempotent)
    world = comm.Get_size()
    root = _shared_dir(comm, lambda p: (write_shards(p, "books", 4, int(args.corpus_tokens * 0.7), args.vocab_size, 1),
                                        write_shards(p, "web", 2, int(args.corpus_tokens * 0.3), args.vocab_size, 2)))
    try:
        heads = max(1, args.d_model // 64)
        overrides = ["data=indexed", f"data.blend=[{{paths:[{root}/books-*],weight:0.7,name:books}},"
                     f"{{paths:[{root}/web-*],weight:0.3,name:web}}]", "data.document_mask=true",
                     f"model.vocab_size={args.vocab_size}", f"model.d_model={args.d_model}",
                     f"model.n_layers={args.layers}", f"model.n_heads={heads}", f"model.n_kv_heads={heads}",
                     f"model.max_seq_len={args.seq_len}", f"trainer.seq_len={args.seq_len}",
                     f"trainer.global_batch_size={args.per_rank * world}",
                     f"trainer.micro_batch_size={args.micro_batch}", "trainer.progress=off",
                     "trainer.log_every=1000000", "trainer.device=cpu", "reliability.hang_timeout_s=0"]
        pm = get_manager()
        contenders = {"prefetch (data.prefetch=true)": True, "read in the step (data.prefetch=false)": False}
        trainers = {name: prepare_run(compose_resolved([*overrides, f"data.prefetch={str(on).lower()}"], pm), None,
                                      pm) for name, on in contenders.items()}
        for t in trainers.values():  # untimed: the first step builds caches and threads
            t.train_step()
        seen: Dict[str, Tuple[List[float], List[float]]] = {name: ([], []) for name in trainers}  # step, wait
        names = list(trainers)
        for k in range(args.steps):
            for j in range(len(names)):  # alternate who goes first
                name = names[(k + j) % len(names)]
                m = trainers[name].train_step()
                seen[name][0].append(comm.allreduce(float(m["step_time_s"]), op=_max()))
                seen[name][1].append(comm.allreduce(float(m["data_wait_s"]), op=_max()))
        gbs = args.per_rank * world
        table = Table([Column("contender", align="<"), Column("step s", "{:.3f}"), Column("data_wait_s", "{:.5f}"),
                       Column("wait % of step", "{:.3f}"), Column("samples/s", "{:.1f}")])
        step_rate = None
        for name in names:
            step_s, wait_s = float(np.median(seen[name][0])), float(np.median(seen[name][1]))
            table.add(name, step_s, wait_s, 100 * wait_s / step_s, gbs / step_s)
            step_rate = gbs / step_s if contenders[name] else step_rate
        # the loader alone, at rank r's place in the mesh
        first = trainers[names[0]]
        cursor = first.cursor_over(first.orders.train, first.orders.weights)
        [loop] = time_interleaved([lambda: [cursor.next_step() for _ in range(5)]], comm, warmup=1,
                                  iters=args.steps)
        loader_rate = 5 * gbs / loop.median
        print_rank0(comm, f"## loader: 70/30 blend, document masking, d_model {args.d_model} x {args.layers} layers, "
                          f"seq_len {args.seq_len}, {args.per_rank} samples per rank, {world} rank(s)", "",
                    table.render(args.markdown), "",
                    f"loader alone (DataCursor.next_step, every rank at once): {loader_rate:.0f} samples/s = "
                    f"{loader_rate / step_rate:.0f}x what a step consumes ({step_rate:.1f} samples/s)", "")
        return 0
    finally:
        _remove(comm, root)


def _max() -> Any:
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    return MPI.MAX


def index_section(args: argparse.Namespace, comm: Any) -> int:
    vocab = 32000
    root = _shared_dir(comm, lambda p: write_shards(p, "shard", args.index_shards, args.index_shards * args.index_docs
                                                    * 210, vocab, 3, doc_tokens=(20, 400)))
    try:
        pm = get_manager()
        base = ["data=indexed", f"data.paths=[{root}]", f"model.vocab_size={vocab}"]
        cold = compose_resolved([*base, "data.index_cache=false"], pm).data
        cached = compose_resolved([*base, "data.index_cache=true"], pm).data
        is_main = comm.Get_rank() == 0

        def fresh(fn):
            def run() -> None:
                data_index._BUILT.clear()  # what a new job starts with
                fn()
            return run

        if is_main:
            data_index.index_on_rank0(cached, vocab)  # writes the cache file (untimed)
        contenders = {
            "rank 0 indexes, broadcast (cold)": fresh(lambda: sample_orders(cold, 128, vocab, comm, is_main)),
            "rank 0 reads the cache, broadcast": fresh(lambda: sample_orders(cached, 128, vocab, comm, is_main)),
            "every rank indexes (peer)": fresh(lambda: sample_orders(cold, 128, vocab, None, True)),
        }
        timings = time_interleaved(list(contenders.values()), comm, warmup=1, iters=5)
        peer = timings[-1].median
        table = Table([Column("start-up", align="<"), Column("seconds", "{:.3f}"), Column("x peer", "{:.2f}")])
        for name, t in zip(contenders, timings):
            table.add(name, t.median, t.median / peer)
        print_rank0(comm, f"## index: {args.index_shards} shards x {args.index_docs} documents, "
                          f"{comm.Get_size()} rank(s) (slowest rank, median of 5)", "", table.render(args.markdown), "")
        return 0
    finally:
        _remove(comm, root)
