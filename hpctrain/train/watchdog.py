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
of the fault, under twice the timeout. Rank 1 watches rank 0 the same way;
rank 0's heartbeats carry its own step and op, so rank 1 can say where
rank 0 was if it dies.

The channel is open to anyone who can reach rank 0's node, so it is
guarded (``hpctrain.train.watchdog_wire``): rank 0 listens only on the
address it advertises (``hpctrain.bootstrap.advertised_address``), every
connection proves a per-job secret broadcast over MPI before anything it
says is believed, and speaks for the rank it proved only. A connection that
fails the proof, sends something malformed or oversized, or says nothing
for ``HELLO_DEADLINE_S`` is closed and logged once at rank 0; the job goes
on. If a watchdog thread itself fails, its rank says so in one line and the
job goes on without hang detection rather than stopping a healthy run.

The other ranks stay quiet: an exception that follows from the fault
(a broken gloo connection) is not printed once the verdict is known
(``JobStopped``).
"""
from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, cast

from hpctrain.bootstrap import MASTER_ADDR_ENV, advertised_address
from hpctrain.comm.watch import OpBoard
from hpctrain.errors import HpctrainError
from hpctrain.log import get_logger
from hpctrain.train.hang import RankState, Verdict, diagnose
from hpctrain.train.recovery import write_failure
from hpctrain.train.watchdog_wire import (
    MAX_LINE,
    LineReader,
    WireError,
    check_message,
    new_nonce,
    new_secret,
    proof_matches,
    rank_proof,
    send,
    zero_proof,
)

log = get_logger(__name__)

EXIT_CODE = 5
HELLO_DEADLINE_S = 30.0
"""Seconds a new connection has to prove the job's secret."""
MAX_PENDING = 64
"""Connections that have not proved the secret yet, at most; more are refused."""
MAX_LOGGED_REFUSALS = 20
"""Refused connections logged one by one; later ones are counted."""


class WatchdogUnreachable(HpctrainError):
    """A rank cannot open its heartbeat connection to rank 0 (agreed by every rank)."""

    on_every_rank = True


class JobStopped(HpctrainError):
    """This rank's failure follows from a fault the watchdog has already reported."""

    exit_code = EXIT_CODE


class _Peer:
    """One connection to rank 0's watchdog: a stranger until it proves the secret."""

    def __init__(self, conn: socket.socket, addr: Any):
        self.conn, self.reader = conn, LineReader(conn)
        self.addr = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
        self.challenge = new_nonce()
        self.since = time.monotonic()
        self.rank: Optional[int] = None
        """The rank it proved to be (None until then)."""


