"""Faults injected with ``debug.fault`` that end a job through its own
agreement (no hang, no dead rank), run as ``hpctrain-train``'s ``main`` in
this session's ranks (tests/mpi/cli_session.py; formerly real launches in
tests/launch/test_faults.py, which keeps the stalls, freezes, kills and
stragglers the watchdog times): the job ends with the status and the one
line the user needs, and nothing already saved is lost."""
import os

import pytest
from cli_session import command, metrics, train

HANG_TIMEOUT = 5
BASE = ["trainer.progress=off", "trainer.log_every=1", f"reliability.hang_timeout_s={HANG_TIMEOUT}"]


@pytest.fixture
def job(world, capfd, monkeypatch, shared_tmp):
    monkeypatch.chdir(shared_tmp)
    return lambda *args: train(world, capfd, args, shared_tmp, quiet=BASE)


def _verify(world, path):
    """``hpctrain-ckpt verify`` on rank 0: every checksum and every value finite; its status on every rank."""
    code = command("hpctrain-ckpt")(["verify", str(path)]) if world.Get_rank() == 0 else None
    return world.bcast(code, root=0)


@pytest.mark.mpi(min_size=2)
def test_nan_at_step_3_with_stop_keeps_the_last_finite_checkpoint(world, job, shared_tmp):
    ckpt = os.path.join(shared_tmp, "ckpt")
    j = job("trainer.steps=6", "checkpoint.every=1", f"checkpoint.dir={ckpt}", "debug.fault=nan",
            "debug.fault_rank=1", "debug.fault_step=3")
    assert j.codes == [3] * len(j.codes), j.out
    [line] = j.errors()
    assert "step 3:" in line and "not all finite" in line, line
    assert [m["step"] for m in metrics(shared_tmp)] == [1, 2]
    assert sorted(p for p in os.listdir(ckpt) if p.endswith(".h5")) == ["step_00000001.h5", "step_00000002.h5"]
    assert _verify(world, ckpt) == 0


@pytest.mark.mpi(min_size=2)
def test_nan_at_step_3_with_skip_trains_on_and_counts_it(job, shared_tmp):
    j = job("trainer.steps=5", "reliability.nonfinite=skip", "debug.fault=nan", "debug.fault_rank=1",
            "debug.fault_step=3")
    assert j.codes == [0] * len(j.codes), j.out
    m = metrics(shared_tmp)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5]
    assert m[2]["loss"] is None and m[2]["skipped_steps"] == 1 and m[4]["skipped_steps"] == 1
    assert "skipped_steps" not in m[1] and all(x["loss"] is not None for x in m if x["step"] != 3)
    assert "update skipped" in j.out and not j.errors()


@pytest.mark.mpi(min_size=4)
def test_a_corrupted_replica_is_named(world, job):
    # 4 replicas (not 2): the one differing from the rest is named
    if world.Get_size() != 4:
        pytest.skip("written for 4 replicas")
    j = job("trainer.steps=6", "reliability.weight_check_every=1", "debug.fault=corrupt", "debug.fault_rank=1",
            "debug.fault_step=2")
    assert j.codes == [4] * 4, j.out
    [line] = j.errors()
    assert "step 2:" in line and "rank(s) 1 differ" in line, line


@pytest.mark.mpi(min_size=2)
def test_a_heartbeat_address_that_is_not_rank_0s_is_one_clear_line(job, monkeypatch):
    """Rank 0 listens only on the address it advertises (not on every interface)."""
    monkeypatch.setenv("HPCTRAIN_MASTER_ADDR", "0.0.0.1")
    j = job("trainer.steps=2")
    assert j.codes == [2] * len(j.codes), j.out
    [line] = j.errors()
    assert "rank 0 cannot listen on 0.0.0.1" in line and "HPCTRAIN_MASTER_ADDR" in line, line
    assert "reliability.hang_timeout_s=0" in line and "Traceback" not in j.out
