"""Core-hours and energy (hpctrain.train.usage, issue 59 item 6), one process:
RAPL zones read from a powercap tree (packages and their DRAM, not psys or
the core subzones) across a wrap-around; the projection rule; and a run
whose metrics.jsonl holds the usage.* figures that hpctrain-report shows,
the page's numbers checked against the file's. Energy from this machine's
own RAPL counters where they are readable (skipped, with the reason, where
/sys/class/powercap is absent or root-only)."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from hpctrain.train import usage


def _zone(root: Path, name: str, kind: str, energy: int, max_range: int = 1000_000_000) -> Path:
    z = root / name
    z.mkdir(parents=True)
    (z / "name").write_text(kind + "\n")
    (z / "energy_uj").write_text(f"{energy}\n")
    (z / "max_energy_range_uj").write_text(f"{max_range}\n")
    return z


def test_wrap_around_counts_the_range_once():
    assert usage.wrap_delta(100, 350, 1000) == 250
    assert usage.wrap_delta(900, 50, 1000) == 150  # wrapped at 1000
    assert usage.wrap_delta(7, 7, 1000) == 0


def test_rapl_reads_packages_and_dram_across_a_wrap(tmp_path):
    pkg = _zone(tmp_path, "intel-rapl:0", "package-0", 999_000_000)
    _zone(tmp_path, "intel-rapl:0/intel-rapl:0:0", "core", 5)  # inside the package's count
    dram = _zone(tmp_path, "intel-rapl:0/intel-rapl:0:1", "dram", 10)
    _zone(tmp_path, "intel-rapl:1", "psys", 3)  # the whole platform: holds the packages
    # subzones sit inside their package's directory in sysfs, and as links beside it
    for sub in ("intel-rapl:0:0", "intel-rapl:0:1"):
        os.symlink(tmp_path / "intel-rapl:0" / sub, tmp_path / sub)
    counters = usage.rapl_counters(str(tmp_path))
    assert sorted(os.path.basename(c.zone) for c in counters) == ["intel-rapl:0", "intel-rapl:0:1"]
    (pkg / "energy_uj").write_text("2000000\n")  # wrapped: 1 J to the top, 2 J after
    (dram / "energy_uj").write_text("500010\n")
    assert sum(c.sample() for c in counters) == pytest.approx(3.0 + 0.5)


def test_a_projection_is_the_setup_plus_the_measured_rate():
    assert usage.project(10.0, 30.0, 4, 4) == 30.0  # the steps done: what was measured
    assert usage.project(10.0, 30.0, 4, 40) == pytest.approx(10 + 5 * 40)


def _train(tmp_path, capfd, *extra):
    from hpctrain.cli import main

    run = tmp_path / "run"
    code = main(["trainer.steps=3", "trainer.log_every=2", "trainer.global_batch_size=8", "trainer.seq_len=32",
                 "trainer.progress=off", "report.target_tokens=100000",
                 f"hydra.run.dir={run}", *extra])
    out = capfd.readouterr()
    assert code == 0, out
    return run, out.out + out.err, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _page(run):
    from hpctrain.report.cli import main

    assert main([str(run)]) == 0
    return (run / "report.html").read_text()


def _row(name, value):
    return f"<td class=l>{name}</td><td>{value}</td>"


def test_the_report_shows_the_usage_in_metrics_jsonl(tmp_path, capfd, monkeypatch):
    from hpctrain.report.page import _kwh, _num

    # a RAPL tree whose package counter moves 2 J per read and wraps: energy figures in the run and the page
    _zone(tmp_path / "powercap", "intel-rapl:0", "package-0", 0, max_range=5_000_000)
    reads = iter(range(0, 10**9, 2_000_000))
    monkeypatch.setattr(usage.RaplCounter, "_now", lambda self: next(reads) % self.max_range)
    monkeypatch.setattr(usage, "RAPL_ROOT", str(tmp_path / "powercap"))
    run, out, records = _train(tmp_path, capfd)
    assert [sorted(k for k in r if k.startswith("usage.")) != [] for r in records] == [False, True, True]
    m = records[-1]
    tokens_per_step = 8 * 32  # global batch x seq_len
    assert m["usage.target_steps"] == -(-100000 // tokens_per_step)
    assert m["usage.rank_hours"] == pytest.approx(m["usage.wall_s"] / 3600)  # one rank
    assert 0 < m["usage.cpu_hours"] and m["usage.rank_hours"] > 0
    # at the last step the projection for trainer.steps is what was used
    assert m["usage.projected_rank_hours"] == pytest.approx(m["usage.rank_hours"])
    assert m["usage.projected_cpu_hours"] == pytest.approx(m["usage.cpu_hours"])
    assert m["usage.target_rank_hours"] > m["usage.rank_hours"]
    assert m["usage.energy_j"] == m["usage.energy_rapl_j"] and m["usage.energy_j"] > 0
    assert m["usage.projected_energy_j"] == pytest.approx(m["usage.energy_j"])
    page = _page(run)
    wall = _num(m["usage.wall_s"])
    for name, value in [(f"rank-hours used (ranks x {wall} s wall)", _num(m["usage.rank_hours"])),
                        ("CPU-hours used (measured)", _num(m["usage.cpu_hours"])),
                        ("energy used (RAPL)", _kwh(m["usage.energy_j"])),
                        ("rank-hours for trainer.steps=3", _num(m["usage.projected_rank_hours"])),
                        ("CPU-hours for trainer.steps=3", _num(m["usage.projected_cpu_hours"])),
                        ("energy for trainer.steps=3", _kwh(m["usage.projected_energy_j"])),
                        (f"rank-hours for report.target_tokens=100000 ({m['usage.target_steps']} steps)",
                         _num(m["usage.target_rank_hours"])),
                        (f"energy for report.target_tokens=100000 ({m['usage.target_steps']} steps)",
                         _kwh(m["usage.target_energy_j"]))]:
        assert _row(name, value) in page, (name, value)
    assert "usage: " in out and "CPU-hours" in out and "kWh" in out  # the run's last line


def _readable_rapl() -> str:
    zones = glob.glob(os.path.join(usage.RAPL_ROOT, "intel-rapl:*", "energy_uj"))
    if not zones:
        return f"no RAPL zone under {usage.RAPL_ROOT} on this machine (a VM or container without powercap)"
    try:
        open(zones[0]).read()
    except OSError as e:
        return f"{zones[0]} is not readable here ({e.strerror}; root-only since Linux 5.10)"
    return ""


@pytest.mark.skipif(bool(_readable_rapl()), reason=_readable_rapl() or "-")
def test_this_machines_rapl_energy_reaches_the_report(tmp_path, capfd):
    run, _, records = _train(tmp_path, capfd)
    m = records[-1]
    assert m["usage.energy_rapl_j"] > 0 and m["usage.energy_j"] == m["usage.energy_rapl_j"]
    assert "energy used (RAPL)" in _page(run)
