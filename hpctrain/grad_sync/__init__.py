"""The one gradient-sync engine (bucketed, overlapped, all-reduce or
reduce-scatter, ``no_sync``, ``mark_ready``), configured by one dataclass:

- ``buckets``: which gradients travel together (the bucket planner);
- ``bucket``: one bucket's buffer, views and per-step state;
- ``reduction``: the collectives (plain, compressed, reduce-scatter);
- ``config.SyncConfig``: every option, checked together;
- ``engine.GradSync``: hooks, launch order, ``finish``; ``shards()`` is the
  reduce-scatter result ZeRO reads.
"""
from hpctrain.grad_sync.config import SyncConfig  # noqa: F401
from hpctrain.grad_sync.engine import GradSync, ReducedShard, reduction_comm  # noqa: F401
