"""Token files on disk: their size checked before step 1, their windows read
with positioned reads, and a file that shrinks under a running job stopped
on every rank at the step that would read past its end.

**Before step 1.** ``size_problem`` compares a token file's size with what
describes it (the ``.json`` sidecar's ``num_tokens`` and dtype today; a
Megatron ``.idx`` index's token count later) and with the dtype's item
size: a truncated copy, a file longer than its sidecar says, or a byte
count that is no whole number of tokens is one line naming the file, the
expected and the found bytes and tokens, and the fix. Validation calls it
on every rank before any collective (``hpctrain.data.sources``), so the
ranks agree through ``agree_on_problems`` and the job exits 2.

**While training.** A ``TokenFile`` reads each window with ``os.pread`` into
fresh memory, never through a memory map: a map turns a read past the end
of a file that was truncated after it was mapped into SIGBUS, which kills
the process with no word of why (exit status 135). ``pread`` returns short
instead; ``ShortRead`` says so. It costs about what slicing a ``np.memmap``
does (both copy each window out of the page cache; one system call more per
window, a few microseconds per step at the demo's size: README, Data). The
token count is the sidecar's (the size at opening without one), so every
rank builds the same sample order whatever happens to the file later. A
file replaced under the same name (``hpctrain-prepare`` writes a new file
and renames it over the old) does not disturb a running job: it reads the
file it opened to the end.

**Which ranks see it, and how they agree.** A short read happens only on
the ranks whose windows lie past the new end, and only from the moment of
the truncation: at a given step some ranks may see it and the others not.
A rank that stopped alone would leave the others waiting in the step's
collectives until the hang watchdog fires (or for ever with it off), and
an ``MPI_Abort`` from each rank that sees it would print a line per such
rank (several at once when several see it) over the launcher's abort
banner. So the trainer's cursor does not
raise at the read (``DataCursor(defer_short_reads=True)``): the missing
window is filled with token 0, the step runs on, and this rank's 0 or 1
rides in the step's loss-and-norm all-reduce (one more float64 in a
collective every rank enters before the optimizer update,
``hpctrain.train.grad_norm.reduce_totals``: no extra collective, no extra
synchronisation per step). Every rank then sees the same count and raises
``TokenFileChanged`` before the update, so nothing computed from the
substitute tokens is applied or saved; rank 0 writes the one line (its own
view of the file: the size it had at the start and the size now) and every
rank exits 2. Callers without that agreement (one-rank benchmarks) get
``ShortRead`` at the read.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

from hpctrain.errors import HpctrainError


def refill_advice(path: str) -> str:
    """The fix for a token file whose bytes are not what was written."""
    return (f"the copy is incomplete or the file changed after hpctrain-prepare wrote it: copy it again, "
            f"or re-run hpctrain-prepare <input.txt> {path}")


def size_problem(label: str, path: str, actual_bytes: int, dtype: np.dtype, expected_tokens: Optional[int],
                 described_by: str) -> Optional[str]:
    """One line saying how a token file's size disagrees with what describes
    it, or None when it agrees.

    ``label`` names the file as the user gave it (``data.path=...``);
    ``expected_tokens`` is the count its description records (None: none
    does, and only the item size can be checked); ``described_by`` names that
    description (``its sidecar x.json``). The same check serves any format
    that stores a flat array of tokens next to a count (issue 29's
    ``.bin``/``.idx`` pairs included): expected bytes against actual.
    """
    dtype = np.dtype(dtype)
    item, name = dtype.itemsize, dtype.name
    whole = actual_bytes % item == 0
    if expected_tokens is None:
        if whole:
            return None
        return (f"{label} has {actual_bytes} bytes, not a whole number of {item}-byte {name} tokens "
                f"(a truncated copy, or the wrong data.dtype); {refill_advice(path)}")
    expected = expected_tokens * item
    if actual_bytes == expected:
        return None
    found = f"{actual_bytes // item} tokens" if whole else f"not a whole number of {item}-byte tokens"
    what = (f"is truncated: expected {expected} bytes ({expected_tokens} {name} tokens, from {described_by})"
            if actual_bytes < expected else
            f"is longer than {described_by} says: expected {expected} bytes ({expected_tokens} {name} tokens)")
    return f"{label} {what}, found {actual_bytes} ({found}); {refill_advice(path)}"


class ShortRead(HpctrainError):
    """A window of a token file could not be read whole: the file shrank under
    the job. Seen by this rank alone; the trainer agrees on it first
    (``TokenFileChanged``)."""

    def __init__(self, message: str, file: "TokenFile"):
        super().__init__(message)
        self.file = file


class TokenFileChanged(HpctrainError):
    """Some rank's read of the token file came back short at this step; every
    rank raises it at the same point (the count is agreed), before the update."""

    on_every_rank = True


class TokenFile:
    """A flat file of token ids, read window by window with positioned reads.

    Sliced like the array it holds (``tokens[a:b]`` is a fresh ndarray of
    ``dtype``), so the sample order does not care whether tokens come from
    memory or from here. ``num_tokens`` defaults to the whole items the file
    holds when opened.
    """

    def __init__(self, path: str, dtype: npt.DTypeLike, num_tokens: Optional[int] = None, label: Optional[str] = None):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.label = label or f"data.path={path}"
        self._fd = os.open(path, os.O_RDONLY)
        self.opened_bytes = os.fstat(self._fd).st_size
        self.num_tokens = self.opened_bytes // self.dtype.itemsize if num_tokens is None else int(num_tokens)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def shape(self) -> Tuple[int]:
        return (self.num_tokens,)

    @property
    def expected_bytes(self) -> int:
        return self.num_tokens * self.dtype.itemsize

    def size_now(self) -> int:
        """The size of the file this job opened (its inode: a file replaced by
        a new one under the same name is still the old one here)."""
        return os.fstat(self._fd).st_size

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)``; ``ShortRead`` if the file ends first."""
        item = self.dtype.itemsize
        want, offset = count * item, start * item
        data = os.pread(self._fd, want, offset)
        while 0 < len(data) < want:  # a regular file reads short only at its end; make sure
            more = os.pread(self._fd, want - len(data), offset + len(data))
            if not more:
                break
            data += more
        if len(data) < want:
            raise ShortRead(f"{self.label} shrank under the running job: tokens [{start}, {start + count}) need "
                            f"bytes up to {offset + want}, it now holds {self.size_now()} bytes (it held "
                            f"{self.expected_bytes} when the job started); {refill_advice(self.path)}", self)
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, key: Union[slice, int]) -> Union[np.ndarray, int]:
        if isinstance(key, slice):
            start, stop, stride = key.indices(self.num_tokens)
            if stride != 1:
                raise IndexError("a TokenFile is read in contiguous windows (no stride)")
            return self.read(start, max(0, stop - start))
        index = range(self.num_tokens)[key]
        return int(self.read(index, 1)[0])

    def max(self, chunk_tokens: int = 1 << 22) -> int:
        """The largest token id (a scan in chunks; for files without a recorded vocabulary)."""
        top = 0
        for start in range(0, self.num_tokens, chunk_tokens):
            try:
                part = self.read(start, min(chunk_tokens, self.num_tokens - start))
            except ShortRead:
                break  # shrinking while opened: the steps that need the rest will say so, agreed
            if part.size:
                top = max(top, int(part.max()))
        return top

    def changed_message(self, step: int, ranks: int) -> str:
        """The line every rank raises once the ranks agree that ``ranks`` of
        them read short at ``step`` (rank 0's is the one printed)."""
        return (f"{self.label} changed under the running job: step {step} reads past its end on {ranks} "
                f"rank{'s' if ranks != 1 else ''}; it held {self.expected_bytes} bytes ({self.num_tokens} "
                f"{self.dtype.name} tokens) when the job started and holds {self.size_now()} now. A running job's "
                f"token file must not change: restore it (copy it again completely, or re-run hpctrain-prepare "
                f"to a new file) and resume from the last checkpoint")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass
