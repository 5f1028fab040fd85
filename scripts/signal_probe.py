"""What a launcher does to its ranks when it is stopped (docs/slurm.md,
"Stopping through the launcher"): each rank writes, to ``<dir>/rank<N>``,
the wall-clock time of its start and of every signal it receives, and keeps
``<dir>/alive<N>`` holding the time of its last sign of life (every 50 ms).
SIGKILL cannot be caught, so the last sign of life is when it came.

    mpiexec -n 2 python scripts/signal_probe.py /tmp/probe &  # or srun --mpi=pmix -n 2 ...
    sleep 5; date +%s.%N; kill -TERM %1                       # then compare the times

``PROBE_S`` (default 60) ends the probe; ``PROBE_EXIT_AFTER`` makes a rank
exit with status 75 that many seconds after its first SIGTERM, SIGINT or
SIGUSR1, as a run that saves and stops would.
"""
import os
import signal
import sys
import time

from mpi4py import MPI

CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT, signal.SIGUSR1, signal.SIGUSR2)


def main(out_dir: str) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    os.makedirs(out_dir, exist_ok=True)
    log = open(os.path.join(out_dir, f"rank{rank}"), "w", buffering=1)
    alive = os.path.join(out_dir, f"alive{rank}")
    exit_after = os.environ.get("PROBE_EXIT_AFTER")
    stop_at = []

    def record(signum, frame):
        log.write(f"{time.time():.3f} {signal.Signals(signum).name}\n")
        if exit_after and signum != signal.SIGCONT and not stop_at:
            stop_at.append(time.time() + float(exit_after))

    for sig in CAUGHT:
        signal.signal(sig, record)
    log.write(f"{time.time():.3f} START\n")
    MPI.COMM_WORLD.Barrier()
    end = time.time() + float(os.environ.get("PROBE_S", "60"))
    while time.time() < end:
        time.sleep(0.05)
        with open(alive + ".tmp", "w") as f:
            f.write(f"{time.time():.3f}\n")
        os.replace(alive + ".tmp", alive)
        if stop_at and time.time() >= stop_at[0]:
            log.write(f"{time.time():.3f} EXIT 75\n")
            os._exit(75)
    log.write(f"{time.time():.3f} END\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "signal-probe")
