"""Every command's bad argument is one ``hpctrain: error:`` line naming the command and its ``--help``,
exit status 2, no usage block: one pattern finds every hpctrain error in a job's log."""
import importlib
import importlib.metadata as md

import pytest

from hpctrain.errors import LAUNCHER_RANK_VARIABLES

# command -> (module with main(argv), the arguments before the bad flag)
COMMANDS = {
    "hpctrain-train": ("hpctrain.cli", []),
    "hpctrain-plan": ("hpctrain.planner.cli", []),
    "hpctrain-parity": ("hpctrain.parity_cli", []),
    "hpctrain-tune": ("hpctrain.tune.cli", []),
    "hpctrain-report": ("hpctrain.report.cli", ["some/run"]),
    "hpctrain-ckpt": ("hpctrain_h5ckpt.cli", ["verify", "x.h5"]),  # argparse finds unknown flags at the top
    "hpctrain-bench moe": ("hpctrain.bench.cli", ["moe"]),
    "hpctrain-bench comm": ("hpctrain.bench.cli", ["comm"]),
}


def _run(module: str, argv: list) -> int:
    try:
        return importlib.import_module(module).main(argv)
    except SystemExit as e:
        return e.code


def test_every_installed_command_is_in_the_table():
    scripts = {ep.name for ep in md.distribution("hpctrain").entry_points if ep.group == "console_scripts"}
    # hpctrain-eval is hpctrain-train's main (below); hpctrain-prepare has its own table (data/test_prepare.py)
    assert scripts - {"hpctrain-eval", "hpctrain-prepare", "hpctrain-bench"} <= set(COMMANDS)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_unknown_flag_is_one_line_naming_the_command(command, capsys, monkeypatch):
    for name in LAUNCHER_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    module, before = COMMANDS[command]
    assert _run(module, before + ["--no-such-flag"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"hpctrain: error: {command}: unrecognized arguments: --no-such-flag "
                                f"(see {command} --help)"], err


def test_hpctrain_eval_names_itself_and_a_bad_choice(capsys):
    from hpctrain import cli

    assert cli.main(["--cfg", "nope"], evaluate=True) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["hpctrain: error: hpctrain-eval: argument --cfg/-c: invalid choice: 'nope' "
                                "(choose from 'job', 'hydra', 'all') (see hpctrain-eval --help)"], err


def test_an_unknown_benchmark_is_one_line(capsys):
    assert _run("hpctrain.bench.cli", ["nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("hpctrain: error: hpctrain-bench: unknown benchmark 'nope'")


def test_a_subcommands_complaint_names_the_subcommand(capsys):
    assert _run("hpctrain_h5ckpt.cli", ["verify"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hpctrain: error: hpctrain-ckpt verify: the following arguments are required: path "
        "(see hpctrain-ckpt verify --help)"]


@pytest.mark.parametrize("variable", LAUNCHER_RANK_VARIABLES)
def test_only_the_launchers_rank_0_says_it(variable, capsys, monkeypatch):
    """Under mpirun or srun every rank parses the same arguments: one line per job, not per rank."""
    for name in LAUNCHER_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    assert _run("hpctrain.planner.cli", ["--no-such-flag"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(variable, "0")
    assert _run("hpctrain.planner.cli", ["--no-such-flag"]) == 2
    assert capsys.readouterr().err.startswith("hpctrain: error: hpctrain-plan: ")


def test_hpctrain_parity_says_which_flag_sets_its_steps(capsys, monkeypatch):
    """``trainer.steps=5`` was ignored (both runs take ``--steps`` steps): said instead of ignored."""
    from hpctrain.parity_cli import parse_args

    for name in LAUNCHER_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args(["parallel.dp=2", "trainer.steps=5"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "hpctrain: error: hpctrain-parity: trainer.steps=5: hpctrain-parity compares --steps N steps (default 3); "
        "give --steps instead (see hpctrain-parity --help)"]
    assert parse_args(["--steps", "5", "parallel.dp=2"]).steps == 5
