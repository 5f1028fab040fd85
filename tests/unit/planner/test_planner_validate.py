"""The published-runs table and ``hpctrain-plan --validate``.

The table must stay complete, cited and consistent (a transcription slip in a
step time shows up as a published MFU that no longer matches the MFU the same
source prints); the held-out flags must follow the rule fixed before any
prediction was seen; ``--validate`` must report every row (a refusal or an
inexpressible run with its reason, never dropped) and the summary for all
rows and for the held-out ones. The planner's accuracy itself is not
asserted: it is reported (docs/planner.md) and expected to change.
"""
from __future__ import annotations

import contextlib
import io
import json
from collections import defaultdict

import pytest
import yaml

from hpctrain.planner.arch import Arch
from hpctrain.planner.cli import main
from hpctrain.planner.published import DEFAULT_TABLE, held_out_by_rule, load_runs
from hpctrain.planner.validate import published_figures

A100_PEAK, H100_PEAK = 312e12, 989e12
SUBSET = ["korthikanti2022-175b-full", "korthikanti2022-1t-present", "torchtitan2412-8b-fsdp-8gpu",
          "torchtitan2412-70b-2d-fp8"]


@pytest.fixture(scope="module")
def runs():
    return load_runs()


def _main(*argv: str):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def full_json():
    """One validation of the whole shipped table (the slow part, done once)."""
    code, out, err = _main("--validate", "--json")
    assert code == 0, err
    return json.loads(out)


def test_table_is_complete_and_cited(runs):
    assert len(runs) >= 38
    assert len({r.id for r in runs}) == len(runs)
    assert len({r.source.key for r in runs}) >= 6
    for r in runs:
        assert r.source.cite.strip() and r.source.read_from.strip() and r.where.strip()
        lay = r.layout
        assert lay.tp * lay.pp * lay.dp * lay.cp * lay.ep == r.gpus
        assert r.global_batch % lay.dp == 0 and r.seq_len >= 1024
        m = r.model
        assert min(m.layers, m.hidden, m.heads, m.kv_heads, m.ffn) >= 1
        p = r.published
        assert any(x is not None for x in (p.step_time_s, p.tokens_per_s_per_gpu, p.tflops_per_gpu, p.mfu))


def test_held_out_flags_follow_the_rule(runs):
    index = defaultdict(int)
    for r in runs:
        assert r.held_out == held_out_by_rule(index[r.source.key]), r.id
        index[r.source.key] += 1
    held = sum(r.held_out for r in runs)
    assert len(runs) / 3 <= held <= len(runs) / 2


def test_transcribed_step_times_reproduce_the_printed_mfu(runs):
    """Korthikanti's Table 5 iteration times (via calculon) against the MFU the
    Megatron-LM README prints for the same runs, and the Megatron-Core table's
    TFLOP/s against its MFU column: two transcriptions that must agree."""
    checked = 0
    for r in runs:
        p = r.published
        if r.source.key == "korthikanti2022" and p.mfu is not None:
            m = r.model
            arch = Arch.gpt(m.layers, m.hidden, m.heads, int(m.vocab or 0), r.seq_len)
            mfu, basis, step = published_figures(r, arch, A100_PEAK)
            assert basis == "step time" and step == p.step_time_s
            assert mfu == pytest.approx(p.mfu, abs=0.005), r.id
            checked += 1
        if r.source.key == "mcore2024":
            assert p.tflops_per_gpu * 1e12 / H100_PEAK == pytest.approx(p.mfu, abs=0.005), r.id
            checked += 1
    assert checked == 4 + 9


