"""Background saving: one save in flight at a time, on a worker thread.

Why a thread (and not a helper process): the snapshot already sits in this
process's host memory, so a thread writes it with no second copy and no
IPC; it runs its collectives on the checkpointer's own duplicated
communicator (``comm.Dup()``), and MPI matches collectives per
communicator, so they never interleave with the training's. mpi4py
initialises MPI with ``MPI_THREAD_MULTIPLE``, which makes MPI calls from two
threads at once legal (checked with ``MPI.Query_thread()``; below that level
saves run synchronously, with a warning). h5py releases the GIL inside
``H5Dwrite``/``H5Dread`` and mpi4py inside blocking MPI calls, so the
training thread keeps running while the file is written. A helper process
would need the state copied again (shared memory), its own MPI world to
write one collective file (``MPI_Comm_spawn``, which many SLURM sites do
not allow), and twice the MPI endpoints.

A failure in the background is logged at once (naming the rank) and raised
again in the training thread at the next ``wait()``: the next save, or the
end of training. The thread is a daemon so a crashed run can still exit;
the trainer waits for it in a ``finally`` on the normal path.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from mpi4py import MPI

from hpctrain.log import get_logger

log = get_logger(__name__)


def threads_supported() -> bool:
    """Whether MPI may be called from the worker thread while training runs."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class BackgroundSaver:
    def __init__(self, rank: int):
        self.rank = rank
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None], what: str) -> None:
        """Run ``job`` in the background once the previous job has finished."""
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # re-raised in the training thread by wait()
                self._error = e
                log.error("rank %d: background checkpoint save (%s) failed: %s", self.rank, what, e)

        self._thread = threading.Thread(target=run, name=f"hpctrain-ckpt-{what}", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the job in flight has finished; raise its error. Returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return time.perf_counter() - t0
