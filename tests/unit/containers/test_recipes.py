"""containers/Dockerfile and containers/Apptainer.def install what
scripts/setup.sh and pyproject.toml pin. Neither engine runs on the test
machines, so this reads the recipes: both run scripts/setup.sh itself (the
apt packages, mpi4py and the MPI-built h5py are then the same by
construction), and every torch they name, CPU default and GPU variant, is
the version setup.sh installs and pyproject.toml allows."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RECIPES = [ROOT / "containers" / "Dockerfile", ROOT / "containers" / "Apptainer.def"]


def _setup_pins():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    torch = re.search(r"TORCH_SPEC=\$\{HPCTRAIN_TORCH_SPEC:-torch==([\d.]+)\}", text).group(1)
    h5py = re.search(r"^H5PY_VERSION=([\d.]+)$", text, re.M).group(1)
    return torch, h5py


def test_setup_and_pyproject_agree_on_torch():
    torch, _ = _setup_pins()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>=2.4,<={torch}"' in pyproject


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_a_recipe_installs_through_setup_sh_with_the_pinned_torch(recipe):
    text = recipe.read_text()
    torch, _ = _setup_pins()
    assert re.search(r"^\s*(RUN )?bash scripts/setup\.sh", text, re.M), "the recipe must run scripts/setup.sh"
    assert "HPCTRAIN_VENV=/opt/hpctrain/venv" in text
    specs = re.findall(r"torch==([\d.]+)\+(\w+)", text)
    assert {variant for _, variant in specs} >= {"cpu", "cu128"}, specs  # the CPU default and the GPU variant
    assert {version for version, _ in specs} == {torch}, specs
    assert "HPCTRAIN_TORCH_SPEC" in text and "download.pytorch.org/whl/cpu" in text


def test_the_recipes_do_not_pin_anything_setup_sh_does_not():
    """No second list of packages to drift: the Python stack comes from setup.sh only."""
    for recipe in RECIPES:
        text = recipe.read_text()
        assert not re.search(r"pip3? install", text), recipe.name
        assert not re.search(r"(h5py|mpi4py|numpy)[=<>]=", text), recipe.name
