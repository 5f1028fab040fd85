"""Checkpoint save/load throughput: hpctrain's parallel HDF5 against torch.distributed.checkpoint (DCP).

Run under the launcher: ``mpiexec -n 2 hpctrain-bench ckpt``.

The state, identical for both contenders in the same processes: a
Llama-shaped set of fp32 matrices (default 46M parameters: d 512, 4 layers,
vocabulary 32768) sharded on their first dimension over the ranks (as ZeRO-3/FSDP shards
them), plus AdamW's ``exp_avg``/``exp_avg_sq`` (same shards) and ``step``,
after one real optimizer step: 12 bytes per parameter.

- hpctrain: the ``hdf5`` checkpointer (made through the
  ``hpctrain_make_checkpointer`` hook, as the trainer makes it; the core
  never imports a plugin) ``save`` / ``load`` on a stand-in TrainState that
  exposes exactly what the checkpointer reads (model, optimizer, mesh,
  cursor, config, step), so the whole path is measured: plan, host copy,
  checksums, one collective MPI-IO file, fsync, atomic commit; and the load
  with checksum verification (the default), and without it
  (``checkpoint.hdf5.verify=false``: finiteness is still checked).
- DCP: ``dcp.save`` / ``dcp.load`` of the same tensors as DTensors
  (``Shard(0)`` on a gloo device mesh) with ``FileSystemWriter`` defaults
  (one file per rank, fsync on).
- async: ``checkpoint.async_save`` in both staging modes
  (``checkpoint.hdf5.staging``), each followed by what training does next:
  steps of a stand-in forward/backward (``--step-s`` of matrix products
  with autograd, the same work on every rank and in every mode; it only
  reads the saved state), each ended by ``before_update()`` (which the
  trainer calls right before the optimizer step), until the save has
  committed. *Training blocked* = time in ``save()`` + time in
  ``before_update()``: what the issue's target is about. *Step time added*
  = from the save to the end of the last of those steps, minus their
  forward/backward run alone: the whole cost to training, which also counts
  the background copy and write slowing the steps down (on a CPU-only
  machine they share its cores, and h5py holds the GIL while it writes; on
  a GPU the device-to-host copy runs on the copy engine).
- local tier (``checkpoint.local.*``, ``hpctrain.localckpt``), in the same
  iterations on the same state: *save + replicate* = ``LocalTier.save`` then
  ``wait`` (each rank's own exact shards to node-local storage, ``--local-dir``,
  default under /dev/shm, sent to its partner on the next node, which writes
  them too), against the persistent save; *blocked* = ``save`` (the random
  state and cursor at once, plus any wait for the previous save) and the time
  each following stand-in step waits in ``before_update`` for the host copy,
  which runs in the background during the step, as in training, until the
  background write and replication are done, compared to a step (target <= 5% of a step); *load* = ``agree`` + ``load``
  (one allgather, read, restore). Run it with emulated nodes,
  ``HPCTRAIN_RANKS_PER_NODE=1``, so the partner is another rank.

Each time is the slowest rank's; the tables show medians over ``--iters``.
The contenders run back to back within each iteration, and the ratios
(hpctrain / DCP throughput, async blocking / sync save) are medians of the
per-iteration ratios, which a shared machine's changing load disturbs far
less than a ratio of medians. Throughput = tensor bytes / time. Files go
to ``--dir`` (default: a fresh directory under /tmp).
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from omegaconf import OmegaConf

from hpctrain.bench.common import (
    Column,
    Table,
    machine_summary,
    max_over_ranks,
    paired_ratio,
    print_rank0,
    timed_call,
)
from hpctrain.bootstrap import init_runtime, init_torch_distributed
from hpctrain.config import compose
from hpctrain.config.store import to_config
from hpctrain.data import DataCursor
from hpctrain.errors import ArgumentParser
from hpctrain.localckpt import LocalTier
from hpctrain.mesh import Mesh
from hpctrain.plugins import get_manager
from hpctrain.shard import DimSplit, ShardSpec, get_spec, set_spec
from hpctrain.train.state import TrainState


def _shapes(d: int, layers: int, vocab: int) -> List[Tuple[str, Tuple[int, int]]]:
    """Llama-like fp32 matrices: embedding and output (vocab x d), per layer
    attention (4 x d x d) and SwiGLU (3 x d x 8d/3). Sizes are multiples of 64,
    so dim 0 splits evenly over 2, 4 or 8 ranks."""
    f = max(64, 64 * round(8 * d / 3 / 64))
    out = [("tok_embeddings.weight", (vocab, d))]
    for i in range(layers):
        out += [(f"layers.{i}.attn.w{n}.weight", (d, d)) for n in "qkvo"]
        out += [(f"layers.{i}.ffn.w1.weight", (f, d)), (f"layers.{i}.ffn.w3.weight", (f, d)),
                (f"layers.{i}.ffn.w2.weight", (d, f))]
    return out + [("output.weight", (vocab, d))]


def _stand_in(cfg: Any, shapes: List[Tuple[str, Tuple[int, int]]], rank: int, size: int) -> TrainState:
    """A run's state as the checkpointer reads it, with every matrix sharded on dim 0."""
    mesh = Mesh({"dp": size}, rank, size)
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(1234 + rank)
    for name, (rows, cols) in shapes:
        local = torch.nn.Parameter(torch.randn(rows // size, cols, generator=g) * 0.02)
        set_spec(local, ShardSpec(name, (rows, cols), (DimSplit(0, ("dp",)),)))
        model.register_parameter(name.replace(".", "_"), local)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    # the real cursor's state_dict holds the batch size too (a load then needs no parse of /meta/config)
    batch = int(cfg.trainer.global_batch_size)
    cursor = SimpleNamespace(state_dict=lambda: {"consumed_samples": 0, "global_batch_size": batch},
                             load_state_dict=lambda state: None, consumed_samples=0)
    return TrainState(cfg, mesh, torch.device("cpu"), model, opt, cast(DataCursor, cursor), step=1)


def _dcp_state(run_state: TrainState, size: int) -> Dict[str, Any]:
    # heavy (the DCP peer): only when the benchmark runs, not when hpctrain-bench lists it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard  # heavy: the DCP peer's, as above


    dm = init_device_mesh("cpu", (size,))
    out: Dict[str, Any] = {}
    for p in run_state.model.parameters():
        name = get_spec(p).logical_name
        out[f"model.{name}"] = DTensor.from_local(p.detach(), dm, [Shard(0)], run_check=False)
        for key, value in run_state.optimizer.state[p].items():
            out[f"optim.{key}.{name}"] = (DTensor.from_local(value, dm, [Shard(0)], run_check=False)
                                          if value.dim() else value)
    return out


def _step_work(seconds: float, comm: Any):
    """A stand-in for the next step's forward and backward (matrix products
    with autograd), calibrated to take about ``seconds`` alone; the slowest
    rank's repetition count is used everywhere, so all ranks do the same work."""
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(512, 2048, generator=g, requires_grad=True)
    w2 = torch.randn(2048, 512, generator=g, requires_grad=True)
    x = torch.randn(64, 512, generator=g)

    def once() -> None:
        ((x @ w1).relu() @ w2).square().mean().backward()

    once()
    t0 = time.perf_counter()
    for _ in range(3):
        once()
    per_rep = (time.perf_counter() - t0) / 3
    reps = int(max_over_ranks(comm, max(1, round(seconds / per_rep))))

    def work() -> None:
        for _ in range(reps):
            once()

    return work


def _dir_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


HINTS_CANNOT_SHOW = (
    "What --hints cannot show on one machine's disk or tmpfs: there is no striping over storage targets, no "
    "byte-range lock traffic between clients and no metadata server, which are what alignment, meta blocks, "
    "collective buffering and striping hints address on Lustre/GPFS; here they change only the file's layout "
    "and size (alignment pads datasets) and the number of write calls. An MPI library ignores the MPI-IO hints "
    "it does not read (Open MPI's OMPIO takes its collective settings from MCA parameters). Measure on the "
    "target file system: docs/checkpointing.md.")


def main(argv: Optional[List[str]] = None) -> int:
    ap = ArgumentParser(prog="hpctrain-bench ckpt", description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512, help="hidden size (default 512)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="vocabulary (default 32768: the embedding and output matrices are 64 MiB each, "
                         "so they and their Adam states take the collective path)")
    ap.add_argument("--iters", type=int, default=5, help="measured iterations per contender")
    ap.add_argument("--step-s", type=float, default=0.25,
                    help="seconds of stand-in forward/backward after each async save (default 0.25)")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir under /tmp)")
    ap.add_argument("--collective-mb", type=float, default=None,
                    help="checkpoint.hdf5.collective_min_mb for hpctrain (default: the config default)")
    ap.add_argument("--local-dir", default=None,
                    help="the local tier's directory (default: a fresh directory under /dev/shm)")
    ap.add_argument("--every", type=int, default=50,
                    help="checkpoint.every for the time-lost-per-failure estimate (default 50)")
    ap.add_argument("--local-every", type=int, default=5,
                    help="checkpoint.local.every for the time-lost-per-failure estimate (default 5)")
    ap.add_argument("--hints", nargs="+", default=None, metavar="OVERRIDE",
                    help="file-system settings for one more hpctrain contender, measured beside the default in "
                         "every iteration: checkpoint.hdf5.{alignment,meta_block_size,sieve_buf_size}=N, "
                         "+checkpoint.hdf5.mpiio_hints.KEY=VALUE (docs/checkpointing.md)")
    ap.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    args = ap.parse_args(argv)
    if args.hints and not all(h.lstrip("+").startswith("checkpoint.hdf5.") and "=" in h for h in args.hints):
        ap.error("--hints takes checkpoint.hdf5.KEY=VALUE overrides (+checkpoint.hdf5.mpiio_hints.KEY=VALUE for "
                 f"MPI-IO hints), not {' '.join(args.hints)}")

    import h5py  # the h5ckpt plugin's dependency: only when the benchmark runs
    import torch.distributed.checkpoint as dcp  # heavy: the peer, only when the benchmark runs


    rt = init_runtime("cpu")
    comm, rank, size = rt.mpi_comm, rt.world_rank, rt.world_size
    init_torch_distributed("gloo")
    pm = get_manager()
    base = comm.bcast(args.dir or tempfile.mkdtemp(prefix="hpctrain-bench-ckpt-") if rank == 0 else None, root=0)
    overrides = [f"checkpoint.dir={base}", "checkpoint.keep=0"]
    if args.collective_mb is not None:
        overrides.append(f"checkpoint.hdf5.collective_min_mb={args.collective_mb}")

    def checkpointer(*extra: str) -> Any:
        """The hdf5 checkpointer as the trainer gets it: through the plugin hook."""
        c = to_config(OmegaConf.to_container(compose(overrides + list(extra), pm=pm), resolve=True), pm)
        return c, pm.hook.hpctrain_make_checkpointer(name="hdf5", mesh=None, cfg=c, run_dir=None)

    cfg, sync_ck = checkpointer()
    unverified_ck = checkpointer("checkpoint.hdf5.verify=false")[1]
    hinted_ck = checkpointer(*args.hints)[1] if args.hints else None
    modes = ("overlap", "blocking")
    async_cks = {m: checkpointer("checkpoint.async_save=true", f"checkpoint.hdf5.staging={m}")[1] for m in modes}
    if sync_ck is None:
        print_rank0(comm, "hpctrain-bench ckpt: no installed plugin serves checkpoint.format=hdf5")
        return 2
    run_state = _stand_in(cfg, _shapes(args.d_model, args.layers, args.vocab), rank, size)

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local_dir = comm.bcast(args.local_dir or tempfile.mkdtemp(prefix="hpctrain-bench-local-", dir=shm)
                           if rank == 0 else None, root=0)
    tier = LocalTier(checkpointer("checkpoint.local.every=1", f"checkpoint.local.dir={local_dir}",
                                  f"checkpoint.local.replicas={min(1, rt.num_nodes - 1)}")[0], run_state.mesh, rt)
    params = sum(p.numel() for p in run_state.model.parameters()) * size
    state_bytes = 12 * params
    io = "MPI-IO" if (h5py.get_config().mpi and cfg.checkpoint.hdf5.driver != "serial") else "serial"
    state = _dcp_state(run_state, size)
    work = _step_work(args.step_s, comm)
    keys = ["h5 save", "dcp save", "h5 load", "dcp load", "h5 load unverified", "work alone", "hinted save",
            "hinted load"]
    keys += [f"{m} {k}" for m in modes for k in ("blocked", "steps", "added", "committed")]
    keys += ["local save", "local blocked", "local steps", "local added", "local load"]
    t: Dict[str, List[float]] = {k: [] for k in keys}
    previous: List[str] = []
    for it in range(args.iters + 1):  # iteration 0 warms up (page cache, allocators, plans)
        # New names every iteration, as training writes each checkpoint anew;
        # the previous iteration's files are removed here, untimed.
        h5_path, dcp_path = os.path.join(base, f"ours-{it}.h5"), os.path.join(base, f"dcp-{it}")
        async_paths = {m: os.path.join(base, f"ours-async-{m}-{it}.h5") for m in modes}
        hinted_path = os.path.join(base, f"ours-hinted-{it}.h5")
        if rank == 0:
            for old in previous:
                if os.path.isdir(old):
                    shutil.rmtree(old)
                else:
                    os.remove(old)
        previous = [h5_path, dcp_path, *async_paths.values()] + ([hinted_path] if hinted_ck is not None else [])
        comm.Barrier()
        runs = {
            "h5 save": lambda p=h5_path: sync_ck.save(run_state, p),
            "dcp save": lambda p=dcp_path: dcp.save(state, checkpoint_id=p),
            "h5 load": lambda p=h5_path: sync_ck.load(run_state, p),
            "dcp load": lambda p=dcp_path: dcp.load(state, checkpoint_id=p),
            "h5 load unverified": lambda p=h5_path: unverified_ck.load(run_state, p),
            "work alone": work,
        }
        if hinted_ck is not None:  # right after the default's save and load, so the two meet the same load
            runs = {**{k: runs[k] for k in ("h5 save", "h5 load")},
                    "hinted save": lambda p=hinted_path: hinted_ck.save(run_state, p),
                    "hinted load": lambda p=hinted_path: hinted_ck.load(run_state, p),
                    **{k: v for k, v in runs.items() if k not in ("h5 save", "h5 load")}}
        for key, fn in runs.items():
            dt = max_over_ranks(comm, timed_call(comm, fn))
            if it:
                t[key].append(dt)
        for mode, ck in async_cks.items():
            # what the trainer does: save at the end of a step, then steps
            # (forward/backward, before_update() right before the optimizer
            # step) until the save has committed, so the whole background
            # copy and write is charged to the steps it overlaps
            comm.Barrier()
            t0 = time.perf_counter()
            ck.save(run_state, async_paths[mode])
            blocked, steps = time.perf_counter() - t0, 0
            while steps == 0 or ck.busy:
                work()
                t1 = time.perf_counter()
                ck.before_update()
                blocked += time.perf_counter() - t1
                steps += 1
            overlapped = time.perf_counter() - t0
            ck.wait()
            committed = time.perf_counter() - t0
            if it:
                measured = {"blocked": blocked, "steps": steps, "added": overlapped - steps * t["work alone"][-1],
                            "committed": committed}
                for k, v in measured.items():
                    t[f"{mode} {k}"].append(max_over_ranks(comm, v))
        # the local tier: a save waited for (throughput), then one overlapped with steps (blocking)
        run_state.step = 2 * it + 1
        comm.Barrier()
        t0 = time.perf_counter()
        tier.save(run_state)
        tier.wait()
        local_save = time.perf_counter() - t0
        run_state.step = 2 * it + 2
        comm.Barrier()
        t0 = time.perf_counter()
        blocked, steps = tier.save(run_state), 0
        while steps == 0 or tier.busy:
            work()
            blocked += tier.before_update()  # as the trainer does right before the optimizer step
            steps += 1
        overlapped = time.perf_counter() - t0
        t1 = time.perf_counter()
        tier.wait()  # what the next save would wait for
        blocked += time.perf_counter() - t1
        comm.Barrier()
        t0 = time.perf_counter()
        tier.load(run_state, tier.agree(run_state))
        local_load = time.perf_counter() - t0
        if it:
            measured = {"save": local_save, "blocked": blocked, "steps": steps,
                        "added": overlapped - steps * t["work alone"][-1], "load": local_load}
            for k, v in measured.items():
                t[f"local {k}"].append(max_over_ranks(comm, v))
    tier.close()
    med = {k: statistics.median(v) for k, v in t.items()}
    # Both contenders run back to back in each iteration, so the machine's load
    # affects both alike there: the median of per-iteration ratios is steadier
    # than the ratio of medians on a shared machine.
    ratio = {op: paired_ratio(t[f"dcp {op}"], t[f"h5 {op}"]) for op in ("save", "load")}
    ratio["load unverified"] = paired_ratio(t["dcp load"], t["h5 load unverified"])
    block = {m: paired_ratio(t[f"{m} blocked"], t["h5 save"]) for m in modes}
    mb = state_bytes / 1e6
    h5_size, dcp_size = comm.bcast((_dir_size(h5_path), _dir_size(dcp_path)) if rank == 0 else None, root=0)

    table = Table([Column("operation", align="<"), Column("hpctrain HDF5 s", "{:.3f}"), Column("DCP s", "{:.3f}"),
                   Column("hpctrain MB/s", "{:,.0f}"), Column("DCP MB/s", "{:,.0f}"),
                   Column("hpctrain / DCP throughput", "{:.2f}x")])
    for op in ("save", "load", "load unverified"):
        ours, theirs = med[f"h5 {op}"], med[f"dcp {op.split()[0]}"]
        table.add(op.replace("unverified", "(checkpoint.hdf5.verify=false)"), ours, theirs, mb / ours, mb / theirs,
                  ratio[op])
    asy = Table([Column("save (checkpoint.hdf5.staging)", align="<"), Column("training blocked s", "{:.3f}"),
                 Column("blocked x sync save", "{:.3f}"), Column("steps until committed", "{:.0f}"),
                 Column("step time added s", "{:.3f}"), Column("added x sync save", "{:.3f}"),
                 Column("until committed s", "{:.3f}")])
    for m in modes:
        asy.add(f"async, {m}", med[f"{m} blocked"], block[m], med[f"{m} steps"], med[f"{m} added"],
                med[f"{m} added"] / med["h5 save"], med[f"{m} committed"])
    asy.add("sync (for reference)", med["h5 save"], 1.0, 0, med["h5 save"], 1.0, med["h5 save"])
    step_s = med["work alone"]
    local_ratio = paired_ratio(t["h5 save"], t["local save"])
    loc = Table([Column("local tier vs persistent", align="<"), Column("s", "{:.3f}"), Column("MB/s", "{:,.0f}"),
                 Column("speed x persistent (same operation)", "{:.2f}x")])
    loc.add("persistent save (hdf5, sync)", med["h5 save"], mb / med["h5 save"], 1.0)
    loc.add(f"local save + replicate ({tier.replicas} partner)", med["local save"], mb / med["local save"],
            local_ratio)
    loc.add("persistent load (hdf5)", med["h5 load"], mb / med["h5 load"], 1.0)
    loc.add("local load (agree + read + restore)", med["local load"], mb / med["local load"],
            paired_ratio(t["h5 load"], t["local load"]))
    blk = Table([Column("local tier, one save in training", align="<"), Column("s", "{:.3f}"),
                 Column("x step", "{:.3f}")])
    blk.add("step (stand-in forward/backward)", step_s, 1.0)
    blk.add("training blocked (host copy + wait)", med["local blocked"],
            paired_ratio(t["local blocked"], t["work alone"]))
    blk.add(f"step time added over {med['local steps']:.0f} step(s) until written and replicated",
            med["local added"], med["local added"] / step_s)
    # a failure at a uniformly random step recomputes half an interval on average, plus the load
    lost_p = args.every / 2 * step_s + med["h5 load"]
    lost_l = args.local_every / 2 * step_s + med["local load"]
    size_t = Table([Column("file", align="<"), Column("bytes", "{:,}"), Column("x 12 bytes/param", "{:.4f}"),
                    Column("x 14 bytes/param", "{:.4f}")])
    size_t.add("hpctrain .h5", h5_size, h5_size / (12 * params), h5_size / (14 * params))
    size_t.add("DCP directory", dcp_size, dcp_size / (12 * params), dcp_size / (14 * params))
    hinted_lines: List[str] = []
    if hinted_ck is not None:
        hinted_size = comm.bcast(_dir_size(hinted_path) if rank == 0 else None, root=0)
        size_t.add("with --hints: hpctrain .h5", hinted_size, hinted_size / (12 * params), hinted_size / (14 * params))
        hin = Table([Column("operation (sync)", align="<"), Column("default s", "{:.3f}"),
                     Column("with --hints s", "{:.3f}"), Column("speed x default", "{:.2f}x")])
        for op in ("save", "load"):
            hin.add(f"hints {op}", med[f"h5 {op}"], med[f"hinted {op}"], paired_ratio(t[f"h5 {op}"], t[f"hinted {op}"]))
        hinted_lines = ["", "--hints " + " ".join(args.hints), hin.render(args.markdown), "", HINTS_CANNOT_SHOW]
    print_rank0(comm, f"# hpctrain-bench ckpt: {params / 1e6:.1f}M fp32 parameters + AdamW state = {mb:.0f} MB, "
                f"sharded on dim 0 over {size} ranks; median of {args.iters} (slowest rank); hpctrain "
                f"{io}, collective I/O for datasets >= {cfg.checkpoint.hdf5.collective_min_mb} MiB",
                machine_summary(comm), "", table.render(args.markdown), "", asy.render(args.markdown), "",
                size_t.render(args.markdown), *hinted_lines, "", loc.render(args.markdown), "",
                blk.render(args.markdown),
                "", f"Time lost per failure (mean, restart and queue wait not counted): persistent only, "
                f"checkpoint.every={args.every}: {args.every / 2:g} steps x {step_s:.3f} s + load "
                f"{med['h5 load']:.3f} s = {lost_p:.2f} s; with checkpoint.local.every={args.local_every}: "
                f"{args.local_every / 2:g} x {step_s:.3f} s + local load {med['local load']:.3f} s = {lost_l:.2f} s "
                f"({lost_p / lost_l:.1f}x less). Local tier target: blocked <= 0.05 x step.",
                "", f"Each async save is followed by steps of stand-in forward/backward ({med['work alone']:.3f} s "
                f"alone, --step-s {args.step_s}) + before_update() until it has committed. blocked = time in save() "
                "and before_update(); added = save through the last step, minus the steps' forward/backward alone.",
                "12 bytes/param = fp32 param + Adam m, v (this state); 14 = mixed precision's 2 (bf16) + 12 "
                "(fp32 master + m + v) for comparison. Targets: save >= 1.0x DCP, async blocking <= 0.10x sync.")
    comm.Barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    if rank == 0 and args.local_dir is None:
        shutil.rmtree(local_dir, ignore_errors=True)
    return 0
