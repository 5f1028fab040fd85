"""``last_failure.json`` and the ``recovery.*`` fields of the first step after a restart."""
import json

from hpctrain.train.recovery import FAILURE_FILE, RECOVERED_FILE, Recovery, write_failure


def test_the_first_step_after_a_recorded_failure_reports_its_cost(tmp_path):
    write_failure(str(tmp_path), "rank 6 died", [6], ["n3", "n3"], 23)
    record = json.loads((tmp_path / FAILURE_FILE).read_text())
    assert record["ranks"] == [6] and record["hosts"] == ["n3"] and record["last_step"] == 23
    rec = Recovery(str(tmp_path), is_main=True)
    m = {"step": 21, "loss": 1.0}
    rec.after_first_step(m, 20, "local")
    assert m["recovery.tier"] == "local" and m["recovery.steps_recomputed"] == 3 and m["recovery.resumed_step"] == 20
    assert m["recovery.time_s"] >= 0
    assert not (tmp_path / FAILURE_FILE).exists() and (tmp_path / RECOVERED_FILE).is_file()
    again = {"step": 22}
    rec.after_first_step(again, 20, "local")  # reported once
    assert again == {"step": 22}


def test_without_a_recorded_failure_or_off_rank_0_nothing_is_added(tmp_path):
    m = {"step": 1}
    Recovery(str(tmp_path), is_main=True).after_first_step(m, 0, "none")
    write_failure(str(tmp_path), "x", [1], ["h"], 4)
    Recovery(str(tmp_path), is_main=False).after_first_step(m, 0, "none")
    assert m == {"step": 1}
