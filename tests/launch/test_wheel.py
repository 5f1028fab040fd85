"""A wheel of the project, installed (not editable) into a fresh virtual
environment next to the project's dependencies, trains from an unrelated
directory: the presets ship in the package and every built-in plugin is
found through the wheel's own entry points.

The fresh environment sees the dependencies (torch, mpi4py, parallel h5py,
hydra, ...) through one ``.pth`` line naming a directory of links to this
environment's installed packages, hpctrain's own entries left out, so the
only hpctrain it can import is the wheel's."""
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from test_launchers import TIMEOUT, _env

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
          str(ROOT)], env=_env())
    [wheel] = (tmp / "dist").glob("hpctrain-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    deps = tmp / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():  # every installed package but hpctrain itself (an editable install here)
        if not entry.name.lower().startswith(("hpctrain", "__editable__")) and not entry.name.endswith(".pth"):
            (deps / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    fresh_site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                      .stdout.strip())
    (fresh_site / "project-dependencies.pth").write_text(f"{deps}\n")
    # no PYTHONPATH: a source tree on it (and the egg-info the build leaves there) would look installed
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          "--force-reinstall", str(wheel)], env=_fresh_env())
    yield venv
    shutil.rmtree(tmp, ignore_errors=True)


def _fresh_env():
    env = _env()
    env.pop("PYTHONPATH", None)
    return env


def test_the_wheel_trains_from_an_unrelated_directory(installed, tmp_path):
    where = _run([str(installed / "bin" / "python"), "-c", "import hpctrain; print(hpctrain.__file__)"],
                 env=_fresh_env(), cwd=tmp_path).stdout.strip()
    assert where.startswith(str(installed)), where  # the wheel's copy, not the source tree
    run = _run([str(installed / "bin" / "hpctrain-train"), "trainer.steps=2", "trainer.progress=off",
                f"hydra.run.dir={tmp_path / 'run'}"], env=_fresh_env(), cwd=tmp_path)
    assert "step 2/2" in run.stderr and (tmp_path / "run" / "metrics.jsonl").exists()
    listed = _run([str(installed / "bin" / "hpctrain-train"), "--plugins"], env=_fresh_env(), cwd=tmp_path).stdout
    for plugin in ("comm_mpi", "dp", "zero", "tp", "pp", "moe", "cp", "h5ckpt"):
        assert f"\n{plugin} " in listed, listed


def test_a_users_own_preset_directory_is_found_with_config_dir(installed, tmp_path):
    mine = tmp_path / "presets" / "model"
    mine.mkdir(parents=True)
    (mine / "small.yaml").write_text("defaults:\n  - tiny\n  - _self_\nname: small\nd_model: 32\n")
    run = _run([str(installed / "bin" / "hpctrain-train"), "--config-dir", str(tmp_path / "presets"), "model=small",
                "trainer.steps=1", "trainer.progress=off", f"hydra.run.dir={tmp_path / 'run'}"],
               env=_fresh_env(), cwd=tmp_path)
    assert "model small:" in run.stderr, run.stderr