def _subset_table(tmp_path, ids, shrink=(), reframe=None):
    """The shipped table's rows ``ids``; those in ``shrink`` on 16 GiB GPUs (so that the planner refuses
    them: every published layout fits where it ran); ``reframe``: {id: framework} run by another code."""
    data = yaml.safe_load(DEFAULT_TABLE.read_text())
    data["runs"] = [row for row in data["runs"] if row["id"] in ids]
    for row in data["runs"]:
        if row["id"] in shrink:
            row["cluster_overrides"] = ["cluster.gpu_mem_gb=16"]
        if row["id"] in (reframe or {}):
            row["framework"] = reframe[row["id"]]
    path = tmp_path / "subset.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_validate_prints_one_line_per_run_and_the_summary(tmp_path, runs):
    # the torchtitan row on 16 GiB GPUs, to see a refusal (on its own 96 GiB it fits, as it ran); the float8
    # row as if Megatron-Core had run it, to see an inexpressible run (the planner models torchtitan's float8)
    table = _subset_table(tmp_path, SUBSET, ("torchtitan2412-8b-fsdp-8gpu",),
                          {"torchtitan2412-70b-2d-fp8": "megatron-core-2024"})
    code, out, err = _main("--validate", str(table))
    assert code == 0 and err == ""
    lines = out.splitlines()
    rows = [line for line in lines if line[:4].strip().isdigit()]
    assert [line.split()[1] for line in rows] == SUBSET
    by_id = {line.split()[1]: line for line in rows}
    assert "fits" in by_id["korthikanti2022-1t-present"]
    assert "refused: no layout fits" in by_id["torchtitan2412-8b-fsdp-8gpu"]
    assert "not expressible: fp8" in by_id["torchtitan2412-70b-2d-fp8"]
    # three virtual stages (any vpp that leaves each a block is enumerated since issue 55)
    assert "fits" in by_id["korthikanti2022-175b-full"] and "interleaved(v3)" in by_id["korthikanti2022-175b-full"]
    summary = lines[lines.index(next(x for x in lines if x.startswith("summary"))):]
    held = str(sum(r.held_out for r in runs if r.id in SUBSET))
    assert summary[1].split()[:2] == ["all", "4"] and summary[2].split()[:2] == ["held-out", held]
    assert "2 predicted, 1 refused, 1 not expressible" in summary[1]


def test_validate_full_table_json(full_json, runs):
    got = full_json["runs"]
    assert [r["id"] for r in got] == [r.id for r in runs]
    for row in got:
        assert row["status"] in ("predicted", "refused", "not expressible")
        assert row["published_mfu"] is None or 0.1 < row["published_mfu"] < 0.7
        if row["status"] == "predicted":
            assert row["ratio"] == pytest.approx(row["predicted_mfu"] / row["published_mfu"])
            assert row["memory_gb"] <= row["usable_gb"]
        else:
            assert row["reason"] and row["ratio"] is None
    s_all, s_held = full_json["summary"]["all"], full_json["summary"]["held_out"]
    assert s_all["runs"] == len(runs) and s_held["runs"] == sum(r.held_out for r in runs)
    for s in (s_all, s_held):
        assert s["predicted"] + s["refused"] + s["not_expressible"] == s["runs"]
        assert s["within"] == round(s["within_fraction_of_runs"] * s["runs"])
    ratios = sorted(r["ratio"] for r in got if r["ratio"] is not None)
    assert s_all["median_ratio"] == pytest.approx((ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2)


def test_every_published_layout_fits_where_it_ran(full_json):
    """Issue 55's done-when: no published layout is refused on the machine it ran on."""
    refused = [(r["id"], r["reason"]) for r in full_json["runs"] if r["status"] == "refused"]
    assert refused == []


def test_the_stored_band_is_the_current_validation(full_json):
    """``hpctrain-plan`` prints its MFU with the band stored in validation_band.yaml; it must be what the
    planner measures now (regenerate with ``hpctrain-plan --validate --write-band`` after a model change)."""
    from hpctrain.planner.band import band_text, load_band

    stored = load_band()
    assert stored == full_json["band"], "stale: run hpctrain-plan --validate --write-band"
    a = stored["all"]
    assert f"{100 * a['min_error']:+.0f}%..{100 * a['max_error']:+.0f}%" in band_text(0.4, stored)


@pytest.mark.parametrize("edit,expect", [
    (lambda t: t.replace("runs:", "runs: [", 1), "not valid YAML"),
    (lambda t: t.replace("gpus: 32, global_batch: 512", "gpus: 31, global_batch: 512", 1), "!= gpus 31"),
    (lambda t: t.replace("source: narayanan2021, where", "source: narayanan, where", 1), "is not one of the table's"),
    (lambda t: t.replace("published: {tflops_per_gpu: 137, tflops_kind: hardware}", "published: {}", 1),
     "needs at least one of"),
    (lambda t: t.replace('1.7B", held_out: true', '1.7B", held_out: yes please', 1),
     "'held_out' must be true or false"),
])
def test_malformed_table_is_one_error_line(tmp_path, edit, expect):
    path = tmp_path / "bad.yaml"
    path.write_text(edit(DEFAULT_TABLE.read_text()))
    code, out, err = _main("--validate", str(path))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("hpctrain: error: published runs table ")
    assert expect in err


def test_validate_refuses_overrides():
    code, out, err = _main("model=llama3-8b", "--validate")
    assert code == 2 and out == "" and err.startswith("hpctrain: error: --validate takes no overrides")
