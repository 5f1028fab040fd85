"""``trainer.elastic=true``: a 4-rank run on 2 emulated nodes
(``HPCTRAIN_RANKS_PER_NODE=2``, dp 4, global batch 8, local tier and
persistent checkpoint every 3 steps) loses node 1 (rank 2 dies at the
start of step 8, the watchdog ends the job; node 1's local directory is
deleted). The persistent checkpoints are moved aside, so the relaunch on
the 2 ranks that remain, with ``trainer.elastic=true``, can only resume from
the local tier: it deals the dp 4 replicas' step-6 state out to dp 2 and
keeps the global batch (4 accumulation steps per rank instead of 2). Its
losses from step 7 on equal those of a plain dp 2 run resumed from the
persistent step-6 checkpoint the failed run wrote (the same state through
the layout-independent format, which also shows a dp 4 checkpoint resumes
at dp 2): the same layout from the same state, so bit-identical, which is
within the dp parity tests' tolerance (rtol 1e-5) by a wide margin."""
import shutil
import subprocess
import sys

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

# alone (a job beside it would skew what it times): a rank dies and the watchdog's hang timeout ends the job
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.alone]

STEPS = 10
COMMON = [f"trainer.steps={STEPS}", "trainer.log_every=1", "trainer.progress=off", "trainer.global_batch_size=8",
          "trainer.micro_batch_size=1", "trainer.seq_len=32", "model.d_model=32", "model.n_layers=1",
          "checkpoint.every=3", "checkpoint.resume=auto", "reliability.hang_timeout_s=5",
          "reliability.straggler_every=0", "reliability.weight_check_every=0"]


def _run(tmp_path, name, ranks, *extra, ck=None):
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "hpctrain", *COMMON,
           f"checkpoint.dir={ck or tmp_path / name / 'ck'}", f"checkpoint.local.dir={tmp_path / name / 'local'}",
           *extra, f"hydra.run.dir={tmp_path / name / 'run'}"]
    return subprocess.run(cmd, env=_env(HPCTRAIN_RANKS_PER_NODE="2"), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=tmp_path)


def test_losing_a_node_continues_at_dp2_with_the_same_global_batch(tmp_path):
    lost = _run(tmp_path, "job", 4, "checkpoint.local.every=3", "debug.fault=die", "debug.fault_rank=2",
                "debug.fault_step=8")
    assert lost.returncode != 0
    run, local = tmp_path / "job" / "run", tmp_path / "job" / "local"
    assert [m["step"] for m in _metrics(run)] == list(range(1, 8))
    shutil.rmtree(local / "node_1")  # the lost node's storage goes with it
    saved = tmp_path / "saved-ck"
    shutil.move(tmp_path / "job" / "ck", saved)  # only the local tier is left to the relaunch
    assert (saved / "step_00000006.h5").is_file()

    again = _run(tmp_path, "job", 2, "checkpoint.local.every=3", "trainer.elastic=true", "parallel.dp=4")
    assert again.returncode == 0, again.stderr
    err = again.stderr
    assert "trainer.elastic=true: parallel.dp=4 is recomputed from the world size (2 ranks)" in err, err
    assert "checkpoint.local.replicas=1 lowered to 0: 1 node(s) remain" in err
    assert "dp=2 on 2 ranks; global batch 8 = 2 sample rank(s) x micro-batch 1 x 4 accumulation step(s)" in err
    assert "resumed from the local tier" in err and "at step 6 (48 samples consumed)" in err, err
    assert "written at dp(4) on 4 ranks, resharded to dp(2) on 2" in err
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, 8)) + list(range(7, STEPS + 1))
    elastic = {m["step"]: m["loss"] for m in got[7:]}
    assert got[7]["recovery.tier"] == "local" and got[7]["recovery.steps_recomputed"] == 1

    ref = _run(tmp_path, "ref", 2, ck=saved)
    assert ref.returncode == 0, ref.stderr
    assert f"resumed from {saved}/step_00000006.h5 at step 6" in ref.stderr, ref.stderr
    want = {m["step"]: m["loss"] for m in _metrics(tmp_path / "ref" / "run")}
    assert sorted(want) == list(range(7, STEPS + 1))
    assert elastic == want
