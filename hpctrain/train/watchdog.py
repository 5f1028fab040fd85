"""The hang watchdog: heartbeats to rank 0 on a channel of their own.

``reliability.hang_timeout_s`` > 0 on more than one rank starts one thread
per rank. The channel is a TCP connection from every rank to rank 0
(address broadcast over MPI at the start, like the torch rendezvous), not
the training transport: it keeps working while MPI, NCCL or gloo are stuck,
and the operating system closes it the moment a process dies, so a death is
seen at once and by name.

Every ``interval`` seconds (a quarter of the timeout, at most 5 s; half that
when a new step has begun) each rank sends rank 0 its board (``hpctrain.comm.watch``: step, phase, collectives
issued per group, the current wait) and rank 0 sends every rank a
heartbeat. Rank 0 judges (``hpctrain.train.hang``) and, on a verdict,
writes one ``hpctrain: error:`` line naming the stuck or dead rank, its op
and sequence number and who waits for it, tells every rank, and aborts the
job (``MPI_Abort``, exit status 5): within the timeout plus two intervals
of the fault, under twice the timeout. Rank 1 watches rank 0 the same way.

The other ranks stay quiet: an exception that follows from the fault
(a broken gloo connection) is not printed once the verdict is known
(``JobStopped``).
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional

from hpctrain.bootstrap import MASTER_ADDR_ENV, advertised_address
from hpctrain.comm.watch import OpBoard
from hpctrain.errors import HpctrainError
from hpctrain.log import get_logger
from hpctrain.train.hang import RankState, Verdict, diagnose

log = get_logger(__name__)

EXIT_CODE = 5


class WatchdogUnreachable(HpctrainError):
    """A rank cannot open its heartbeat connection to rank 0 (agreed by every rank)."""

    on_every_rank = True


class JobStopped(HpctrainError):
    """This rank's failure follows from a fault the watchdog has already reported."""

    exit_code = EXIT_CODE


def _send(sock: socket.socket, message: Dict[str, Any]) -> bool:
    try:
        sock.sendall((json.dumps(message) + "\n").encode())
        return True
    except OSError:
        return False


class _Lines:
    """Newline-separated JSON messages from one socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def read(self):
        """The messages available now; None when the peer closed the connection."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        return [json.loads(line) for line in lines if line]


