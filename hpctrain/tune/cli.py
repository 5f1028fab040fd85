"""``hpctrain-tune``: under the same launcher as training,

    srun ... hpctrain-tune <hpctrain-train overrides> [--top K] [--steps S] [--out FILE] [--also "k=v ..."]
                           [--measure-iters N]

1. measures this allocation (``measure``): matmul TFLOP/s at the model's shapes, latency and bus
   bandwidth of each axis's groups, and writes them as a calibration file (``<out>.calibration.json``,
   what ``hpctrain-plan --calibration`` reads);
2. ranks every layout the planner considers with that calibration (``rank``);
3. trains the top K (and each ``--also`` layout, e.g. the one you run today) for S steps, one after
   the other in this job (``trial``; run directories ``<out>.runs/<n>``), a failing layout recorded
   with its reason;
4. prints predicted against measured step time and memory, their rank correlation, the fastest
   measured layout and its ``hpctrain-train`` command as ``hpctrain-plan`` prints commands, and writes
   everything to ``--out`` (JSON).

A bad argument or override is one ``hpctrain: error:`` line on rank 0 before any collective,
exit status 2. Without a cluster preset (``cluster.gpus=0``) the planner is told this allocation:
``cluster.gpus`` the world size, ``cluster.gpus_per_node`` the ranks per node, the memory per device
(CUDA: the device's; CPU: host memory / ranks per node), and the measured numbers; those planning
values do not enter the printed command.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, List, Optional, Tuple

from hpctrain.cli import _fail, crash
from hpctrain.errors import ArgumentParser, ConfigError, HpctrainError
from hpctrain.log import log_rank0


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="hpctrain-tune",
        description="Measure this allocation, re-rank the planner's layouts with it, train the best few, "
                    "print the fastest command.",
        epilog="Overrides as for hpctrain-train, e.g. model=tiny trainer.global_batch_size=8. See docs/planner.md.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (key=value, group=preset)")
    p.add_argument("--top", type=int, default=3, help="layouts to train, fastest predicted first (default 3)")
    p.add_argument("--steps", type=int, default=5, help="steps per layout; the first is warm-up (default 5)")
    p.add_argument("--out", default="tune.json", help="the JSON report (default tune.json); the calibration "
                                                      "and the runs go beside it")
    p.add_argument("--measure-iters", type=int, default=5, metavar="N",
                   help="timed repetitions of each measurement (the GEMMs, each group's all-reduces), after the "
                        "warm-up; the medians are of these (default 5)")
    p.add_argument("--also", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="also train this layout (overrides on top of the others; repeatable)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.top < 0:
        raise ConfigError(f"--top {args.top}: give the number of layouts to train (>= 0)")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give the steps per layout (>= 1; 3 or more to time "
                          "steps after the warm-up)")
    if args.measure_iters < 1:
        raise ConfigError(f"--measure-iters {args.measure_iters}: give the timed repetitions per measurement (>= 1)")
    if args.top == 0 and not args.also:
        raise ConfigError("--top 0 without --also trains nothing; give --top K")
    if not args.out.endswith(".json"):
        raise ConfigError(f"--out {args.out}: the report is JSON; give a file name ending in .json")


def _device_memory_gb(rt: Any) -> float:
    import torch  # heavy: keeps --help fast

    if rt.device.type == "cuda":
        return torch.cuda.get_device_properties(rt.device).total_memory / 1e9
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * size / 1e9 / max(1, rt.local_size)


def _planning_overrides(cfg: Any, overrides: List[str], rt: Any, matmul: float) -> List[str]:
    """The user's overrides plus what the planner needs to know about this allocation."""
    c = cfg.cluster
    if c.gpus and c.gpus != rt.world_size:
        raise ConfigError(f"cluster.gpus={c.gpus} but this job has {rt.world_size} ranks: hpctrain-tune tunes the "
                          f"allocation it runs on; drop cluster.gpus or launch {c.gpus} ranks")
    fills = []
    if not c.gpus:
        fills += [f"cluster.gpus={rt.world_size}", f"cluster.gpus_per_node={rt.local_size}"]
    if not c.gpu_mem_gb:
        fills.append(f"cluster.gpu_mem_gb={_device_memory_gb(rt):.3f}")
    if c.peak_tflops < matmul:  # no datasheet (a CPU): the measured rate is the ceiling
        fills.append(f"cluster.peak_tflops={matmul * 1.0001:.6g}")
    # placeholders only for the first ranking; every axis that a layout splits is measured
    if not c.intra_bw_gbs:
        fills.append("cluster.intra_bw_gbs=1")
    if not c.inter_bw_gbs:
        fills.append("cluster.inter_bw_gbs=1")
    return list(overrides) + fills


def _rank0(rt: Any, fn) -> Any:
    """``fn()`` on rank 0, its result (or its ConfigError) on every rank."""
    payload: Tuple[str, Any] = ("ok", None)
    if rt.is_main:
        try:
            payload = ("ok", fn())
        except HpctrainError as e:
            payload = ("error", str(e))
    if rt.world_size > 1:
        payload = rt.mpi_comm.bcast(payload, root=0)
    if payload[0] == "error":
        raise ConfigError(payload[1])
    return payload[1]


