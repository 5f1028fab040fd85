"""The decisions after a background or local save failed (hpctrain.train.save_failures), as pure functions:
the same agreed values give every rank the same branch. The runs: test_ckpt_async_failure.py,
tests/unit/localckpt/test_tier_faults.py, tests/mpi/test_local_tier_faults.py."""
from __future__ import annotations

from hpctrain.train.save_failures import after_local, after_persistent, first_failure, stop_message, who


def test_who_failed_and_why():
    failed = first_failure([None, "OSError: No space left on device", None, "OSError: EIO"])
    assert who(failed, (0, 0, 1, 1)) == ("1 (node 0), 3 (node 1)", "OSError: No space left on device")


def test_a_failed_local_save_falls_back_on_periodic_persistent_saves_only():
    assert after_local("x", 5).go_on and "checkpoint.every=5" in after_local("x", 5).line
    stop = after_local("x", 0)
    assert not stop.go_on and "stopping after a save attempt" in stop.line


def test_a_failed_persistent_save_falls_back_on_a_local_step_every_rank_holds():
    go = after_persistent("x", [7, 6], 1)
    assert go.go_on and "the local tier holds step 6 on every rank" in go.line  # the oldest rank's newest
    assert not after_persistent("x", [7, None], 1).go_on  # one rank has no complete local step
    assert "no other checkpoint tier is configured" in after_persistent("x", [None, None], 0).line


def test_the_stop_message_says_what_the_attempt_did():
    assert stop_message("L", "/c/step_3.h5", None) == ("L: checkpoint /c/step_3.h5 committed; relaunch with "
                                                       "checkpoint.resume=auto to go on")
    assert stop_message("L", None, "disk gone") == "L: the save attempt failed too (disk gone); nothing newer was saved"
