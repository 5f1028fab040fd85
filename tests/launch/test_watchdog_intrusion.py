"""A stranger on the machine tries to stop or confuse a real 4-rank job
through the hang watchdog's port (any process that can reach rank 0's node
can connect to it): a forged hello for rank 2, a line that is not JSON, and
10 MB without a newline. The job trains on as if undisturbed, rank 0 logs
one line per refused connection, and a real stall afterwards is still named."""
import json
import re
import socket
import subprocess
import sys
import time

import pytest

from test_faults import HANG_TIMEOUT, _one_error
from test_launchers import MPIEXEC, TIMEOUT, _env, _metrics

# alone (a job beside it would skew what it times): the watchdog's channel and a real stall after it
pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec"), pytest.mark.alone]

LISTENS = re.compile(r"hang watchdog: rank 0 listens on ([\d.]+):(\d+)")
REFUSED = "warning: hang watchdog: refused the connection from"
ARGS = ["trainer.progress=off", "trainer.log_every=1", f"reliability.hang_timeout_s={HANG_TIMEOUT}"]


def _intrude(host, port):
    """The three intrusions, one connection each; returns once rank 0 has closed each."""
    with socket.create_connection((host, port), timeout=10) as s:  # (a) a forged hello for rank 2, then close
        hello = {"t": "hello", "rank": 2, "host": "vm", "pid": 692, "step": 245, "phase": "training",
                 "issued": {}, "waiting": None, "last_op": None, "nonce": "00", "mac": "00" * 32}
        s.sendall((json.dumps(hello) + "\n").encode())
    with socket.create_connection((host, port), timeout=10) as s:  # (b) a line that is not JSON
        s.sendall(b"this is not json\n")
        while s.recv(65536):
            pass
    with socket.create_connection((host, port), timeout=10) as s:  # (c) 10 MB without a newline
        try:
            for _ in range(160):
                s.sendall(b"x" * 65536)
        except OSError:
            pass  # closed by rank 0 once the line passed its bound


def _launch(args, tmp_path, intrude):
    tmp_path.mkdir(exist_ok=True)
    cmd = ["timeout", str(TIMEOUT), MPIEXEC, "-n", "4", sys.executable, "-m", "hpctrain", *ARGS, *args,
           f"hydra.run.dir={tmp_path}"]
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines, injected = [], None
    for line in job.stdout:
        lines.append(line)
        found = LISTENS.search(line)
        if found and intrude:
            _intrude(found.group(1), int(found.group(2)))
        if injected is None and "injecting it now" in line:
            injected = time.monotonic()
    code = job.wait()
    return code, "".join(lines), (time.monotonic() - injected if injected is not None else None)


def test_a_stranger_can_neither_stop_nor_disturb_the_job_and_a_real_stall_is_still_named(tmp_path):
    """The disturbed job trains its first 14 steps with the losses of an undisturbed one, then rank 2
    stalls in step 15 and the watchdog names it as it would without the intrusions."""
    flat = "optim.min_lr_ratio=1.0"  # the learning rate after warmup does not depend on trainer.steps
    code, out, _ = _launch(["trainer.steps=14", flat], tmp_path / "quiet", intrude=False)
    assert code == 0, out
    code, out, took = _launch(["trainer.steps=40", flat, "debug.fault=stall", "debug.fault_rank=2",
                               "debug.fault_step=15"], tmp_path / "disturbed", intrude=True)
    assert code == 5, out
    lines = out.splitlines()
    refused = [i for i, line in enumerate(lines) if REFUSED in line]
    injected = next(i for i, line in enumerate(lines) if "injecting it now" in line)
    assert len(refused) == 3 and max(refused) < injected, out  # the intrusions came first
    assert "a hello for rank 2 without the job's secret" in lines[refused[0]]
    assert "a line that is not JSON" in lines[refused[1]]
    assert "a line longer than" in lines[refused[2]]
    before = "\n".join(lines[:injected])
    assert "error" not in before.replace("reliability", "")  # no verdict, no traceback before the stall
    quiet, disturbed = _metrics(tmp_path / "quiet"), _metrics(tmp_path / "disturbed")
    assert [m["loss"] for m in disturbed] == [m["loss"] for m in quiet]  # steps 1-14, as if undisturbed
    assert took is not None and took < 2 * HANG_TIMEOUT, (took, out)
    [line] = _one_error(out)
    assert "rank 2 (host" in line and "stopped making progress in step 15" in line, line
    assert "all_reduce #" in line and "on dp" in line, line
