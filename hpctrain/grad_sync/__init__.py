"""The one gradient-sync engine (bucketed, overlapped, all-reduce or
reduce-scatter, ``no_sync``, ``mark_ready``): see ``engine``."""
from hpctrain.grad_sync.engine import GradSync, attach_to, of, reduction_comm  # noqa: F401
