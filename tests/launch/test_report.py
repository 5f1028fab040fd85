"""hpctrain-report renders in a real browser: on a 3D run (tp 2 x pp 2 x dp 2,
8 ranks under mpiexec) and on a 2-point sweep, the page loads in headless
Chromium (driven by playwright; the browser is Debian's, installed by
scripts/setup.sh --tests) with every section present and drawn, no console error,
no page error and no request leaving the page (self-contained: no network).

The 3D page's figures are checked against the run's own files: the layout's
groups are the mesh's, every rank has a memory bar, the predicted bytes per
axis are the planner's for the same config."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

RUN_SECTIONS = ["summary", "curves", "layout", "memory", "comm", "health", "pipeline"]
SWEEP_SECTIONS = ["points", "loss-curves", "final-loss"]
QUIET = ["trainer.progress=off", "trainer.log_every=1"]


def _train(args, cwd):
    """One process (the 3D run is tests/launch/conftest.py's)."""
    flags = [a for a in args if a.startswith("--")]  # before the overrides, as Hydra's parser wants them
    cmd = [sys.executable, "-m", "hpctrain", *flags, *QUIET, *[a for a in args if a not in flags]]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT * 2, cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr


def _report(path):
    r = subprocess.run([sys.executable, "-m", "hpctrain.report.cli", str(path)], env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and r.stdout.strip() == str(path / "report.html"), r.stdout + r.stderr
    return path / "report.html"


def render(page_path, screenshot=None):
    """(section ids, {section id: number of svg/img in it}, console errors, requests) in headless Chromium."""
    from playwright.sync_api import sync_playwright

    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser_path, "no chromium: scripts/setup.sh installs Debian's"
    problems, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1250, "height": 900})
        page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning")
                else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(f"file://{page_path}", wait_until="load")
        ids = [s.get_attribute("id") for s in page.query_selector_all("section")]
        drawn = {i: len(page.query_selector_all(f"section#{i} svg, section#{i} img")) for i in ids}
        # every embedded image decoded (a broken data URI loads as 0 x 0)
        for img in page.query_selector_all("img"):
            assert img.evaluate("i => i.complete && i.naturalWidth > 0"), img.get_attribute("alt")
        if screenshot:
            page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return ids, drawn, problems, [u for u in requests if not u.startswith(("file://", "data:"))]


@pytest.fixture(scope="module")
def readme_3d_run(tmp_path_factory):
    """(finished process, run directory) of the README's 3D command,
    ``mpirun -n 8 hpctrain-train parallel=3d``, for 3 steps, with what its
    report shows on a CPU: a cluster peak (so MFU is drawn) and a straggler
    check every step: run once, for the two tests of this module (one
    module: the launcher tests' workers take a module each, so it runs once)."""
    run = tmp_path_factory.mktemp("readme-3d")
    cmd = [MPIEXEC, "-n", "8", str(Path(sys.executable).parent / "hpctrain-train"), "parallel=3d", "trainer.steps=3",
           "trainer.progress=off", "trainer.log_every=1", "reliability.straggler_every=1", "cluster.peak_tflops=0.1",
           f"hydra.run.dir={run}"]
    return subprocess.run(cmd, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=TIMEOUT * 2,
                          cwd=run), run


@pytest.fixture(scope="module")
def run_3d(readme_3d_run):
    r, run = readme_3d_run
    assert r.returncode == 0, r.stdout + r.stderr
    return run


def test_readme_3d_run_trains(readme_3d_run):
    """The README's five-axis command trains: the 3D preset under ``mpiexec -n 8 hpctrain-train parallel=3d``."""
    r, run = readme_3d_run
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    log = (run / "train.log").read_text()
    assert "layout tp=2 * cp=1 * ep=1 * dp=2 * pp=2" in log, log


def test_the_report_of_a_3d_run_renders_every_section_in_chromium(run_3d, tmp_path):
    ids, drawn, problems, outside = render(_report(run_3d), tmp_path / "page.png")
    assert ids == RUN_SECTIONS and problems == [] and outside == [], (ids, problems, outside)
    assert drawn["curves"] == 5 and drawn["memory"] == 1 and drawn["comm"] == 1 and drawn["pipeline"] == 1, drawn
    assert (tmp_path / "page.png").stat().st_size > 10_000
    html = (run_3d / "report.html").read_text()
    layout = json.load(open(run_3d / "layout.json"))
    assert layout["sizes"] == {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2} and layout["world_size"] == 8
    assert "0 1; 2 3; 4 5; 6 7" in html and "0 4; 1 5; 2 6; 3 7" in html  # tp and pp groups, tp fastest
    assert len(json.load(open(run_3d / "memory_per_rank.json"))["peak_rss_bytes"]) == 8
    from hpctrain.config import compose_resolved
    from hpctrain.plugins import create_manager
    from hpctrain.report.page import _bytes
    from hpctrain.report.predict import predicted_bytes

    cfg = compose_resolved(["parallel=3d", "trainer.steps=3"], create_manager())
    predicted = predicted_bytes(cfg, layout["sizes"])
    for axis in ("tp", "dp", "pp"):
        assert f"<td class=l>{axis}</td><td>{axis}</td><td>{_bytes(predicted[axis])}</td>" in html, axis


def test_the_report_of_a_2_point_sweep_puts_the_points_side_by_side(tmp_path):
    sweep = tmp_path / "sweep"
    _train(["--multirun", "trainer.steps=2", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"], tmp_path)
    ids, drawn, problems, outside = render(_report(sweep))
    assert ids == SWEEP_SECTIONS and problems == [] and outside == [], (ids, problems, outside)
    assert drawn == {"points": 0, "loss-curves": 1, "final-loss": 1}, drawn
    html = (sweep / "report.html").read_text()
    assert "Final loss against optim.lr" in html and "<th>optim.lr</th>" in html
