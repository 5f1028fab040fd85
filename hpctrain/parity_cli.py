"""``hpctrain-parity``: does my layout train what one process trains?

    mpirun -n 8 hpctrain-parity [--steps 3] [--loss-rtol 1e-5] [--grad-tol 1e-4] \\
        parallel=3d model.n_layers=4 ...

Takes the same overrides as ``hpctrain-train``, under the same launcher. All
ranks train ``--steps`` steps in the requested layout; rank 0 then trains
the same config in one process (the whole model in its memory: use the
model and batch you are checking, scaled down to fit) and prints, per step,
both losses, their relative difference and the largest per-parameter
gradient difference (max |g - g_ref| over max |g_ref|, the parameter
named). Ranks that should hold the same gradient piece but disagree are
reported too. Exit status 0 when every step is within tolerance, 1 when not,
2 for a config error (``hpctrain: error:`` lines, as hpctrain-train).

Defaults fit fp32: a correct layout changes only the order of sums (step 1
agrees to ~1e-6; AdamW's first updates amplify rounding in near-zero
gradients to ~1e-5 of the largest element later on), while a missing or
doubled reduction, a wrong shard or a token seen twice is off by 1e-3 or
more. With ``trainer.precision=bf16`` pass looser tolerances (e.g.
``--loss-rtol 2e-2 --grad-tol 5e-2``). Checkpointing is turned off for the
check; the learning-rate schedule is the config's own.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from hpctrain.bootstrap import idle_wait
from hpctrain.cli import _fail, crash
from hpctrain.errors import ArgumentParser, ConfigError, HpctrainError
from hpctrain.log import log_rank0
from hpctrain.parity import StepDiff, compare, record


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="hpctrain-parity", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="training steps to compare (default 3)")
    p.add_argument("--loss-rtol", type=float, default=1e-5, help="largest relative loss difference (default 1e-5)")
    p.add_argument("--grad-tol", type=float, default=1e-4,
                   help="largest gradient difference relative to the parameter's largest gradient element "
                        "(default 1e-4)")
    p.add_argument("overrides", nargs="*", help="hpctrain-train overrides (key=value, group=preset)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps={args.steps}: compare at least 1 step")
    if not (args.loss_rtol >= 0 and args.grad_tol >= 0):
        p.error("--loss-rtol and --grad-tol must be >= 0")
    steps = [o for o in args.overrides if o.lstrip("+").split("=", 1)[0] == "trainer.steps"]
    if steps:  # it would be ignored: both runs take --steps steps
        p.error(f"{steps[0]}: hpctrain-parity compares --steps N steps (default 3); give --steps instead")
    return args


def _compose_on_rank0(overrides: List[str], rt, pm):
    """Rank 0 composes (one error message per job), every rank gets its config."""
    from hpctrain.config import compose_agreed  # heavy: keeps --help fast

    try:
        return compose_agreed(overrides + ["checkpoint.every=0", "checkpoint.resume=null", "trainer.progress=off"],
                              pm, rt.mpi_comm)
    except ConfigError:
        raise
    except Exception as e:  # Hydra's composition errors: unknown keys, presets
        raise ConfigError(f"{type(e).__name__}: {e}") from e


def layout_label(sizes) -> str:
    return " x ".join(f"{a} {n}" for a, n in sizes.items() if n > 1) or "1 rank"


def report(diffs: List[StepDiff], loss_rtol: float, grad_tol: float) -> List[str]:
    """The table and the verdict line (the last line starts with OK or FAIL)."""
    lines = [f"{'step':>4}  {'loss (1 process)':>16}  {'loss (layout)':>14}  {'loss diff':>9}  "
             f"{'grad diff':>9}  worst parameter"]
    bad = []
    for d in diffs:
        lines.append(f"{d.step:>4}  {d.reference_loss:>16.8f}  {d.loss:>14.8f}  {d.loss_rel:>9.2e}  "
                     f"{d.grad_rel:>9.2e}  {d.worst_param}")
        if not d.loss_rel <= loss_rtol:
            bad.append(f"step {d.step}: loss differs by {d.loss_rel:.2e} relative (tolerance {loss_rtol:g})")
        if not d.grad_rel <= grad_tol:
            bad.append(f"step {d.step}: gradient of {d.worst_param} differs by {d.grad_rel:.2e} of its largest "
                       f"element (tolerance {grad_tol:g})")
        if d.missing:
            bad.append(f"step {d.step}: gradients of {', '.join(d.missing)} exist on one side only")
        for name, diff in sorted(d.replica_diffs.items()):
            bad.append(f"step {d.step}: ranks holding the same piece of {name}'s gradient disagree by {diff:.2e}")
    if bad:
        lines += [f"FAIL: {b}" for b in bad]
        lines.append("FAIL: the layout does not train what one process trains")
    else:
        lines.append(f"OK: every step within tolerance (losses {loss_rtol:g} relative, gradients {grad_tol:g} "
                     "of each parameter's largest element)")
    return lines


def check(args: argparse.Namespace, pm=None) -> int:
    """Run the comparison on every rank; 0 or 1 (same on every rank)."""
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    from hpctrain.bootstrap import get_runtime  # heavy: keeps --help fast
    from hpctrain.plugins import get_manager  # heavy: keeps --help fast
    from hpctrain.run import prepare_run, reference_trainer  # heavy: keeps --help fast

    rt = get_runtime()
    pm = pm or get_manager()
    cfg = _compose_on_rank0(list(args.overrides), rt, pm)
    trainer = prepare_run(cfg, None, pm)
    log_rank0("hpctrain-parity: %d steps at %s (%d ranks) against one process", args.steps,
              layout_label(trainer.mesh.sizes), rt.world_size)
    got = record(trainer, args.steps, MPI.COMM_WORLD, root=0)
    code = 0
    if rt.is_main:
        want = record(reference_trainer(cfg, pm), args.steps, MPI.COMM_SELF)
        lines = report(compare(got, want), args.loss_rtol, args.grad_tol)
        print("\n".join(lines), flush=True)
        code = 0 if lines[-1].startswith("OK") else 1
    if rt.world_size > 1:
        idle_wait(MPI.COMM_WORLD)  # the others sleep while rank 0 runs the reference
        code = MPI.COMM_WORLD.bcast(code, root=0)
    return code


def main(argv: Optional[List[str]] = None, pm=None) -> int:
    from hpctrain.bootstrap import init_runtime, shutdown  # heavy: keeps --help fast

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        rt = init_runtime()
    except HpctrainError as e:
        return _fail(str(e), 0, 2)
    try:
        return check(args, pm)
    except HpctrainError as e:  # validation is agreed over every rank: all raise it together
        return _fail(str(e), rt.world_rank, e.exit_code, e.prefix)
    except Exception:  # noqa: BLE001 - one rank's failure must not leave the others waiting in a collective
        return crash(rt)
    finally:
        shutdown()


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
