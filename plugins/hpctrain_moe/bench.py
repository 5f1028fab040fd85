"""MoE: dispatch + combine bus bandwidth vs raw mpi4py Alltoallv; the MoE layer at ep = world vs one process.

Run under the launcher, e.g. ``mpiexec -n 2 --bind-to core hpctrain-bench
moe``; ep = the world size; extra ``key=value`` arguments are Hydra
overrides (the model's ``model.moe.*``, ``trainer.micro_batch_size`` and
``trainer.seq_len`` set the layer and its tokens per rank).

1. Exchange. One MoE layer routes each rank's tokens (random weights and
   inputs, the same routing for every contender); the rows then go to
   their experts and come back, as in one training forward. Contenders,
   round-robin (``common.time_interleaved``), each call counted at its
   slowest rank:

   - ``raw-mpi4py``: two ``Alltoallv`` of the rows with the counts and
     displacements precomputed (the floor: no Python above MPI);
   - ``exchange[<backend>]``: the same two exchanges through our
     Communicator (counting wrapper included) into the same kept buffers
     as raw's: what our communication layer adds, on our mpi and torch
     (gloo) backends;
   - ``ours[<backend>]``: the two exchanges as the layer runs them, the
     core's differentiable ``all_to_all``, whose outputs are new tensors
     every call (autograd keeps them), where raw reuses its buffers;
   - ``dispatch+combine[<backend>]``: what the layer really runs: the
     counts exchange and sort (``plan_dispatch``), gathering the rows,
     both exchanges and the weighted sum back into tokens, with identity
     experts: computing in place, their results are the dispatched rows,
     so those are laid out where the layer's experts write their results
     (``dispatch(experts_in_place=True)``: room behind them for the rows
     coming back).

   Bus bandwidth: bytes this rank sends to others in both exchanges (the
   nccl-tests all-to-all convention, what ``comm_bytes.ep`` counts) over
   the time; the ratio is to raw-mpi4py.
2. Layer. Forward + backward of the whole MoE layer (router, losses,
   dispatch, experts, combine) at ep = world on each rank's tokens, against
   the same layer holding every expert in one process on all ranks' tokens
   (rank 0 alone, the others idle): the speed-up, whose ideal is the world
   size when each rank has its own core.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, cast

import torch
from omegaconf import OmegaConf

from hpctrain.bench.common import (
    Column,
    Table,
    machine_summary,
    paired_ratio,
    print_rank0,
    time_collective,
    time_interleaved,
)
from hpctrain.bench.torch_peer import start
from hpctrain.comm.differentiable import all_to_all
from hpctrain.config import plugin_section
from hpctrain.config.store import to_config
from hpctrain.errors import ArgumentParser
from hpctrain.model.aux import collect_aux_losses
from hpctrain.run import build_mesh

from hpctrain_moe.config import MoEConfig
from hpctrain_moe.dispatch import combine, dispatch, plan_dispatch
from hpctrain_moe.layer import MoE, MoERegions
from hpctrain_moe.router import route

if TYPE_CHECKING:  # pragma: no cover
    from hpctrain.mesh import Group

DEFAULT_OVERRIDES = (  # 8 experts of width 1024 on d_model 512, top-2; 2048 tokens per rank
    "model=tiny-moe", "model.d_model=512", "model.ffn_hidden=1024", "model.moe.num_experts=8",
    "model.moe.top_k=2", "trainer.micro_batch_size=8", "trainer.seq_len=256",
)


def make_layer(cfg: Any, group: Optional[Group], seed: int = 0):
    """The MoE layer of ``cfg`` with random weights (the same on every rank),
    holding this rank's experts of ``group`` (None: all of them)."""
    m = plugin_section(cfg, "model.moe", MoEConfig)
    torch.manual_seed(seed)
    layer = MoE(cfg.model.d_model, cfg.model.ffn_hidden, m, MoERegions(ep=group))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    if group is not None and group.size > 1:
        ex, local = layer.experts, m.num_experts // group.size
        first = group.rank * local
        for name in ("w1", "w3", "w2"):
            setattr(ex, name, torch.nn.Parameter(getattr(ex, name)[first:first + local].clone()))
        ex.first, ex.local = first, local
    return layer


