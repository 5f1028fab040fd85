"""``hpctrain-report`` on a run whose metrics.jsonl ends in a partial line (a run still writing, or
one killed mid-line): the line is skipped and said (one ``hpctrain: note:`` line on stderr, and a
note on the page), the rest rendered; a partial line that is not the last is damage: one error
line naming the file and the line, exit 2."""
from __future__ import annotations

import json

import pytest


def _records(n):
    return [{"step": s, "loss": 5.0 - 0.5 * s, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0 + s,
             "tokens_per_s_per_device": 1000.0 + s, "step_time_s": 0.1} for s in range(1, n + 1)]


def _write(run_dir, lines):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines))


@pytest.mark.parametrize("tail", ['{"step": 4, "loss": 3.', '{"step": 4, "loss": 3.0, "lr"\n'],
                         ids=["cut-mid-line", "cut-then-newline"])
def test_an_incomplete_last_line_is_skipped_and_said(tmp_path, capfd, tail):
    from hpctrain.report.cli import main

    run = tmp_path / "run"
    _write(run, [json.dumps(r) + "\n" for r in _records(3)] + [tail])
    assert main([str(run)]) == 0
    out, err = capfd.readouterr()
    path = run / "metrics.jsonl"
    assert err.splitlines() == [f"hpctrain: note: {path}: line 4 is incomplete ({len(tail.strip())} bytes, cut "
                                "short): skipped; the run is still writing it, or was stopped while it did"], err
    page = (run / "report.html").read_text()
    assert "line 4 is incomplete" in page
    assert "<td class=l>steps</td><td>3</td>" in page, page[:3000]


def test_a_bad_line_before_the_last_is_one_error_naming_it(tmp_path, capfd):
    from hpctrain.report.cli import main

    run = tmp_path / "run"
    lines = [json.dumps(r) + "\n" for r in _records(3)]
    lines[1] = lines[1][:20] + "\n"
    _write(run, lines)
    assert main([str(run)]) == 2
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"hpctrain: error: {run / 'metrics.jsonl'}: line 2 is not a JSON "
                                               "object ("), err
    assert err[0].endswith("the file is damaged: remove or repair that line"), err
    assert not (run / "report.html").exists()
