"""A benchmark started wrongly ends with one ``hpctrain: error:`` line and status 2
(``hpctrain-bench``'s ``main``, in this process: a one-process world)."""
from __future__ import annotations

import pytest

from hpctrain.bench.cli import main


@pytest.mark.parametrize("name", ["dp", "comm", "cp", "moe"])
def test_one_process_is_refused_with_the_command_to_run(name, capfd):
    try:
        code = main([name])
    except SystemExit as stop:  # a benchmark may exit instead of returning its status
        code = stop.code
    assert code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines == [f"hpctrain: error: hpctrain-bench {name} needs at least 2 ranks; "
                     f"run it as mpiexec -n 2 hpctrain-bench {name}"], lines
