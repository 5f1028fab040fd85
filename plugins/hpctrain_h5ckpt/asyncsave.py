"""Background saving: one save in flight at a time, on a worker thread.

Why a thread (and not a helper process): the snapshot already sits in this
process's host memory, so a thread writes it with no second copy and no
IPC; it runs its collectives on the checkpointer's own duplicated
communicator (``comm.Dup()``), and MPI matches collectives per
communicator, so they never interleave with the training's. mpi4py
initialises MPI with ``MPI_THREAD_MULTIPLE``, which makes MPI calls from two
threads at once legal (checked with ``MPI.Query_thread()``; below that level
saves run synchronously, with a warning). numpy's copy and mpi4py's
blocking calls release the GIL; h5py holds it for the length of each
``H5Dwrite``, so the training thread can stall for one box's write at a
time (docs/checkpointing.md, "Async saving", gives the stalls measured). A helper process
would need the state copied again (shared memory), its own MPI world to
write one collective file (``MPI_Comm_spawn``, which many SLURM sites do
not allow), and twice the MPI endpoints.

A failure in the background is kept (``failed`` says so without waiting)
and raised again in the training thread at the next ``wait()``; the trainer
asks ``failed`` at every step boundary and reports it there, agreed over the
ranks (``hpctrain.train.save_failures``). A failure only this rank met (not
agreed inside the save) is also logged at once, naming the rank. The thread is a daemon so a crashed run can still exit;
the trainer waits for it in a ``finally`` on the normal path.

Overlapped staging (``checkpoint.hdf5.staging=overlap``, the default): the
copy to host memory also leaves the step. ``submit`` takes a ``stage``
callable that runs first on the worker thread, while the training thread
goes on with the next forward and backward (which only read parameters and
optimizer state); ``wait_staged`` (the checkpointer's ``before_update``,
called by the trainer right before the optimizer step) blocks until that
copy is done. If ``stage`` raises, ``wait_staged`` raises it; the
checkpointer's ``stage`` never does (it returns its error, which every
rank agrees on before the collective write, so none is left alone in a
collective), so there a copy failure surfaces at the next ``wait()``.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, TypeVar

from mpi4py import MPI

from hpctrain.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")


def threads_supported() -> bool:
    """Whether MPI may be called from the worker thread while training runs."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class BackgroundSaver:
    def __init__(self, rank: int):
        self.rank = rank
        self._thread: Optional[threading.Thread] = None
        self._staged = threading.Event()
        self._staged.set()
        self._error: Optional[BaseException] = None
        self._staging_failed = False

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """The last job has ended with an error that no ``wait()`` has raised yet (never blocks)."""
        return self._error is not None and not self.busy

    @property
    def staging(self) -> bool:
        """A submitted job has not finished copying its state to host memory yet."""
        return not self._staged.is_set()

    def submit(self, stage: Callable[[], T], write: Callable[[T], None], what: str) -> None:
        """Run ``write(stage())`` in the background once the previous job has
        finished; ``wait_staged`` returns once ``stage`` has."""
        self.wait()
        self._staged.clear()

        def run() -> None:
            try:
                try:
                    staged = stage()
                except BaseException:
                    self._staging_failed = True
                    raise
                finally:
                    self._staged.set()
                write(staged)
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait() / wait_staged()
                self._error = e
                if not getattr(e, "on_every_rank", False):  # (an agreed failure is the trainer's to report)
                    log.error("rank %d: background checkpoint save (%s) failed: %s", self.rank, what, e)

        self._thread = threading.Thread(target=run, name=f"hpctrain-ckpt-{what}", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._thread = None
            self._staged.set()  # nothing is staging; wait_staged must not block forever
            raise

    def wait_staged(self) -> float:
        """Block until the job in flight has copied its state to host memory.
        Raises a staging failure (the job has then ended). Returns the seconds waited."""
        t0 = time.perf_counter()
        self._staged.wait()
        if self._staging_failed:
            self.wait()  # joins the finished job and raises its error
        return time.perf_counter() - t0

    def wait(self) -> float:
        """Block until the job in flight has finished; raise its error. Returns the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error, self._staging_failed = self._error, None, False
            raise err
        return time.perf_counter() - t0
