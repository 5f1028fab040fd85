"""The checkpoint directory: atomic commit, latest pointer, keep-k, candidates."""
from __future__ import annotations

import os

from hpctrain_h5ckpt import store


def _tmp_file(directory, step, text=b"x"):
    final = os.path.join(directory, store.checkpoint_name(step))
    tmp = store.tmp_path(final)
    with open(tmp, "wb") as f:
        f.write(text)
    return tmp, final


def test_commit_renames_points_latest_and_keeps_k(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30, 40):
        tmp, final = _tmp_file(d, step)
        store.commit(tmp, final, d, keep=2)
        assert not os.path.exists(tmp) and os.path.exists(final)
        assert store.read_latest(d) == final
    assert sorted(os.listdir(d)) == ["latest", "step_00000030.h5", "step_00000040.h5"]


def test_uncommitted_and_foreign_files_are_never_candidates(tmp_path):
    d = str(tmp_path)
    tmp, final = _tmp_file(d, 5)
    store.commit(tmp, final, d, keep=0)
    _tmp_file(d, 9)                      # a crash mid-write leaves only a .tmp
    open(os.path.join(d, "notes.h5"), "w").close()
    assert store.candidates(d) == [final]


def test_the_newest_committed_checkpoint_wins_over_a_stale_latest(tmp_path):
    """latest naming step 2 while 3 exists (a crash between the commit's
    rename and the pointer update): loading 2 would let the run overwrite 3."""
    d = str(tmp_path)
    for step in (1, 2, 3):
        tmp, final = _tmp_file(d, step)
        store.commit(tmp, final, d, keep=0)
    store.write_latest(d, os.path.join(d, store.checkpoint_name(2)))
    assert [store.step_of(p) for p in store.candidates(d)] == [3, 2, 1]


def test_orphaned_temporary_files_are_found(tmp_path):
    d = str(tmp_path)
    tmp, final = _tmp_file(d, 4)
    store.commit(tmp, final, d, keep=0)
    left, _ = _tmp_file(d, 5)  # a save that crashed mid-write
    open(os.path.join(d, "latest.tmp"), "w").close()
    open(os.path.join(d, "notes.tmp"), "w").close()  # not ours: left alone
    assert store.orphans(d) == [os.path.join(d, "latest.tmp"), left]


def test_prune_spares_the_latest_and_the_new_file(tmp_path):
    d = str(tmp_path)
    for step in (1, 2, 3):
        tmp, final = _tmp_file(d, step)
        store.commit(tmp, final, d, keep=0)
    store.write_latest(d, os.path.join(d, store.checkpoint_name(1)))
    removed = store.prune(d, keep=1)
    assert [store.step_of(p) for p in removed] == [2]
    assert store.step_of(store.read_latest(d)) == 1