class Watchdog:
    """One rank's end of the heartbeat channel (see the module docstring)."""

    def __init__(self, mpi_comm: Any, timeout_s: float, board: Optional[OpBoard] = None,
                 run_dir: Optional[str] = None):
        self.run_dir = run_dir
        """Where a verdict is recorded as ``last_failure.json`` (``hpctrain.train.recovery``); None: nowhere."""
        self.comm = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.timeout = float(timeout_s)
        self.interval = min(self.timeout / 4, 5.0)
        self.board = board or OpBoard()
        self.verdict: Optional[str] = None
        """The message of the verdict that stops the job, once known on this rank."""
        self._failed = False
        self.refused: List[str] = []
        """Rank 0: every refused connection, as ``"<address>: <reason>"``."""
        self.endpoint: Optional[Tuple[str, int]] = None
        """The address and port rank 0 listens on (every rank, once started)."""
        self._known = threading.Event()
        self._stop = threading.Event()
        # the name Slurm knows the node by (what `srun --exclude` takes, and the only difference between
        # emulated nodes of one machine), else the host name
        self._host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self._peers: Dict[socket.socket, _Peer] = {}
        problem = None
        if self.rank == 0:
            own = new_secret()
            secret: Optional[bytes] = own
            addr = advertised_address()
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._listener.bind((addr, 0))
                self._listener.listen(128)
                endpoint: Optional[Tuple[str, int]] = (addr, self._listener.getsockname()[1])
            except OSError as e:
                self._listener.close()
                problem = (f"rank 0 cannot listen on {addr} ({e.strerror or e}), the address it would tell the other "
                           "ranks to use")
                endpoint = None
            self._secret = own
            self._thread = threading.Thread(target=self._serve, name="hpctrain-watchdog", daemon=True)
            if endpoint is not None:
                self._thread.start()  # before the others connect: they wait for its challenge
                log.info("hang watchdog: rank 0 listens on %s:%d (timeout %g s)", endpoint[0], endpoint[1],
                         self.timeout)
        else:
            secret, endpoint = None, None
        # the secret travels over MPI only: never the environment, a file or a command line
        endpoint, secret = mpi_comm.bcast((endpoint, secret), root=0)
        self.endpoint = None if endpoint is None else tuple(endpoint)
        if self.rank != 0:
            assert secret is not None  # rank 0 always makes one
            self._secret = secret
            self._thread = threading.Thread(target=self._client, name="hpctrain-watchdog", daemon=True)
            if endpoint is not None:
                problem = self._join(tuple(endpoint))
        # every rank has connected (or all stop together) before anyone trains
        problems = [p for p in mpi_comm.allgather(problem) if p]
        if problems:
            self._stop.set()
            if self.rank == 0 and self._thread.is_alive():
                self._thread.join(timeout=5)
            raise WatchdogUnreachable(
                f"hang watchdog: {problems[0]}"
                + (f" and {len(problems) - 1} more rank(s)" if len(problems) > 1 else "")
                + f"; set {MASTER_ADDR_ENV} to an address of rank 0's node that the other nodes reach, "
                "or turn the watchdog off with reliability.hang_timeout_s=0")
        if self.rank != 0:
            self._thread.start()

    # -- what a rank says about itself ------------------------------------------------
    def _state(self, kind: str, **extra: Any) -> Dict[str, Any]:
        b = self.board
        w = b.waiting
        waiting = None if w is None else [w.op, w.group, w.seq, list(w.members), time.monotonic() - w.since]
        return {"t": kind, "rank": self.rank, "host": self._host, "pid": os.getpid(), "step": b.step,
                "phase": b.phase, "issued": dict(b.issued), "waiting": waiting,
                "last_op": list(b.last_op) if b.last_op else None, "failed": self._failed, **extra}

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
        try:
            self._serve_loop()
        except Exception as e:  # noqa: BLE001 - a fault of the watchdog itself must not stop a healthy job
            self._give_up(f"rank 0's watchdog failed ({type(e).__name__}: {e})")

    def _serve_loop(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._states: Dict[int, RankState] = {0: RankState(0)}
        self._by_rank: Dict[int, _Peer] = {}
        next_beat = 0.0
        while not self._stop.is_set():
            before = time.monotonic()
            ready = self._sel.select(timeout=min(self.interval, 0.5))
            if time.monotonic() - before > 2 * self.interval + 0.5:
                for s in self._states.values():  # this process itself was not running (stopped): the silence was ours
                    s.heard = time.monotonic()
            for key, _ in ready:
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj in self._peers:
                    self._receive(self._peers[key.fileobj])
            now = time.monotonic()
            for peer in [p for p in self._peers.values() if p.rank is None and now - p.since > HELLO_DEADLINE_S]:
                self._refuse(peer, f"it did not prove the job's secret within {HELLO_DEADLINE_S:g} s")
            here = self._state("hb")
            self._update(self._states[0], here, now)
            if self._failed:
                self._states[0].gone = "error"
            for r in range(1, self.size):  # a rank that never connected counts as silent from the start
                self._states.setdefault(r, RankState(r, heard=now))
            if now >= next_beat:
                next_beat = now + self.interval
                for peer in self._by_rank.values():
                    send(peer.conn, {"t": "beat", "zero": here})
            if self._stop.is_set():
                break
            verdict = diagnose(self._states, now, self.timeout)
            if verdict is not None:
                self._act(verdict, [p.conn for p in self._by_rank.values()])
                return
        self._close_all()

    def _accept(self) -> None:
        try:
            conn, addr = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        strangers = sorted((p for p in self._peers.values() if p.rank is None), key=lambda p: p.since)
        if len(strangers) >= MAX_PENDING:  # the oldest stranger makes room: a flood cannot lock the ranks out
            self._refuse(strangers[0], f"more than {MAX_PENDING} connections were waiting to prove the job's secret")
        peer = _Peer(conn, addr)
        self._peers[conn] = peer
        self._sel.register(conn, selectors.EVENT_READ)
        send(conn, {"t": "challenge", "nonce": peer.challenge})

    def _receive(self, peer: _Peer) -> None:
        try:
            messages = peer.reader.read()
        except WireError as e:
            self._refuse(peer, f"it sent {e}")
            return
        now = time.monotonic()
        if messages is None:
            if peer.rank is None:
                self._refuse(peer, "it closed the connection without proving the job's secret")
                return
            self._forget(peer)
            s = self._states[peer.rank]
            if s.gone is None:
                s.gone = "died"
            return
        for m in messages:
            if peer.rank is None:
                problem = self._admit(peer, m, now)
            elif m["t"] not in ("hb", "bye") or m["rank"] != peer.rank:
                problem = f"rank {peer.rank}'s connection sent a {m['t']!r} message for rank {m.get('rank', '?')}"
            else:
                problem = None
                s = self._states[peer.rank]
                self._update(s, m, now)
                if m["t"] == "bye":
                    s.gone = m["why"]
                elif m.get("failed") is True:
                    s.gone = "error"
            if problem:
                self._refuse(peer, problem)
                return

    def _admit(self, peer: _Peer, m: Dict[str, Any], now: float) -> Optional[str]:
        """Check a stranger's first message; None when it proved to be a rank of this job."""
        if m["t"] != "hello":
            return f"it sent a {m['t']!r} message before proving the job's secret"
        r = m["rank"]
        if not proof_matches(rank_proof(self._secret, peer.challenge, r), m["mac"]):
            return f"a hello for rank {r} without the job's secret"
        if not 0 < r < self.size:
            return f"a hello for rank {r}, which is not a rank of this job"
        if r in self._by_rank:
            return f"a hello for rank {r}, which is already connected"
        peer.rank = r
        self._by_rank[r] = peer
        self._update(self._states.setdefault(r, RankState(r)), m, now)
        send(peer.conn, {"t": "welcome", "mac": zero_proof(self._secret, m["nonce"], r)})
        return None

    def _forget(self, peer: _Peer) -> None:
        self._peers.pop(peer.conn, None)
        if peer.rank is not None and self._by_rank.get(peer.rank) is peer:
            del self._by_rank[peer.rank]
        try:
            self._sel.unregister(peer.conn)
        except (KeyError, ValueError):
            pass
        peer.conn.close()

    def _refuse(self, peer: _Peer, reason: str) -> None:
        """Close a connection that cannot be believed; one log line (the job goes on)."""
        self._forget(peer)
        self.refused.append(f"{peer.addr}: {reason}")
        n = len(self.refused)
        if n <= MAX_LOGGED_REFUSALS:
            log.warning("hang watchdog: refused the connection from %s: %s; the job goes on", peer.addr, reason)
        elif n == MAX_LOGGED_REFUSALS + 1:
            log.warning("hang watchdog: refused more connections; further ones are counted, not logged")

    def _close_all(self) -> None:
        """Tell every rank that rank 0 leaves the channel, then close it.

        Closing a socket with unread data in it sends a reset, which can
        overtake the ``leave`` on its way; so rank 0 half-closes, reads
        what the ranks still send until they close (at most a second), and
        only then closes."""
        ranks = [p for p in self._peers.values() if p.rank is not None]
        for peer in list(self._peers.values()):
            if peer.rank is None:
                self._forget(peer)
        for peer in ranks:
            send(peer.conn, {"t": "leave"})
            try:
                peer.conn.shutdown(socket.SHUT_WR)
            except OSError:
                self._forget(peer)
        deadline = time.monotonic() + 1.0
        open_ = {p.conn: p for p in ranks if p.conn in self._peers}
        while open_ and time.monotonic() < deadline:
            for key, _ in self._sel.select(timeout=max(0.0, deadline - time.monotonic())):
                # (cast: the selector gives back the registered socket; typeshed types it as any file-like)
                closing = open_.get(cast(socket.socket, key.fileobj))
                if closing is None:
                    continue
                try:
                    ended = not closing.conn.recv(MAX_LINE)
                except BlockingIOError:
                    continue
                except OSError:
                    ended = True
                if ended:
                    del open_[closing.conn]
                    self._forget(closing)
        for peer in list(self._peers.values()):
            self._forget(peer)
        self._listener.close()
        if len(self.refused) > MAX_LOGGED_REFUSALS:
            log.warning("hang watchdog: %d connections were refused in all", len(self.refused))

    def _give_up(self, why: str) -> None:
        """The watchdog thread failed: say so once, release the other ranks, let the job go on."""
        log.warning("hang watchdog: %s; the job goes on without hang detection", why)
        try:
            if self.rank == 0:
                self._close_all()
            else:
                send(self._sock, self._state("bye", why="unwatched"))
                self._sock.close()
        except Exception:  # noqa: BLE001 - nothing more to save here
            pass

    def _act(self, verdict: Verdict, conns) -> None:
        self._report(verdict.message)
        states = self._states
        # steps are synchronous: a rank that began step s means every rank finished s - 1. Rank 0's own
        # board is current; the others' heartbeats can be an interval (up to 5 s: many short steps) old
        finished = max([self.board.step] + [s.step for s in states.values()]) - 1
        write_failure(self.run_dir, verdict.message, list(verdict.stuck),
                      [states[r].host for r in verdict.stuck if r in states], max(0, finished))
        for conn in conns:
            send(conn, {"t": "verdict", "message": verdict.message})
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
        except Exception:  # noqa: BLE001 - leave anyway
            pass
        os._exit(EXIT_CODE)

    # -- every other rank -------------------------------------------------------------------
    def _join(self, endpoint: Tuple[str, int]) -> Optional[str]:
        """Connect to rank 0 and prove the secret (both ways); the problem, or None."""
        where = f"rank 0 at {endpoint[0]}:{endpoint[1]}"
        try:
            self._sock = socket.create_connection(endpoint, timeout=60)
        except OSError as e:
            return f"rank {self.rank} cannot reach {where} ({e})"
        self._reader = LineReader(self._sock)
        try:
            challenge = self._reader.read_one(60)
            if challenge["t"] != "challenge":
                raise WireError(f"a {challenge['t']!r} message instead of a challenge")
            nonce = new_nonce()
            send(self._sock, self._state("hello", nonce=nonce, mac=rank_proof(self._secret, challenge["nonce"],
                                                                              self.rank)))
            welcome = self._reader.read_one(60)
            if welcome["t"] != "welcome" or not proof_matches(zero_proof(self._secret, nonce, self.rank),
                                                              welcome["mac"]):
                raise WireError("an answer without the job's secret (another process holds the port?)")
        except WireError as e:
            self._sock.close()
            return f"rank {self.rank} could not join the watchdog of {where}: it got {e}"
        return None

    def _client(self) -> None:
        try:
            self._client_loop()
        except Exception as e:  # noqa: BLE001 - a fault of the watchdog itself must not stop a healthy job
            self._give_up(f"rank {self.rank}'s watchdog failed ({type(e).__name__}: {e})")

    def _client_loop(self) -> None:
        reader = self._reader
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
                send(self._sock, self._state("hb"))
            ready = sel.select(timeout=min(self.interval, 0.5))
            if time.monotonic() - now > 2 * self.interval + 0.5:
                heard = time.monotonic()  # this process itself was not running (stopped): the silence was ours
            if not ready:
                if time.monotonic() - heard > self.timeout and not self._stop.is_set():
                    zero.heard = heard
                    self._rank0_lost(diagnose({0: zero}, time.monotonic(), self.timeout), zero)
                    return
                continue
            messages = reader.read()
            heard = time.monotonic()
            if messages is None:
                if not self._stop.is_set():
                    zero.gone = "died"
                    self._rank0_lost(diagnose({0: zero}, heard, self.timeout), zero)
                return
            for m in messages:
                if m["t"] == "beat":
                    self._update(zero, check_message(m["zero"]), heard)
                elif m["t"] == "verdict":
                    self.verdict = m["message"]
                    self._known.set()
                    # rank 0 aborts the job; if its abort does not reach us, leave anyway
                    if self._stop.wait(10 * self.interval + 5):
                        return
                    os._exit(EXIT_CODE)
                elif m["t"] == "leave":
                    return

    def _rank0_lost(self, verdict: Optional[Verdict], zero: RankState) -> None:
        assert verdict is not None  # rank 0 silent past the timeout, or gone: always a verdict
        if self.rank == 1:  # one rank speaks for the others
            self._report(verdict.message)
            write_failure(self.run_dir, verdict.message, [0], [zero.host], max(self.board.step, zero.step) - 1)
            self._abort()
        self.verdict = verdict.message
        self._known.set()

    # -- the training thread ---------------------------------------------------------------
    def wait_for_verdict(self, seconds: float) -> Optional[str]:
        """The verdict, waiting up to ``seconds`` for one (a failure on this rank
        caused by another rank's death is seen here slightly before the verdict)."""
        self._known.wait(seconds)
        return self.verdict

    def failed(self) -> None:
        """This rank's run ended with an error but the rank stays in the job (``hpctrain-tune`` goes on
        to agree with the others on the failure): rank 0 counts it as having left with an error from
        the next heartbeat on, so ranks still waiting for it are named after the timeout, while ranks
        that all failed together wait for nothing. The channel stays open until ``stop``."""
        self._failed = True

    def stop(self, why: str = "done") -> None:
        """Leave the channel with a goodbye (no verdict follows from it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)  # it may be sending a heartbeat on the same socket
        if self.rank != 0:
            send(self._sock, self._state("bye", why=why))
            try:
                self._sock.close()
            except OSError:
                pass