def _also(user: List[str], extra: str, precision_default: str) -> Tuple[str, List[str]]:
    """An ``--also`` layout: the user's overrides with ``extra``'s keys replaced by ``extra``."""
    given = shlex.split(extra)
    keys = {o.split("=", 1)[0].lstrip("+~") for o in given}
    kept = [o for o in user if o.split("=", 1)[0].lstrip("+~") not in keys]
    return f"also: {extra}", kept + given


def tune(args: argparse.Namespace, rt: Any, pm) -> int:
    from hpctrain.bootstrap import with_device  # heavy: keeps --help fast
    from hpctrain.config import compose_agreed  # heavy: keeps --help fast
    from hpctrain.planner.report import launch_line  # heavy: keeps --help fast
    from hpctrain.run import configure_torch  # heavy: keeps --help fast
    from hpctrain.tune import measure, rank, report  # heavy: keeps --help fast
    from hpctrain.tune.rank import Candidate  # heavy: keeps --help fast
    from hpctrain.tune.trial import run_trial  # heavy: keeps --help fast

    _check_args(args)
    user = list(args.overrides)
    cfg = compose_agreed(user, pm, rt.mpi_comm)
    if not any(o.split("=", 1)[0] == "trainer.precision" for o in user):
        user.append(f"trainer.precision={cfg.trainer.precision}")  # the training default, not the planner's bf16
    rt = with_device(cfg.trainer.device)
    configure_torch(cfg, rt)
    stem = args.out[:-len(".json")]
    cal_path = f"{stem}.calibration.json"

    log_rank0("hpctrain-tune: measuring matmul at the model's shapes on %d ranks", rt.world_size)
    tokens = cfg.trainer.micro_batch_size * cfg.trainer.seq_len
    matmul = measure.matmul_tflops(cfg.model, tokens, cfg.trainer.precision, rt.device, rt.mpi_comm,
                                   iters=args.measure_iters)
    planning = _planning_overrides(cfg, user, rt, matmul)

    def first_ranking() -> Any:
        plan, *_ = rank.plan(planning, None, pm)
        return rank.axis_layouts(plan.ranked), [rank.describe(e) for e in plan.ranked]

    axis_layouts, uncalibrated = _rank0(rt, first_ranking)
    log_rank0("hpctrain-tune: measuring the groups of %s", ", ".join(
        f"{a} (as in {label})" for a, (label, _) in axis_layouts.items()) or "no axis (one rank)")
    links = measure.measure_links(cfg, axis_layouts, rt, pm, iters=args.measure_iters)

    def calibrated_ranking() -> Any:
        cal = measure.calibration(matmul, links)
        plan, _, work, cluster, _, _ = rank.plan(planning, None, pm)
        peak = cluster.peak_flops / 1e12
        if cal["matmul_tflops"] > peak:  # the planner refuses more than the datasheet: noise, or a fast part
            cal["matmul_tflops"] = peak
        with open(cal_path, "w") as f:
            json.dump(cal, f, indent=1)
        plan, _, work, cluster, _, _ = rank.plan(planning, cal_path, pm)
        cands = rank.candidates(plan.ranked, user, work.precision, args.top)
        for extra in args.also:
            label, overrides = _also(user, extra, work.precision)
            cands.append(Candidate(label, overrides, None, None, {}, {}))
        return cal, cands, cluster

    cal, cands, cluster = _rank0(rt, calibrated_ranking)
    trials = []
    for i, c in enumerate(cands, start=1):
        log_rank0("hpctrain-tune: layout %d/%d: %s", i, len(cands), c.label)
        trials.append(run_trial(c.label, c.overrides, args.steps, f"{stem}.runs/{i}", rt, pm))
        if not trials[-1].ok:
            log_rank0("hpctrain-tune: layout %d failed: %s", i, trials[-1].reason)
    if rt.is_main:
        best = report.fastest(trials)
        command = launch_line(cluster, cands[best].overrides) if best is not None else None
        measured = {"matmul_tflops": matmul, "links": [vars(k) for k in links]}
        with open(args.out, "w") as f:
            json.dump(report.as_json(cands, trials, cal, measured, uncalibrated, command, args.steps), f, indent=1)
        print(report.text(cands, trials, command, args.steps, cal_path))
        print(f"report: {args.out}")
    return 0 if any(t.ok for t in trials) else 1


def main(argv: Optional[List[str]] = None) -> int:
    from hpctrain.bootstrap import init_runtime, shutdown  # heavy: keeps --help fast
    from hpctrain.plugins import get_manager  # heavy: keeps --help fast
    from hpctrain.train.watchdog import JobStopped  # heavy: keeps --help fast

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rt = init_runtime()
    except HpctrainError as e:
        return _fail(str(e), 0, 2)
    try:
        return tune(args, rt, get_manager())
    except JobStopped as e:
        return e.exit_code  # the watchdog's line already says which rank and operation
    except HpctrainError as e:
        code = _fail(str(e), rt.world_rank, e.exit_code)
        if rt.world_size > 1:
            rt.mpi_comm.Barrier()  # rank 0's line is out before any rank exits
        return code
    except Exception:  # noqa: BLE001 - a traceback and an MPI abort, never a hang
        return crash(rt)
    finally:
        shutdown()


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
