"""The suite's first stage: ruff and mypy, as configured in pyproject.toml.

Prints each tool's report under its name and records one JUnit test case
per tool (``lint::ruff``, ``lint::mypy``) in the XML file given, so
``scripts/summarize_tests.py`` counts a report like a failed test. Exit
status 1 when either tool reports anything.

Usage: python scripts/lint.py [JUNIT_XML]   (from the repository root)
"""
from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import List, Optional

# the virtual environment's own tools, with the versions pinned in the test extra
CHECKS = {
    "ruff": [sys.executable, "-m", "ruff", "check"],
    "mypy": [sys.executable, "-m", "mypy"],
}


def main(argv: List[str]) -> int:
    xml_path: Optional[str] = argv[0] if argv else None
    if xml_path is not None and (len(argv) > 1 or not xml_path.endswith(".xml")):
        # it checks the whole repository; a file named here would be overwritten with the report
        print(f"lint: error: {' '.join(argv)}: the only argument is the JUnit report to write (a .xml file); "
              "ruff and mypy check what pyproject.toml names", file=sys.stderr)
        return 2
    suite = ET.Element("testsuite", name="lint")
    failed = 0
    for name, cmd in CHECKS.items():
        print(f"-- {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        try:
            run = subprocess.run(cmd, capture_output=True, text=True)
            report, code = (run.stdout + run.stderr).rstrip(), run.returncode
        except OSError as e:
            report, code = f"could not run {name}: {e}", 1
        print(report, flush=True)
        case = ET.SubElement(suite, "testcase", classname="lint", name=name,
                             time=f"{time.monotonic() - start:.2f}")
        if code != 0:
            failed += 1
            ET.SubElement(case, "failure", message=f"{name} reported problems (exit {code})").text = report
    suite.set("tests", str(len(CHECKS)))
    suite.set("failures", str(failed))
    if xml_path:
        ET.ElementTree(suite).write(xml_path, encoding="utf-8", xml_declaration=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