class Watchdog:
    """One rank's end of the heartbeat channel (see the module docstring)."""

    def __init__(self, mpi_comm: Any, timeout_s: float, board: Optional[OpBoard] = None):
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.timeout = float(timeout_s)
        self.interval = min(self.timeout / 4, 5.0)
        self.board = board or OpBoard()
        self.verdict: Optional[str] = None
        """The message of the verdict that stops the job, once known on this rank."""
        self._known = threading.Event()
        self._stop = threading.Event()
        self._host = socket.gethostname()
        if self.rank == 0:
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(("", 0))
            self._listener.listen(max(self.size, 128))
            endpoint = (advertised_address(), self._listener.getsockname()[1])
        else:
            endpoint = None
        endpoint = mpi_comm.bcast(endpoint, root=0)
        problem = None
        if self.rank == 0:
            self._thread = threading.Thread(target=self._serve, name="hpctrain-watchdog", daemon=True)
        else:
            try:
                self._sock = socket.create_connection(tuple(endpoint), timeout=60)
                self._sock.settimeout(None)
                _send(self._sock, self._state("hello"))
            except OSError as e:
                problem = f"rank {self.rank} cannot reach rank 0 at {endpoint[0]}:{endpoint[1]} ({e})"
            self._thread = threading.Thread(target=self._client, name="hpctrain-watchdog", daemon=True)
        # every rank has connected (or all stop together) before anyone trains
        problems = [p for p in mpi_comm.allgather(problem) if p]
        if problems:
            if self.rank == 0:
                self._listener.close()
            raise WatchdogUnreachable(
                f"hang watchdog: {problems[0]}" + (f" and {len(problems) - 1} more rank(s)" if len(problems) > 1 else "")
                + f"; set {MASTER_ADDR_ENV} to an address of rank 0's node that the other nodes reach, "
                "or turn the watchdog off with reliability.hang_timeout_s=0")
        self._thread.start()

    # -- what a rank says about itself ------------------------------------------------
    def _state(self, kind: str, **extra: Any) -> Dict[str, Any]:
        b = self.board
        w = b.waiting
        waiting = None if w is None else [w.op, w.group, w.seq, list(w.members), time.monotonic() - w.since]
        return {"t": kind, "rank": self.rank, "host": self._host, "pid": os.getpid(), "step": b.step,
                "phase": b.phase, "issued": dict(b.issued), "waiting": waiting,
                "last_op": list(b.last_op) if b.last_op else None, **extra}

    @staticmethod
    def _update(s: RankState, m: Dict[str, Any], now: float) -> None:
        s.host, s.pid, s.step, s.phase = m["host"], m["pid"], m["step"], m["phase"]
        s.issued = m["issued"]
        w = m["waiting"]
        s.waiting = None if w is None else (w[0], w[1], w[2], tuple(w[3]), w[4])
        s.last_op = tuple(m["last_op"]) if m["last_op"] else None
        s.heard = now

    # -- rank 0 ---------------------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ)
        states: Dict[int, RankState] = {0: RankState(0)}
        readers: Dict[socket.socket, _Lines] = {}
        rank_of: Dict[socket.socket, int] = {}
        next_beat = 0.0
        while not self._stop.is_set():
            before = time.monotonic()
            ready = sel.select(timeout=min(self.interval, 0.5))
            if time.monotonic() - before > 2 * self.interval + 0.5:
                for s in states.values():  # this process itself was not running (stopped): the silence was ours
                    s.heard = time.monotonic()
            for key, _ in ready:
                if key.fileobj is self._listener:
                    try:
                        conn, _ = self._listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    readers[conn] = _Lines(conn)
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                messages = readers[conn].read()
                now = time.monotonic()
                for m in messages or []:
                    r = m["rank"]
                    rank_of[conn] = r
                    s = states.setdefault(r, RankState(r))
                    self._update(s, m, now)
                    if m["t"] == "bye":
                        s.gone = m.get("why", "done")
                if messages is None:
                    sel.unregister(conn)
                    conn.close()
                    r = rank_of.get(conn)
                    if r is not None and states[r].gone is None:
                        states[r].gone = "died"
            now = time.monotonic()
            self._update(states[0], self._state("hb"), now)
            for r in range(1, self.size):  # a rank that never connected counts as silent from the start
                states.setdefault(r, RankState(r, heard=now))
            if now >= next_beat:
                next_beat = now + self.interval
                for conn in list(readers):
                    if conn in rank_of:
                        _send(conn, {"t": "hb"})
            if self._stop.is_set():
                break
            verdict = diagnose(states, now, self.timeout)
            if verdict is not None:
                self._act(verdict, [c for c in readers if c in rank_of])
                return
        for conn in readers:
            _send(conn, {"t": "bye"})
            conn.close()
        self._listener.close()

    def _act(self, verdict: Verdict, conns) -> None:
        self._report(verdict.message)
        for conn in conns:
            _send(conn, {"t": "verdict", "message": verdict.message})
        self._abort()

    def _report(self, message: str) -> None:
        self.verdict = message
        self._known.set()
        sys.stderr.write(f"hpctrain: error: hang watchdog: {message}. Stopping the job (exit status {EXIT_CODE}; "
                         f"reliability.hang_timeout_s={self.timeout:g}).\n")
        sys.stderr.flush()

    def _abort(self) -> None:
        time.sleep(0.2)  # let the verdict reach the other ranks before the launcher tears the job down
        try:
            self.comm.Abort(EXIT_CODE)
        finally:
            os._exit(EXIT_CODE)

    # -- every other rank -------------------------------------------------------------------
    def _client(self) -> None:
        reader = _Lines(self._sock)
        self._sock.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        heard = time.monotonic()
        next_beat, sent_step = 0.0, -1
        zero = RankState(0)
        while not self._stop.is_set():
            now = time.monotonic()
            # on schedule, or early (half an interval) when a new step began, so rank 0 knows the step
            if now >= next_beat or (self.board.step != sent_step and now >= next_beat - self.interval / 2):
                next_beat, sent_step = now + self.interval, self.board.step
                _send(self._sock, self._state("hb"))
            ready = sel.select(timeout=min(self.interval, 0.5))
            if time.monotonic() - now > 2 * self.interval + 0.5:
                heard = time.monotonic()  # this process itself was not running (stopped): the silence was ours
            if not ready:
                if time.monotonic() - heard > self.timeout and not self._stop.is_set():
                    zero.heard = heard
                    self._rank0_lost(diagnose({0: zero}, time.monotonic(), self.timeout))
                    return
                continue
            messages = reader.read()
            heard = time.monotonic()
            if messages is None:
                if not self._stop.is_set():
                    zero.gone = "died"
                    self._rank0_lost(diagnose({0: zero}, heard, self.timeout))
                return
            for m in messages:
                if m["t"] == "verdict":
                    self.verdict = m["message"]
                    self._known.set()
                    # rank 0 aborts the job; if its abort does not reach us, leave anyway
                    if self._stop.wait(10 * self.interval + 5):
                        return
                    os._exit(EXIT_CODE)
                if m["t"] == "bye":
                    return

    def _rank0_lost(self, verdict: Verdict) -> None:
        if self.rank == 1:  # one rank speaks for the others
            self._report(verdict.message)
            self._abort()
        self.verdict = verdict.message
        self._known.set()

    # -- the training thread ---------------------------------------------------------------
    def wait_for_verdict(self, seconds: float) -> Optional[str]:
        """The verdict, waiting up to ``seconds`` for one (a failure on this rank
        caused by another rank's death is seen here slightly before the verdict)."""
        self._known.wait(seconds)
        return self.verdict

    def stop(self, why: str = "done") -> None:
        """Leave the channel with a goodbye (no verdict follows from it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)  # it may be sending a heartbeat on the same socket
        if self.rank != 0:
            _send(self._sock, self._state("bye", why=why))
            try:
                self._sock.close()
            except OSError:
                pass
