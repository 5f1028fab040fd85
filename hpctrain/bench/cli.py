"""``hpctrain-bench NAME [args]`` (or ``python -m hpctrain.bench NAME``).

Each benchmark is a module ``hpctrain.bench.<NAME>`` with ``main(argv) -> int``
and a one-line module docstring shown by ``hpctrain-bench --list``. Run
multi-rank ones under the launcher, e.g. ``mpiexec -n 2 hpctrain-bench comm``.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import List, Optional

import hpctrain.bench as _pkg

_NOT_BENCHMARKS = {"cli", "__main__", "common", "torch_peer"}


def available() -> List[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if m.name not in _NOT_BENCHMARKS and not m.name.startswith("_"))


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: hpctrain-bench NAME [options]   (NAME --help for its options)")
        for name in names:
            doc = (importlib.import_module(f"hpctrain.bench.{name}").__doc__ or "").strip().splitlines()
            print(f"  {name:<8} {doc[0] if doc else ''}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"hpctrain-bench: unknown benchmark {name!r}; choose one of: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"hpctrain.bench.{name}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
