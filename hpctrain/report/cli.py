"""``hpctrain-report RUN_DIR [-o FILE]``: write the run's (or sweep's) page, ``report.html`` in it by default."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

from hpctrain.errors import ArgumentParser, ConfigError, HpctrainError, write_error


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hpctrain-report", description=(
        "One self-contained HTML page of a run: curves, layout, peak memory per rank, bytes per axis against the "
        "planner's prediction, stragglers, skipped steps and spikes, the pipeline timeline; of a sweep "
        "directory: its points side by side."))
    p.add_argument("run_dir", help="a run directory (metrics.jsonl) or a Hydra sweep directory (numbered points)")
    p.add_argument("-o", "--output", help="where to write the page (default: RUN_DIR/report.html)")
    return p


def _prediction(run) -> Tuple[Optional[Dict[str, float]], str]:
    from hpctrain.report.predict import predicted_bytes  # heavy: keeps --help fast

    if run.config is None or not run.layout:
        return None, "the run directory has no .hydra/config.yaml or layout.json"
    if not isinstance(run.config.model.vocab_size, int):  # a run older than its resolved_config.yaml
        return None, f"the run's config has model.vocab_size={run.config.model.vocab_size}, not a number"
    try:
        return predicted_bytes(run.config, run.layout["sizes"]), ""
    except (HpctrainError, KeyError, ValueError) as e:
        return None, f"the planner cannot model this config ({e})"


def build(run_dir: str) -> str:
    """The page's HTML for ``run_dir`` (a run or a sweep)."""
    from hpctrain.report import data, page  # heavy: keeps --help fast

    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir} is not a directory; give a run directory (runs/<date>/<time>) or a sweep's")
    if not data.is_run(run_dir) and data.sweep_points(run_dir):
        points = [data.load_run(p) for p in data.sweep_points(run_dir)]
        for point in points:
            for note in point.notes:
                write_error(note, "note")
        return page.sweep_page(run_dir, points)
    run = data.load_run(run_dir)
    for note in run.notes:  # said here too: also on the page's summary
        write_error(note, "note")
    predicted, why_not = _prediction(run)
    return page.run_page(run, predicted, why_not)


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        text = build(args.run_dir)
        out = args.output or os.path.join(args.run_dir, "report.html")
        with open(out, "w") as f:
            f.write(text)
    except HpctrainError as e:
        write_error(str(e))
        return e.exit_code
    except OSError as e:
        write_error(f"cannot write the report: {e}; choose another -o FILE")
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
