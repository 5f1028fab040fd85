"""The tuner's report: Spearman's rank correlation, the table, the fastest measured layout and its
command in hpctrain-plan's form; ``hpctrain-plan --compare`` on a run directory."""
import json
import shlex

import pytest

from hpctrain.tune.rank import Candidate
from hpctrain.tune.report import as_json, fastest, spearman, table, text
from hpctrain.tune.trial import Trial, summarise


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)  # 1 - 6*4/(5*24)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties share ranks
    assert spearman([1], [2]) is None and spearman([1, 1], [1, 2]) is None


def _cand(label, pred):
    return Candidate(label, ["model=tiny", f"parallel.dp={label[-1]}"], pred, 2e6, {"dp": 1e5}, {"dp": 2})


def _trial(label, ms, ok=True):
    t = Trial(label, [], ok=ok, reason="" if ok else "parallel.tp=3 does not divide model.n_heads=4")
    if ok:
        summarise([{"loss": 5.0, "step_time_s": 9.0, "comm_bytes.dp": 7.0},
                   {"loss": 4.0, "step_time_s": ms / 1e3, "comm_bytes.dp": 3.0},
                   {"loss": 3.0, "step_time_s": ms / 1e3, "comm_bytes.dp": 3.0}], t)
        t.peak_bytes = 3 * 2 ** 20
    return t


def test_measurements_skip_the_warm_up_step():
    t = _trial("dp2", 20.0)
    assert t.median_step_s == pytest.approx(0.02) and t.comm_bytes == {"dp": 3.0} and t.losses == [5.0, 4.0, 3.0]


def test_table_text_and_json():
    from hpctrain.planner.cluster import ClusterSpec
    from hpctrain.planner.comm_model import Link
    from hpctrain.planner.report import launch_line

    cands = [_cand("dp2", 0.010), _cand("dp4", 0.020), _cand("dp8", 0.030)]
    trials = [_trial("dp2", 30.0), _trial("dp4", 10.0), _trial("dp8", 0, ok=False)]
    assert fastest(trials) == 1
    lines = table(cands, trials).splitlines()
    assert lines[0].split()[:4] == ["#", "layout", "pred", "ms"]
    assert lines[2].split()[:6] == ["1", "dp2", "10.0", "30.0", "1.9", "3.0"]
    assert lines[4].endswith("failed: parallel.tp=3 does not divide model.n_heads=4")
    cluster = ClusterSpec("c", 8, 8, 1e9, 1e9, 1e12, 1e12, Link(1e9, 1e-6), Link(1e9, 1e-6))
    command = launch_line(cluster, cands[1].overrides)
    out = text(cands, trials, command, 3, "cal.json")
    assert "rank correlation of predicted and measured step time (Spearman): -1.00" in out
    assert out.splitlines()[-1].strip() == "srun --nodes=1 --ntasks-per-node=8 --mpi=pmix hpctrain-train " \
                                          "model=tiny parallel.dp=4"
    assert shlex.split(out.splitlines()[-1])[5:] == cands[1].overrides
    data = json.loads(json.dumps(as_json(cands, trials, {"dp_latency_us": 3.0}, {}, ["dp2"], command, 3)))
    assert data["best"] == {"index": 1, "label": "dp4", "overrides": cands[1].overrides, "command": command}
    assert data["spearman"] == pytest.approx(-1.0)
    assert [lay["ok"] for lay in data["layouts"]] == [True, True, False]
    assert data["layouts"][0]["predicted_s"] == 0.010 and data["layouts"][0]["median_step_s"] == 0.03


def test_compare_reads_a_run_directory(tmp_path, capsys):
    from hpctrain.planner.cli import main

    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    (hydra / "config.yaml").write_text(
        "model: {recompute: none}\nparallel: {tp: 2, cp: 1, ep: 1, dp: -1, pp: 1, zero: {stage: 0}}\n"
        "trainer: {micro_batch_size: 2, global_batch_size: 8, seq_len: 32, precision: fp32}\n")
    (hydra / "overrides.yaml").write_text("- model=tiny\n- parallel.tp=2\n")
    (tmp_path / "layout.json").write_text(json.dumps({"sizes": {"tp": 2, "cp": 1, "ep": 1, "dp": 4, "pp": 1}}))
    rows = [{"step": s, "loss": 5.0, "step_time_s": t, "peak_rss_bytes.max": 4e8, "comm_bytes.tp": 1e6}
            for s, t in ((1, 9.0), (2, 0.05), (3, 0.07))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["--compare", str(tmp_path), "cluster=cpu-8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("layout tp2 dp4: predicted against measured")
    assert out[1].split()[-2:] == ["60.0", "ms"]  # the median of the steps after the first
    assert "0.400 GB (peak_rss_bytes.max)" in out[2] and "measured per group tp 0.95 MiB" in out[3]
    assert main(["--compare", str(tmp_path / "nothing")]) == 2


def test_compare_plans_for_the_runs_own_ranks_and_asks_for_a_cluster_the_run_did_not_name(tmp_path, capsys):
    """A 4-rank run (the README's demo) on the 8-rank CPU preset: the plan is for its 4 ranks; with no
    cluster at all, one line says which to give."""
    from hpctrain.planner.cli import main

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "cluster: {name: local, gpus: 0}\nmodel: {recompute: none}\n"
        "parallel: {tp: 1, cp: 1, ep: 1, dp: -1, pp: 1, zero: {stage: 0}}\n"
        "trainer: {micro_batch_size: 4, global_batch_size: 16, seq_len: 128, precision: fp32}\n")
    (tmp_path / "layout.json").write_text(json.dumps({"sizes": {"tp": 1, "cp": 1, "ep": 1, "dp": 4, "pp": 1}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "step_time_s": 0.1}) for s in (1, 2)))
    assert main(["--compare", str(tmp_path), "cluster=cpu-8"]) == 0
    assert capsys.readouterr().out.startswith("layout dp4: predicted against measured")
    assert main(["--compare", str(tmp_path)]) == 2
    assert (f"--compare {tmp_path}: the run's config names no cluster to predict for; give the machine it ran on "
            f"after the directory, e.g. hpctrain-plan --compare {tmp_path} cluster=cpu-8 (its 4 ranks are taken "
            "from the run)") in capsys.readouterr().err
