"""Merge JUnit XML files into one honest closing line.

A test id counts once. It failed if it failed (or errored) in any session
or on any rank; it passed if it passed somewhere and failed nowhere; it is
skipped only if every session skipped it (multi-rank tests skip in sessions
too small for them, and run in the others).
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from typing import Dict


def main(paths) -> int:
    state: Dict[str, str] = {}
    rank = {"skipped": 0, "passed": 1, "failed": 2}
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError) as e:
            print(f"summary: could not read {path}: {e}")
            state[f"<unreadable {path}>"] = "failed"
            continue
        for case in root.iter("testcase"):
            key = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            if rank[outcome] > rank[state.get(key, "skipped")] or key not in state:
                state[key] = outcome
    counts = {k: sum(1 for v in state.values() if v == k) for k in rank}
    for key, outcome in sorted(state.items()):
        if outcome == "failed":
            print(f"FAILED {key}")
    print(f"hpctrain: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
