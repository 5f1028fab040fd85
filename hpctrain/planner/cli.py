"""``hpctrain-plan``: predict memory and step time of every layout, print the best.

    hpctrain-plan model=llama3-8b cluster=h100-80gb cluster.gpus=64 \\
        trainer.global_batch_size=512 trainer.seq_len=8192 \\
        [--json] [--top N] [--calibration FILE] [--pin zero=1] [--pin recompute=selective]
    hpctrain-plan --validate [TABLE] [--json]   (the planner against published runs)

Arguments are the same Hydra overrides ``hpctrain-train`` takes (the config
is composed the same way, plugins' sections included). Explicit
``parallel.<axis>=N``, ``trainer.micro_batch_size=N``, ``parallel.zero.stage=N``,
``model.recompute=...``, ``parallel.pipeline.schedule=...``,
``parallel.pipeline.vpp=N`` or ``parallel.pipeline.layers=[...]`` pin that value (``--pin zero=1`` and friends are
the same); the planner searches the rest.
The optimizer is the run's (``optim=lamb``, or ``--pin optim=lamb``): its state bytes per
parameter enter the memory (``memory.optimizer_profile``).
Without ``trainer.precision`` it plans bf16 (what GPU runs use; the presets'
peaks are bf16 peaks).

Exit status: 0 with a plan, 2 when the input is wrong or nothing fits (the
message names what is missing or the smallest change that would fit).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from hpctrain.errors import ArgumentParser, HpctrainError, write_error


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="hpctrain-plan",
        description="Rank parallel layouts by predicted step time among those that fit GPU memory.",
        epilog="Overrides as for hpctrain-train, e.g. model=llama3-8b cluster=h100-80gb cluster.gpus=64 "
               "trainer.global_batch_size=512 trainer.seq_len=8192. See docs/planner.md.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (key=value, group=preset)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--compare", metavar="RUN_DIR", help="predict a finished run's own layout and print it beside "
                   "what its metrics.jsonl measured (overrides: the machine it ran on, e.g. cluster=cpu-8)")
    p.add_argument("--calibration", metavar="FILE", help="JSON with measured matmul_tflops, busbw... (docs/planner.md)")
    p.add_argument("--pin", action="append", default=[], metavar="KEY=VALUE",
                   help="fix a knob (the same as its config key): zero=0..3, recompute=none|selective|full, "
                        "schedule=1f1b|interleaved|zb-h1|gpipe, vpp=N, layers=[7,8,8,7], "
                        "optim=adamw|lamb|lars|muon (the optimizer's state bytes; the same as the optim=NAME "
                        "override) (repeatable)")
    p.add_argument("--validate", nargs="?", const="", metavar="TABLE",
                   help="pin the planner to each published run's layout (hpctrain/planner/published_runs.yaml, or "
                        "TABLE) and print predicted against published MFU with the summary (docs/planner.md)")
    p.add_argument("--write-band", action="store_true",
                   help="with --validate of the shipped table: store its error band "
                        "(hpctrain/planner/validation_band.yaml), which hpctrain-plan prints beside its MFU")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    # heavy (Hydra, the plugins): after parsing, so --help and a bad flag stay fast
    from hpctrain.planner import band, report  # heavy: after parsing (above)
    from hpctrain.planner.plan import check_with_training, make_plan, parse_pins  # heavy: after parsing (above)
    from hpctrain.plugins import create_manager  # heavy: after parsing (above)

    if args.validate is not None:
        from hpctrain.planner import validate  # heavy: after parsing (above)

        try:
            if args.write_band and args.validate:
                raise HpctrainError("--write-band stores the band of the shipped table: give --validate no TABLE")
            outcomes, table = validate.run_validation(args.validate or None, args.overrides, create_manager)
        except HpctrainError as e:
            write_error(str(e))
            return 2
        print(json.dumps(validate.as_json(outcomes, table), indent=1) if args.json else validate.text(outcomes, table))
        if args.write_band:
            band.write_band(validate.band(outcomes))
            print(f"band written to {band.BAND_FILE}", file=sys.stderr)
        return 0
    if args.write_band:
        write_error("--write-band goes with --validate")
        return 2
    if args.compare:
        from hpctrain.planner.compare import compare  # heavy: after parsing (above)

        try:
            print(compare(args.compare, args.overrides, args.calibration, create_manager()))
        except HpctrainError as e:
            write_error(str(e))
            return 2
        return 0
    try:
        pm = create_manager()
        plan, arch, work, cluster, cfg, user = make_plan(args.overrides, args.calibration, pm, parse_pins(args.pin))
        best = plan.best
        overrides = report.train_overrides(user, best.layout, work.precision)
        missing, problems = check_with_training(cfg, overrides, cluster.gpus, pm)
    except HpctrainError as e:
        write_error(str(e))
        return 2
    if args.json:
        print(json.dumps(report.as_json(plan, arch, work, cluster, args.top, overrides, missing, problems), indent=1))
        return 0
    print(report.summary(arch, work, cluster))
    print(f"{plan.considered} layouts considered, {len(plan.ranked)} fit; fastest first (memory in GB per GPU):")
    print(report.table(plan.ranked[:args.top]))
    print(report.best_text(best, overrides, missing, problems, cluster))
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
