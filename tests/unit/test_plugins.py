"""Plugin loading: built-ins through entry points, blocking, and a third-party
package installed from plugins/examples and picked up by a real run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.errors import PluginError
from hpctrain.plugins import axis_plugins, capabilities, create_manager, describe, require

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "plugins" / "examples" / "hpctrain-example-metrics"


def test_builtins_load_through_entry_points():
    pm = create_manager()
    names = {p.name for p in describe(pm)}
    assert {"comm_torch", "dp"} <= names
    assert "torch" in capabilities(pm)["comm.backend"]
    assert "dp" in capabilities(pm)["parallel"]


def test_blocking_by_environment(monkeypatch):
    # Two built-ins serve the dp axis (dp, and zero for stages 1-3): blocking
    # one leaves the axis to the other; blocking both removes it.
    monkeypatch.setenv("HPCTRAIN_DISABLE_PLUGINS", "dp")
    pm = create_manager()
    assert "dp" not in {p.name for p in describe(pm)}
    assert axis_plugins(pm).get("dp") == ["zero"]
    monkeypatch.setenv("HPCTRAIN_DISABLE_PLUGINS", "dp,zero")
    pm = create_manager()
    assert "dp" not in capabilities(pm).get("parallel", [])


def test_require_names_options_and_blocking(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_DISABLE_PLUGINS", "comm_torch")
    pm = create_manager()
    with pytest.raises(PluginError, match="blocked by HPCTRAIN_DISABLE_PLUGINS: comm_torch"):
        require(pm, "comm.backend", "torch", "comm.backend")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "OMPI_MCA_ess", "PMI_"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory):
    """Install the sample third-party plugin into a private target dir (the
    test environment itself is not modified) and return a PYTHONPATH."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True, capture_output=True)
    return str(target)


def test_third_party_plugin_is_listed_and_used(example_installed, tmp_path):
    env = _clean_env(PYTHONPATH=example_installed)
    listing = subprocess.run([sys.executable, "-m", "hpctrain", "--plugins"], env=env, capture_output=True,
                             text=True, check=True)
    assert "example_metrics" in listing.stdout and "hpctrain-example-metrics" in listing.stdout
    run = subprocess.run([sys.executable, "-m", "hpctrain", "trainer.steps=4", "example_metrics.every=2",
                          f"hydra.run.dir={tmp_path}"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in (tmp_path / "ema_loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]


def test_blocked_third_party_plugin_is_not_loaded(example_installed, tmp_path):
    env = _clean_env(PYTHONPATH=example_installed, HPCTRAIN_DISABLE_PLUGINS="example_metrics")
    listing = subprocess.run([sys.executable, "-m", "hpctrain", "--plugins"], env=env, capture_output=True,
                             text=True, check=True)
    assert "example_metrics" not in listing.stdout.split("blocked by")[0]
    run = subprocess.run([sys.executable, "-m", "hpctrain", "trainer.steps=2", "example_metrics.every=1",
                          f"hydra.run.dir={tmp_path}"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "example_metrics" in run.stderr
