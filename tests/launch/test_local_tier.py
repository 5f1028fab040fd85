"""The local tier on emulated nodes (``HPCTRAIN_RANKS_PER_NODE=2``, 6 ranks,
3 "nodes", so the ring of partners is not just pairs): ``checkpoint.local.every=5``,
``checkpoint.every=50`` (no persistent checkpoint is reached). Rank 4 is killed at
the start of step 24 (``debug.fault=die``), the watchdog aborts the job (so both
ranks of node 2 are gone) and records ``last_failure.json``; the test deletes node
2's local directory, as a lost node's storage is lost. The relaunch agrees on
step 20, fetches ranks 4 and 5's state from node 0 (their partner), and
its per-step losses from step 21 on are bit-identical to an uninterrupted
run's; metrics.jsonl's first step after the restart carries the recovery
fields. Before the relaunch the test also flips one byte of rank 0's own
file of step 20 on node 0 (issue 61: one damaged file crash-looped every
relaunch): the relaunch finds it by its checksum, says so in one line and
takes rank 0's copy on node 1 instead, bit-identically."""
import json
import shutil
import subprocess
import sys

import pytest

from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

# alone (a job beside it would skew what it times): a rank dies and the watchdog's hang timeout ends the job
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.alone]

STEPS = 26
COMMON = [f"trainer.steps={STEPS}", "trainer.log_every=1", "trainer.progress=off", "trainer.global_batch_size=6",
          "trainer.micro_batch_size=1", "trainer.seq_len=32", "model.d_model=32", "model.n_layers=1",
          "checkpoint.every=50", "checkpoint.local.every=5", "checkpoint.resume=auto",
          "reliability.hang_timeout_s=5", "reliability.straggler_every=0", "reliability.weight_check_every=0"]


def _run(tmp_path, name, *extra):
    cmd = [MPIEXEC, "-n", "6", sys.executable, "-m", "hpctrain", *COMMON, f"checkpoint.dir={tmp_path / name / 'ck'}",
           f"checkpoint.local.dir={tmp_path / name / 'local'}", *extra, f"hydra.run.dir={tmp_path / name / 'run'}"]
    return subprocess.run(cmd, env=_env(HPCTRAIN_RANKS_PER_NODE="2"), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=tmp_path)


def test_a_lost_node_resumes_from_its_partners_copies_bit_identically(tmp_path):
    ref = _run(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr
    want = {m["step"]: m["loss"] for m in _metrics(tmp_path / "ref" / "run")}
    assert sorted(want) == list(range(1, STEPS + 1))

    lost = _run(tmp_path, "job", "debug.fault=die", "debug.fault_rank=4", "debug.fault_step=24")
    assert lost.returncode != 0
    run, local = tmp_path / "job" / "run", tmp_path / "job" / "local"
    failure = json.loads((run / "last_failure.json").read_text())
    assert failure["ranks"] == [4] and failure["last_step"] == 23, failure
    assert [m["step"] for m in _metrics(run)] == list(range(1, 24))
    assert sorted(p.name for p in (local / "node_2").iterdir()) == ["step_00000015", "step_00000020"]
    shutil.rmtree(local / "node_2")  # the lost node's storage goes with it
    assert not list(tmp_path.glob("job/ck/*.h5"))  # nothing persistent to fall back on
    damaged = local / "node_0" / "step_00000020" / "rank_00000.bin"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    again = _run(tmp_path, "job")
    assert again.returncode == 0, again.stderr
    assert "resumed from the local tier" in again.stderr and "at step 20" in again.stderr, again.stderr
    assert "3 rank(s)' state fetched from partner nodes" in again.stderr  # ranks 4 and 5, and rank 0's damaged copy
    [line] = [x for x in again.stderr.splitlines() if "damaged copy" in x]
    assert "rank 0's state of step 20 on node 0: checksum mismatch" in line and "using the partner node's copy" in line
    assert "nothing to resume from" not in again.stderr and "starting from step 0" not in again.stderr
    assert "resumed at step 20 from the local tier, 3 step(s) recomputed" in again.stderr
    got = _metrics(run)
    assert [m["step"] for m in got] == list(range(1, 24)) + list(range(21, STEPS + 1))
    after = got[23:]
    assert [m["loss"] for m in after] == [want[s] for s in range(21, STEPS + 1)]
    first = after[0]
    assert first["recovery.tier"] == "local" and first["recovery.steps_recomputed"] == 3
    assert first["recovery.resumed_step"] == 20 and first["recovery.time_s"] > 0
    assert not any("recovery.tier" in m for m in after[1:])
    assert (run / "last_failure.recovered.json").is_file() and not (run / "last_failure.json").exists()
    # node 2 holds the tier again: its ranks' own state and node 1's copies, for the steps after the restart
    assert sorted(p.name for p in (local / "node_2").iterdir()) == ["step_00000025"]
