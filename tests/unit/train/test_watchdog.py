"""The hang watchdog's channel in one process: both ends of it run here over
real TCP sockets, with a stand-in for the MPI communicator, and a stranger
(any process that can reach the port) tries what a port scanner, a probe or
a hostile user would."""
import json
import socket
import time

import pytest

from hpctrain.bootstrap import advertised_address
from hpctrain.train import watchdog as wd_mod
from hpctrain.train.watchdog import Watchdog, WatchdogUnreachable
from hpctrain.train.watchdog_wire import MAX_LINE, rank_proof


class FakeComm:
    """Rank ``rank`` of a ``size``-rank job; ranks built on one ``shared`` dict see rank 0's broadcast."""

    def __init__(self, rank, size, shared):
        self.rank, self.size, self.shared, self.aborted = rank, size, shared, None

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        if self.rank == root:
            self.shared["bcast"] = obj
        return self.shared["bcast"]

    def allgather(self, obj):
        return [obj]

    def Abort(self, code):
        self.aborted = code
        raise SystemExit  # ends the watchdog thread quietly instead of the test process


def _wait(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def job():
    """Rank 0 of a 3-rank job (timeout 60 s: nothing is judged silent during a test)."""
    shared = {}
    comm = FakeComm(0, 3, shared)
    zero = Watchdog(comm, 60)
    yield zero, comm, shared
    zero.stop()


def _stranger(endpoint):
    s = socket.create_connection(endpoint, timeout=5)
    challenge = json.loads(s.makefile().readline())
    assert challenge["t"] == "challenge"
    return s, challenge["nonce"]


def _message(kind, rank, **extra):
    m = {"t": kind, "rank": rank, "host": "elsewhere", "pid": 1, "step": 245, "phase": "training", "issued": {},
         "waiting": None, "last_op": None, **extra}
    return (json.dumps(m) + "\n").encode()


def _hello(rank, mac):
    return _message("hello", rank, nonce="00", mac=mac)


def test_rank_0_listens_on_the_advertised_address_only(job):
    zero, _, _ = job
    assert zero.endpoint[0] == advertised_address() != "0.0.0.0"
    assert zero._listener.getsockname() == zero.endpoint


def test_a_forged_hello_is_refused_and_not_believed(job):
    zero, comm, _ = job
    s, _ = _stranger(zero.endpoint)
    s.sendall(_hello(2, "ab" * 32))
    s.close()
    assert _wait(lambda: zero.refused)
    assert "a hello for rank 2 without the job's secret" in zero.refused[0]
    time.sleep(0.6)  # one turn of the loop: believed, rank 2 would now be "dead" and the job aborted
    assert comm.aborted is None and zero.verdict is None


def test_a_hello_proved_for_another_challenge_is_refused(job):
    """A replayed hello: right secret, wrong challenge."""
    zero, _, shared = job
    secret = shared["bcast"][1]
    s, _ = _stranger(zero.endpoint)
    s.sendall(_hello(1, rank_proof(secret, "an-old-challenge", 1)))
    assert _wait(lambda: zero.refused)
    assert "without the job's secret" in zero.refused[0]
    s.close()


@pytest.mark.parametrize("payload, reason", [
    (b"this is not json\n", "a line that is not JSON"),
    (b"\xff\xfe\n", "a line that is not JSON"),
    (b"[1, 2]\n", "not an object with a kind"),
    (b'{"t": "shutdown"}\n', "unknown kind 'shutdown'"),
    (b'{"t": "hb", "rank": 2}\n', "'host' is missing"),
    (b'{"t": "verdict", "message": "rank 2 died"}\n', "a 'verdict' message before proving"),
])
def test_malformed_messages_close_the_connection_and_the_watchdog_goes_on(job, payload, reason):
    zero, comm, _ = job
    s, _ = _stranger(zero.endpoint)
    s.sendall(payload)
    assert _wait(lambda: zero.refused)
    assert reason in zero.refused[0], zero.refused
    assert s.recv(100) == b""  # closed by rank 0
    s.close()
    # the watchdog still serves: a real rank joins afterwards
    one = Watchdog(FakeComm(1, 3, job[2]), 60)
    one.stop()
    assert comm.aborted is None and zero.verdict is None and len(zero.refused) == 1


def test_a_line_without_end_is_bounded(job):
    zero, _, _ = job
    s, _ = _stranger(zero.endpoint)
    sent = 0
    with pytest.raises(OSError):  # rank 0 closes the connection long before 10 MB
        while sent < 10 * 2**20:
            s.sendall(b"x" * 65536)
            sent += 65536
    assert _wait(lambda: zero.refused)
    assert f"a line longer than {MAX_LINE} bytes" in zero.refused[0]
    assert sent < 10 * 2**20
    s.close()


def test_a_connection_that_never_speaks_is_closed_after_the_deadline(job, monkeypatch):
    monkeypatch.setattr(wd_mod, "HELLO_DEADLINE_S", 0.3)
    zero, _, _ = job
    s, _ = _stranger(zero.endpoint)
    assert _wait(lambda: zero.refused)
    assert "did not prove the job's secret within" in zero.refused[0]
    s.close()


def test_a_proved_connection_speaks_for_its_own_rank_only(job):
    zero, comm, shared = job
    secret = shared["bcast"][1]
    s, challenge = _stranger(zero.endpoint)
    s.sendall(_hello(1, rank_proof(secret, challenge, 1)))
    welcome = json.loads(s.makefile().readline())
    assert welcome["t"] == "welcome"
    s.sendall(_message("bye", 2, why="done"))
    assert _wait(lambda: zero.refused)
    assert "rank 1's connection sent a 'bye' message for rank 2" in zero.refused[0]
    s.close()


def test_a_second_connection_for_a_connected_rank_is_refused(job):
    zero, _, shared = job
    one = Watchdog(FakeComm(1, 3, shared), 60)
    secret = shared["bcast"][1]
    s, challenge = _stranger(zero.endpoint)
    s.sendall(_hello(1, rank_proof(secret, challenge, 1)))
    assert _wait(lambda: zero.refused)
    assert "rank 1, which is already connected" in zero.refused[0]
    s.close()
    one.stop()


def test_a_rank_without_the_secret_cannot_join():
    shared = {}
    zero = Watchdog(FakeComm(0, 2, shared), 60)
    endpoint, _ = shared["bcast"]
    shared["bcast"] = (endpoint, b"\0" * 32)
    with pytest.raises(WatchdogUnreachable, match="rank 1 could not join the watchdog of rank 0"):
        Watchdog(FakeComm(1, 2, shared), 60)
    assert _wait(lambda: zero.refused)
    zero.stop()


# the stand-in's Abort ends rank 1's watchdog thread with SystemExit, which pytest reports as a warning
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_rank_1_names_a_dead_rank_0_with_its_step_and_op(capsys):
    shared = {}
    zero = Watchdog(FakeComm(0, 2, shared), 2)
    comm1 = FakeComm(1, 2, shared)
    one = Watchdog(comm1, 2)
    zero.board.step, zero.board.phase = 10, "training"
    zero.board.issue("all_reduce", "dp")
    time.sleep(2 * zero.interval)  # a beat carries rank 0's state

    def die():  # rank 0 vanishes: its connections close without a word
        for peer in list(zero._peers.values()):
            zero._forget(peer)
        zero._listener.close()
    zero._close_all = die
    zero.stop()
    assert _wait(lambda: comm1.aborted == wd_mod.EXIT_CODE)
    one._thread.join(timeout=5)  # its SystemExit is reported within this test (filtered), not in a later one
    assert "died in step 10 (training)" in one.verdict and "its last op: all_reduce #1 on dp" in one.verdict
    assert f"pid {zero._state('hb')['pid']}" in one.verdict
    one._stop.set()


def test_a_failing_watchdog_thread_says_so_and_the_job_goes_on(monkeypatch, capsys):
    shared = {}
    comm0, comm1 = FakeComm(0, 2, shared), FakeComm(1, 2, shared)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("a bug in the rules")
    zero = Watchdog(comm0, 2)
    one = Watchdog(comm1, 2)
    monkeypatch.setattr(wd_mod, "diagnose", broken)
    assert _wait(lambda: calls and not zero._thread.is_alive())
    assert _wait(lambda: not one._thread.is_alive())  # rank 0 told it to stop watching
    time.sleep(3)  # past the timeout: nobody aborts
    assert comm0.aborted is None and comm1.aborted is None and one.verdict is None
    err = capsys.readouterr().err
    assert err.count("hang watchdog: rank 0's watchdog failed (RuntimeError: a bug in the rules); the job goes on "
                     "without hang detection") == 1, err
    one.stop()
    zero.stop()
