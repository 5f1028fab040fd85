"""``hpctrain-bench NAME [args]`` (or ``python -m hpctrain.bench NAME``).

Each benchmark is a module with ``main(argv) -> int`` and a one-line module
docstring shown by ``hpctrain-bench --list``: the core's are
``hpctrain.bench.<NAME>``; a plugin offers its own through
``hpctrain_benchmarks`` (``cp``, ``moe``, ``pp``, ``tp`` and ``zero`` live in
their plugins, beside the internals they measure). Run multi-rank ones under the launcher,
e.g. ``mpiexec -n 2 hpctrain-bench comm``.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from typing import Dict, List, Optional

import hpctrain.bench as _pkg
from hpctrain.errors import write_error

_NOT_BENCHMARKS = {"cli", "__main__", "common", "torch_peer"}


def modules() -> Dict[str, str]:
    """Every benchmark: name -> module (the core's, then the plugins')."""
    from hpctrain.plugins import get_manager  # heavy: keeps --help fast

    found = {m.name: f"hpctrain.bench.{m.name}" for m in pkgutil.iter_modules(_pkg.__path__)
             if m.name not in _NOT_BENCHMARKS and not m.name.startswith("_")}
    for offered in get_manager().hook.hpctrain_benchmarks():
        for name, module in (offered or {}).items():
            found.setdefault(name, module)
    return found


def summary(module: str) -> str:
    """The first line of a benchmark module's docstring, read from its source
    without importing it (a benchmark's imports are the run's, not --list's)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        doc = importlib.import_module(module).__doc__
    else:
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""


def available() -> List[str]:
    return sorted(modules())


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    found = modules()
    names = sorted(found)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: hpctrain-bench NAME [options]   (NAME --help for its options)")
        for name in names:
            print(f"  {name:<8} {summary(found[name])}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        write_error(f"hpctrain-bench: unknown benchmark {name!r}; choose one of: {', '.join(names)}")
        return 2
    return int(importlib.import_module(found[name]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