def tokens_of(cfg: Any, rank: int) -> torch.Tensor:
    t = cfg.trainer
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(t.micro_batch_size, t.seq_len, cfg.model.d_model, generator=g)


def _raw_alltoallv(mpi_comm: Any, send: torch.Tensor, recv: torch.Tensor, send_rows: List[int],
                   recv_rows: List[int], width: int):
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    def displs(rows):
        out, at = [], 0
        for r in rows:
            out.append(at)
            at += r * width
        return out

    sc, rc = [r * width for r in send_rows], [r * width for r in recv_rows]
    sd, rd = displs(send_rows), displs(recv_rows)
    s, r = send.numpy(), recv.numpy()
    back = torch.empty_like(send).numpy()

    def call():
        mpi_comm.Alltoallv([s, (sc, sd), MPI.FLOAT], [r, (rc, rd), MPI.FLOAT])
        mpi_comm.Alltoallv([r, (rc, rd), MPI.FLOAT], [back, (sc, sd), MPI.FLOAT])
    return call


def exchange_table(args: Any, cfg: Any, rt: Any, pm: Any) -> Tuple[Table, float]:
    world = rt.mpi_comm
    x = tokens_of(cfg, rt.world_rank).reshape(-1, cfg.model.d_model)
    contenders: List[Tuple[str, Callable[[], Any]]] = []
    sent_bytes = 0.0
    for backend in args.backends:
        raw = cast(Dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # (OmegaConf types it for any node)
        raw["comm"]["backend"] = backend
        group = build_mesh(to_config(raw, pm), rt, pm).group("ep")
        layer = make_layer(cfg, group)
        with torch.no_grad():
            r = route(layer.router.logits(x, layer.router.weight), layer.cfg.top_k, layer.cfg.router,
                      layer.router.expert_bias)
        plan = plan_dispatch(r.experts, r.weights, None, layer.cfg.num_experts, group)
        send = x[plan.token].contiguous()
        width = send.shape[1]
        if not contenders:
            recv = torch.empty(sum(plan.recv_splits), width)
            contenders.append(("raw-mpi4py", _raw_alltoallv(world, send, recv, plan.send_splits,
                                                             plan.recv_splits, width)))
            own = plan.send_splits[group.rank]
            sent_bytes = 4.0 * width * ((sum(plan.send_splits) - own) + (sum(plan.recv_splits) - own))

        def exchange(g=group, p=plan, s=send):
            with torch.no_grad():
                rows = all_to_all(s, g, p.recv_splits, p.send_splits)
                return rows, all_to_all(rows, g, p.send_splits, p.recv_splits)

        contenders[0][1]()  # the raw exchange once, to check ours moves the same rows
        rows, back = exchange()
        if not (torch.equal(rows, recv) and torch.equal(back, send)):
            raise RuntimeError(f"ours[{backend}] and raw Alltoallv moved different rows")
        comm, kept_rows, kept_back = group.communicator(), torch.empty_like(recv), torch.empty_like(send)

        def kept(c=comm, p=plan, s=send, r=kept_rows, b=kept_back):
            c.all_to_all(r, s, p.recv_splits, p.send_splits)
            c.all_to_all(b, r, p.send_splits, p.recv_splits)
        contenders.append((f"exchange[{backend}]", kept))

        def whole(g=group, lay=layer, rr=r):
            with torch.no_grad():
                p = plan_dispatch(rr.experts, rr.weights, None, lay.cfg.num_experts, g)
                combine(dispatch(x, p, g, experts_in_place=True), p, g, x.shape[0])
        contenders += [(f"ours[{backend}]", exchange), (f"dispatch+combine[{backend}]", whole)]
    timings = time_interleaved([fn for _, fn in contenders], world, args.warmup, args.iters)
    samples = {label: tm.samples for (label, _), tm in zip(contenders, timings)}
    table = Table([Column("contender", "{}", "<"), Column("time (ms)", "{:.2f}"), Column("bus GB/s", "{:.2f}"),
                   Column("vs raw", "{:.3f}"), Column("paired", "{:.3f}")])
    base = statistics.median(samples["raw-mpi4py"])
    for label, _ in contenders:
        med = statistics.median(samples[label])
        paired = paired_ratio(samples["raw-mpi4py"], samples[label])
        table.add(label, med * 1e3, sent_bytes / med / 1e9, base / med, paired)
    return table, sent_bytes


def _forward_backward(layer: Any, x: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    with collect_aux_losses() as aux:
        out = layer(x)
    (out.square().mean() + aux.total()).backward()


def layer_table(args: Any, cfg: Any, rt: Any, pm: Any) -> Table:
    world = rt.mpi_comm
    raw = cast(Dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # (OmegaConf types it for any node)
    raw["comm"]["backend"] = args.backends[0]
    group = build_mesh(to_config(raw, pm), rt, pm).group("ep")
    mine = tokens_of(cfg, rt.world_rank).requires_grad_()
    parallel = make_layer(cfg, group)
    ep_time = time_collective(lambda: _forward_backward(parallel, mine), world, args.warmup, args.iters)
    # one process: every expert, every rank's tokens, on rank 0 while the others wait
    one = None
    if rt.world_rank == 0:
        alone = make_layer(cfg, None)
        everything = torch.cat([tokens_of(cfg, r) for r in range(rt.world_size)]).requires_grad_()
        for _ in range(args.warmup):
            _forward_backward(alone, everything)
        runs = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            _forward_backward(alone, everything)
            runs.append(time.perf_counter() - t0)
        one = statistics.median(runs)
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.01)
    one = world.bcast(one, root=0)
    n = rt.world_size
    table = Table([Column("layer", "{}", "<"), Column("tokens per rank", "{}"), Column("fwd+bwd (ms)", "{:.1f}"),
                   Column("speed-up", "{:.2f}"), Column("ideal", "{}")])
    t = cfg.trainer
    per_rank = t.micro_batch_size * t.seq_len
    table.add("one process, all experts", per_rank * n, one * 1e3, 1.0, 1)
    table.add(f"ep={n} [{args.backends[0]}]", per_rank, ep_time.median * 1e3, one / ep_time.median, n)
    return table


def run(args: Any, cfg: Any, rt: Any, pm: Any) -> None:
    world = rt.mpi_comm
    m, t = cfg.model, cfg.trainer
    print_rank0(world, f"# {machine_summary(world)}",
                f"# MoE layer d_model={m.d_model}, {m.moe.num_experts} experts of width {m.ffn_hidden}, "
                f"top-{m.moe.top_k}; {t.micro_batch_size * t.seq_len} tokens per rank; ep={rt.world_size}",
                f"# {args.warmup} warm-up calls, median of {args.iters} (exchange: round-robin)")
    table, sent = exchange_table(args, cfg, rt, pm)
    print_rank0(world, "", f"## dispatch + combine ({sent / 1e6:.2f} MB sent per rank)", table.render(args.markdown))
    print_rank0(world, "", "## MoE layer forward + backward", layer_table(args, cfg, rt, pm).render(args.markdown))


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-bench moe", description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    p.add_argument("--backends", type=lambda s: s.split(","), default=["mpi", "torch"],
                   help="comm.backend of our contenders (default mpi,torch; the layer uses the first)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per contender (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per contender first (default 3)")
    p.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    given = [*DEFAULT_OVERRIDES, *args.overrides]
    micro = int([o for o in given if o.startswith("trainer.micro_batch_size=")][-1].split("=", 1)[1])
    # one micro-batch per rank: the global batch follows the micro-batch and the world
    started = start("moe", lambda n: [*given, f"trainer.global_batch_size={micro * n}", f"parallel.ep={n}"])
    if started is None:
        return 2
    run(args, *started)
    return 0
