"""The other commands as ``mpiexec -n 2`` runs them, in this session's two
ranks (tests/mpi/cli_session.py; formerly real launches in tests/launch:
test_hf_commands.py, test_layout_commands.py, test_tune_commands.py,
test_launchers.py):

- ``hpctrain-train model=hf ... checkpoint.init_from=hf:DIR`` at tp 2, then
  ``hpctrain-ckpt export`` to a directory transformers loads; a model the
  trainer cannot compute is one ``hpctrain: error:`` line and exit 2 on
  every rank before any step;
- ``hpctrain-parity`` refuses a bad layout once; ``hpctrain-tune`` refuses
  bad arguments in one line, before any collective;
- a ``--multirun`` sweep: each point runs on every rank, and
  ``summary.jsonl`` holds one line per point."""
import json
import os

import pytest
from cli_session import command, metrics, run_main, train

pytestmark = pytest.mark.mpi(min_size=2)

SMALL = ["trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32"]


@pytest.fixture
def tmp(shared_tmp, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(shared_tmp)
    return Path(shared_tmp)


def _hf_dir(world, path, change=None):
    """A tiny Llama saved by transformers on rank 0 (``change``: edits to its config.json)."""
    from hf_models import llama_config, save

    if world.Get_rank() == 0:
        save(llama_config(), path)
        if change:
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
            config.update(change)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(config, f)
    world.Barrier()
    return path


def test_train_from_a_hugging_face_directory_at_tp2_and_export(world, capfd, tmp):
    src = _hf_dir(world, tmp / "llama")
    run, ck, out = tmp / "run", tmp / "ck", tmp / "out"
    r = train(world, capfd, ["model=hf", f"model.hf_dir={src}", f"checkpoint.init_from=hf:{src}", "parallel.tp=2",
                             "trainer.steps=2", "trainer.seq_len=32", "checkpoint.every=2", f"checkpoint.dir={ck}"],
              run, quiet=[])
    assert r.codes == [0, 0], r.out
    log = (run / "train.log").read_text()
    assert f"weights from checkpoint.init_from=hf:{src}" in log and "tp=2" in log
    assert [m["step"] for m in metrics(run)] == [1, 2]
    if world.Get_rank() == 0:  # hpctrain-ckpt is a one-process command
        assert command("hpctrain-ckpt")(["export", str(ck), "--to", str(out)]) == 0
        from transformers import AutoModelForCausalLM

        _, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
    world.Barrier()


def test_an_unsupported_hugging_face_field_is_one_line_exit_2_on_every_rank(world, capfd, tmp):
    src = _hf_dir(world, tmp / "llama", {"attention_bias": True})
    r = train(world, capfd, ["model=hf", f"model.hf_dir={src}", f"checkpoint.init_from=hf:{src}"], tmp / "run",
              quiet=[])
    assert r.codes == [2, 2], r.out
    assert r.errors() == [f"{src}/config.json: attention_bias=True (biases on the attention "
                          "projections) is not implemented; this model cannot be trained here"], r.out
    assert "Traceback" not in r.out and not (tmp / "run" / "metrics.jsonl").exists()


def test_parity_command_refuses_a_bad_layout_once(world, capfd, tmp):
    argv = ["parallel.tp=3", "parallel.cp=3", *SMALL]
    r = run_main(world, capfd, lambda: command("hpctrain-parity")(argv))
    assert r.codes == [2, 2], r.out
    errors = r.errors("")
    errors = [line for line in errors if line.startswith("hpctrain: error:")]
    assert any("parallel.tp=3 does not divide model.n_heads=4" in e for e in errors), r.out
    assert any(f"world size {world.Get_size()} is not divisible" in e for e in errors), r.out
    assert len(errors) == len(set(errors)) and "Traceback" not in r.out, r.out


def test_tune_bad_arguments_are_one_line_and_status_2(world, capfd, tmp):
    argv = ["model=tiny", "trainer.global_batch_size=8", "trainer.seq_len=32", "trainer.steps=2",
            "parallel.zero.stage=0", "model.recompute=none", "--steps", "0"]
    r = run_main(world, capfd, lambda: command("hpctrain-tune")(argv))
    assert r.codes == [2, 2], r.out
    assert r.errors("") == ["hpctrain: error: --steps 0: give the steps per layout (>= 1; 3 or more to time steps "
                            "after the warm-up)"], r.out


def test_multirun_sweep_under_mpi(world, capfd, tmp):
    from hpctrain.cli import main

    argv = ["--multirun", "trainer.steps=2", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp}"]
    r = run_main(world, capfd, lambda: main(argv))
    assert r.codes == [0, 0], r.out
    assert len(metrics(tmp / "0")) == len(metrics(tmp / "1")) == 2
    # summary.jsonl: one line per point, with its overrides and last metrics
    summary = [json.loads(line) for line in (tmp / "summary.jsonl").read_text().splitlines()]
    assert [(p["dir"], p["overrides"], p["exit_code"]) for p in summary] == [
        ("0", ["trainer.steps=2", "optim.lr=0.001"], 0), ("1", ["trainer.steps=2", "optim.lr=0.003"], 0)]
    assert summary[1]["last"] == metrics(tmp / "1")[-1]
