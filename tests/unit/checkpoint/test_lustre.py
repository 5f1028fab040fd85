"""checkpoint.lustre (hpctrain/lustre.py): the lfs command, one line when lfs is missing or fails, nothing when
not asked. The run that stripes a real checkpoint directory (a stand-in lfs) is
tests/mpi/checkpoint/test_ckpt_safety.py's hints test."""
from __future__ import annotations

from types import SimpleNamespace

from hpctrain.lustre import problems, setstripe_command, stripe_directory


def _lfs(tmp_path, monkeypatch, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "lfs").write_text("#!/bin/sh\n" + script)
    (bin_dir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_the_command_and_the_checks():
    assert setstripe_command("/d", -1) == ["lfs", "setstripe", "-c", "-1", "/d"]
    assert setstripe_command("/d", 8, "4M") == ["lfs", "setstripe", "-c", "8", "-S", "4M", "/d"]
    assert problems(SimpleNamespace(stripe_count=-1, stripe_size="1048576")) == []
    assert len(problems(SimpleNamespace(stripe_count=-3, stripe_size="4 MB"))) == 2


def test_nothing_asked_nothing_done_and_one_line_without_lfs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no lfs
    assert stripe_directory(str(tmp_path / "ck"), SimpleNamespace(stripe_count=0, stripe_size="")) is None
    said = stripe_directory(str(tmp_path / "ck"), SimpleNamespace(stripe_count=4, stripe_size=""))
    assert said == (f"checkpoint.lustre.stripe_count=4: no lfs command here (not a Lustre client); {tmp_path}/ck "
                    "keeps its file system's layout")


def test_a_failing_lfs_is_one_line_and_a_working_one_makes_the_directory(tmp_path, monkeypatch):
    _lfs(tmp_path, monkeypatch, "echo 'lfs setstripe: dir: not on a Lustre file system' >&2; exit 22\n")
    said = stripe_directory(str(tmp_path / "ck"), SimpleNamespace(stripe_count=4, stripe_size="4M"))
    assert said == (f"checkpoint.lustre: lfs setstripe -c 4 -S 4M {tmp_path}/ck failed (lfs setstripe: dir: not on "
                    f"a Lustre file system); {tmp_path}/ck keeps its layout")
    (tmp_path / "bin" / "lfs").write_text("#!/bin/sh\nexit 0\n")
    said = stripe_directory(str(tmp_path / "ck2"), SimpleNamespace(stripe_count=-1, stripe_size=""))
    assert said == (f"checkpoint.lustre: lfs setstripe -c -1 {tmp_path}/ck2: new checkpoints are striped over "
                    "every target")
    assert (tmp_path / "ck2").is_dir()
