"""Recording communicator backend (``comm.backend=record``): the dry run's.

It moves no data: every collective is written down (op, group, axes,
dtype, bus bytes, peers) and the caller's tensors keep the shapes they were
given (the protocol works in place on caller-provided tensors), so a rank
of an N-rank job runs its training step alone in one process, on the meta
device (``hpctrain-train --dry-run``, ``hpctrain.dry_run``). Modules:
``plugin`` (hooks), ``communicator`` (the records).
"""
