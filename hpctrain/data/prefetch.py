"""Reading the next step's data while this step computes.

``Prefetcher.next_step`` hands over the micro-batches a background thread
prepared from the cursor's state, advances the cursor, and starts preparing
the step after: the reads (positioned reads of the token files, which
release the GIL) overlap the forward and backward. What the training thread
still waits for it is ``data_wait_s`` in the step's metrics (the trainer
times ``next_step``; without a prefetcher it is the whole read). The cursor's state
moves only when a step is handed over, so a checkpoint saved between steps
holds exactly what training consumed; a state changed from outside (a
resume) is noticed and the prepared batch dropped.
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

from hpctrain.data.cursor import DataCursor, MicroBatch


class Prefetcher:
    """One step ahead of ``cursor`` on a daemon thread (see the module docstring)."""

    def __init__(self, cursor: DataCursor):
        self.cursor = cursor
        self._thread: Optional[threading.Thread] = None
        self._key: Optional[Tuple[int, Tuple[int, ...]]] = None
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def _state(self) -> Tuple[int, Tuple[int, ...]]:
        return self.cursor.consumed_samples, tuple(self.cursor.counts)

    def _start(self, consumed: int, counts: Tuple[int, ...]) -> None:
        self._key, self._result, self._error = (consumed, counts), None, None

        def run() -> None:
            try:
                self._result = self.cursor.prepare(consumed, list(counts))
            except BaseException as e:  # noqa: BLE001 - raised in the training thread by next_step
                self._error = e

        self._thread = threading.Thread(target=run, name="hpctrain-prefetch", daemon=True)
        self._thread.start()

    def next_step(self) -> List[MicroBatch]:
        """The micro-batches of the cursor's next step; the cursor advances."""
        if self._thread is None or self._key != self._state():
            self._join()
            self._start(*self._state())
        self._join()
        if self._error is not None:
            error, self._error, self._thread = self._error, None, None
            raise error
        mbs, after, short, samples = self._result
        self.cursor.advance(after, short, samples)
        self._start(*self._state())  # the step after this one, while it computes
        return mbs

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self._join()
        self._thread = None
