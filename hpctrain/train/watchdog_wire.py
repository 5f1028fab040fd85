"""The hang watchdog's wire: framing, bounds, message checks and the handshake
that proves a connection belongs to this job.

Anyone who can reach rank 0's node can open a TCP connection to the
watchdog's port, so nothing a connection says is believed until it has
proved the job's secret:

1. rank 0 draws a 32-byte secret per job and broadcasts it over MPI (never
   through the environment, a file or the command line);
2. on accept, rank 0 sends a fresh random ``challenge`` nonce;
3. the rank answers with ``hello``: its rank, its own nonce and
   ``HMAC-SHA256(secret, "rank|<challenge>|<rank>")``; rank 0 compares in
   constant time, and from then on the connection speaks for that rank only;
4. rank 0 answers ``welcome`` with ``HMAC(secret, "zero|<rank's nonce>|<rank>")``,
   so the rank knows it reached the job's own rank 0.

A replayed hello fails (a new challenge every connection). Lines are at most
``MAX_LINE`` bytes; a longer one, one that is not JSON, or a message of an
unknown kind or shape raises ``WireError`` and the caller closes that
connection.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import time
from typing import Any, Dict, List, Optional

MAX_LINE = 64 * 1024
"""Bytes in one message line (a state message is a few hundred bytes)."""

SECRET_BYTES = 32
_NONCE_BYTES = 16

# message kind -> the fields it must carry, with their types (``None`` allowed where listed)
_STATE_FIELDS = {"rank": int, "host": str, "pid": int, "step": int, "phase": str, "issued": dict,
                 "waiting": (list, type(None)), "last_op": (list, type(None))}
KINDS: Dict[str, Dict[str, Any]] = {
    "challenge": {"nonce": str},
    "hello": {**_STATE_FIELDS, "nonce": str, "mac": str},
    "welcome": {"mac": str},
    "hb": dict(_STATE_FIELDS),
    "beat": {"zero": dict},
    "bye": {**_STATE_FIELDS, "why": str},
    "verdict": {"message": str},
    "leave": {},
}
"""Every message kind: hb/bye are a rank's state; beat is rank 0's heartbeat
(carrying its own state, so rank 1 can describe rank 0 if it dies); leave
is rank 0 leaving the channel (the job ends, or rank 0's watchdog failed)."""


class WireError(Exception):
    """What a connection sent cannot be accepted; the message says what."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def new_nonce() -> str:
    return secrets.token_hex(_NONCE_BYTES)


def rank_proof(secret: bytes, challenge: str, rank: int) -> str:
    """What a rank answers to rank 0's challenge."""
    return hmac.new(secret, f"rank|{challenge}|{rank}".encode(), hashlib.sha256).hexdigest()


def zero_proof(secret: bytes, nonce: str, rank: int) -> str:
    """What rank 0 answers to a rank's nonce."""
    return hmac.new(secret, f"zero|{nonce}|{rank}".encode(), hashlib.sha256).hexdigest()


def proof_matches(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode())


def check_message(m: Any) -> Dict[str, Any]:
    """``m`` if it is a message of a known kind with every field of the right type."""
    if not isinstance(m, dict) or not isinstance(m.get("t"), str):
        raise WireError("a message that is not an object with a kind")
    fields = KINDS.get(m["t"])
    if fields is None:
        raise WireError(f"a message of unknown kind {m['t'][:32]!r}")
    for name, kind in fields.items():
        if not isinstance(m.get(name), kind) or isinstance(m.get(name), bool):
            raise WireError(f"a {m['t']!r} message whose {name!r} is missing or of the wrong type")
    if "issued" in fields and not all(isinstance(k, str) and isinstance(v, int) for k, v in m["issued"].items()):
        raise WireError(f"a {m['t']!r} message whose 'issued' is not counts by group")
    w = m.get("waiting")
    if w is not None and not (len(w) == 5 and isinstance(w[0], str) and isinstance(w[1], str)
                              and isinstance(w[2], (int, type(None))) and isinstance(w[3], list)
                              and all(isinstance(x, int) for x in w[3]) and isinstance(w[4], (int, float))):
        raise WireError(f"a {m['t']!r} message whose 'waiting' is malformed")
    op = m.get("last_op")
    if op is not None and not (len(op) == 3 and isinstance(op[0], str) and isinstance(op[1], str)
                               and isinstance(op[2], (int, type(None)))):
        raise WireError(f"a {m['t']!r} message whose 'last_op' is malformed")
    return m


def encode(message: Dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def send(sock: socket.socket, message: Dict[str, Any]) -> bool:
    """Send one message; False when the connection is gone."""
    try:
        sock.sendall(encode(message))
        return True
    except OSError:
        return False


class LineReader:
    """Newline-separated JSON messages from one non-blocking socket, at most
    ``MAX_LINE`` bytes each (the buffer never holds more)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def read(self) -> Optional[List[Dict[str, Any]]]:
        """The messages available now ([] when none yet); None when the peer
        closed the connection. Raises ``WireError`` on a bad line."""
        try:
            data = self.sock.recv(MAX_LINE)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_LINE or any(len(line) > MAX_LINE for line in lines):
            raise WireError(f"a line longer than {MAX_LINE} bytes")
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                m = json.loads(line)
            except (UnicodeDecodeError, ValueError):
                raise WireError("a line that is not JSON") from None
            out.append(check_message(m))
        return out

    def read_one(self, timeout: float) -> Dict[str, Any]:
        """Block (up to ``timeout`` seconds in all) for the next message.
        Raises ``WireError`` when none comes or the connection closes."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(timeout)
        pending: List[Dict[str, Any]] = []
        try:
            while not pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WireError(f"no answer within {timeout:g} s")
                self.sock.settimeout(left)
                got = self.read()
                if got is None:
                    raise WireError("the connection closed")
                pending.extend(got)
        finally:
            self.sock.settimeout(None)
        if len(pending) > 1:
            raise WireError("more than one message during the handshake")
        return pending[0]
