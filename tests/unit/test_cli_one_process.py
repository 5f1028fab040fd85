"""``hpctrain-train`` (and ``hpctrain-report``) in one process, called as the
console script calls them (``main(argv)``) inside this pytest process instead
of a fresh ``python -m hpctrain`` each (formerly in tests/launch:
test_messages.py, test_sweep_logs.py, test_report.py, test_launchers.py;
``python -m hpctrain`` and the console script themselves stay launched there).

- ``--cfg job`` and ``--help`` still work; a sweep with a bad value is
  refused before any point runs, in one line;
- ``--help`` lists the real presets per group and the other commands;
- a relaunch of the same experiment finds its checkpoints (the default
  directory under the launch directory), another experiment does not;
- a one-process ``--multirun`` sweep trains each point;
- ``hpctrain-report`` on a directory without a run is one error line."""
import json
import os

import pytest


@pytest.fixture
def hpctrain(capfd, monkeypatch, tmp_path):
    """``hpctrain(*argv)`` -> (exit status, stdout + stderr), run in ``tmp_path``."""
    from hpctrain.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def run(*argv):
        capfd.readouterr()
        code = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return code, out + err
    return run


def _errors(out):
    return [line[len("hpctrain: error: "):] for line in out.splitlines() if line.startswith("hpctrain: error: ")]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cfg_help_and_a_bad_sweep_point_in_one_process(hpctrain, tmp_path):
    code, out = hpctrain("--cfg", "job", "trainer.steps=3")
    assert code == 0 and "steps: 3" in out, out
    code, out = hpctrain("--help")
    assert code == 0 and "Configuration groups" in out, out
    code, out = hpctrain("--multirun", "trainer.steps=1", "optim.lr=1e-3,abc", f"hydra.sweep.dir={tmp_path}/sweep")
    assert code == 2 and _errors(out) == ["optim.lr='abc': must be a number (float), e.g. optim.lr=0.003"], out
    assert not (tmp_path / "sweep" / "0" / "metrics.jsonl").exists()


def test_help_lists_the_presets_per_group_and_the_other_commands(hpctrain):
    code, out = hpctrain("--help")
    assert code == 0, out
    assert "_schema" not in out, out
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "hpctrain", "conf")
    for group in ("model", "parallel", "cluster"):  # every preset file of the group, in one line
        presets = sorted(f[:-5] for f in os.listdir(os.path.join(conf, group)) if f.endswith(".yaml"))
        assert f"  {group:<10}  {', '.join(presets)}\n" in out, (group, out)
    for command in ("--plugins", "hpctrain-plan", "hpctrain-parity", "hpctrain-ckpt", "docs"):
        assert command in out, command


def test_a_relaunch_of_the_same_experiment_finds_its_checkpoints(hpctrain, tmp_path):
    """Without checkpoint.dir, checkpoints go to checkpoints/<model>-<hash> under
    the launch directory: a relaunch with the same experiment (a longer
    trainer.steps is the same experiment) resumes from them with
    resume=auto; another learning rate is another experiment."""
    common = ["trainer.progress=off", "checkpoint.every=2", "checkpoint.resume=auto"]
    code, out = hpctrain("trainer.steps=2", *common, f"hydra.run.dir={tmp_path}/run1")
    assert code == 0, out
    dirs = list((tmp_path / "checkpoints").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("tiny-") and (dirs[0] / "step_00000002.h5").exists()
    code, out = hpctrain("trainer.steps=4", *common, f"hydra.run.dir={tmp_path}/run2")
    assert code == 0, out
    assert "resumed from" in out and "step_00000002.h5" in out
    assert [m["step"] for m in _metrics(tmp_path / "run2")] == [3, 4]
    code, out = hpctrain("trainer.steps=2", "optim.lr=1e-3", *common, f"hydra.run.dir={tmp_path}/run3")
    assert code == 0, out
    assert "no committed checkpoint" in out and len(list((tmp_path / "checkpoints").iterdir())) == 2
    # the earlier experiment's directory is named, with its newest step and how to continue it
    assert "other experiment settings" in out and f"{dirs[0].name} (step 4)" in out, out
    assert "checkpoint.resume=<its path>" in out


def test_multirun_sweep_one_process(hpctrain, tmp_path):
    code, out = hpctrain("--multirun", "trainer.steps=2", "trainer.seed=0,1", f"hydra.sweep.dir={tmp_path}")
    assert code == 0, out
    a, b = _metrics(tmp_path / "0"), _metrics(tmp_path / "1")
    assert len(a) == len(b) == 2 and a[0]["loss"] != b[0]["loss"]


def test_a_directory_without_a_run_is_one_error_line(capfd, tmp_path):
    from hpctrain.report.cli import main

    assert main([str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"hpctrain: error: {tmp_path} is not a run directory"), err
    assert len(err.splitlines()) == 1
