"""LoRA against full fine-tuning from two runs' metrics.jsonl: peak memory and step time, and their ratio.

    python examples/finetune/compare.py FULL/metrics.jsonl LORA/metrics.jsonl [--skip 5]

Step time: the median of step_time_s past the first --skip steps (warm-up); memory: the largest
cuda_max_allocated_bytes (on GPUs) or peak_rss_bytes (the process's resident set on CPUs) any step logged.
"""
from __future__ import annotations

import argparse
import json
import statistics


def summary(path: str, skip: int) -> tuple:
    rows = [json.loads(line) for line in open(path)]
    steps = [r for r in rows if "step_time_s" in r]
    key = "cuda_max_allocated_bytes" if any("cuda_max_allocated_bytes" in r for r in steps) else "peak_rss_bytes"
    return statistics.median(r["step_time_s"] for r in steps[skip:]), max(r.get(key, 0) for r in steps), key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("full")
    parser.add_argument("lora")
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    (tf, mf, key), (tl, ml, _) = summary(args.full, args.skip), summary(args.lora, args.skip)
    print(f"| run | step time (median) | {key} (max over steps) |")
    print("|---|---|---|")
    print(f"| full | {tf * 1e3:.1f} ms | {mf / 2**20:,.0f} MiB |")
    print(f"| lora | {tl * 1e3:.1f} ms | {ml / 2**20:,.0f} MiB |")
    print(f"| lora / full | {tl / tf:.2f} | {ml / mf:.2f} |")


if __name__ == "__main__":
    main()
