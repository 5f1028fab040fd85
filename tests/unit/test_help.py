"""``--help`` of hpctrain-train and hpctrain-eval: each says what its command does, and the "More" list
names every other command the package installs (its console scripts, pyproject.toml's [project.scripts])."""
import importlib.metadata as md

from hpctrain.config.store import CONF_DIR
from hpctrain.help import help_text

SCRIPTS = [ep.name for ep in md.distribution("hpctrain").entry_points if ep.group == "console_scripts"]


def _more(text: str) -> list:
    return [line.split()[0] for line in text.split("== More ==\n", 1)[1].splitlines() if line.strip()]


def test_the_more_list_names_every_other_installed_command():
    for prog in ("hpctrain-train", "hpctrain-eval"):
        listed = set(_more(help_text(CONF_DIR, prog)))
        assert set(SCRIPTS) - {prog} <= listed, (prog, set(SCRIPTS) - listed)
        assert _more(help_text(CONF_DIR, prog)).count(prog) == 2  # only as "--plugins" and "--hydra-help"


def test_hpctrain_eval_says_what_it_needs_instead_of_how_to_train():
    text = help_text(CONF_DIR, "hpctrain-eval")
    assert "Train a transformer" not in text and text.startswith("usage: hpctrain-eval ")
    assert "checkpoint.resume=auto with the run's checkpoint.dir" in text and "data.split=<fraction>" in text
    assert "Train a transformer" in help_text(CONF_DIR, "hpctrain-train")
