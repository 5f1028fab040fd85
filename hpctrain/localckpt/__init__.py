"""The local resilience tier (``checkpoint.local.*``): every rank's exact
state on node-local storage every ``checkpoint.local.every`` steps, with
copies on ``checkpoint.local.replicas`` partner nodes, and ``resume=auto``
from the newest step the surviving nodes hold in full when it is newer than
the persistent checkpoint (docs/reliability.md, "The local tier").

- ``state``: what a rank's state is and its file format (no pickle);
- ``store``: the node directory, manifests, pruning;
- ``tier``: ``LocalTier`` (save in the background, replicate, agree, fetch, restore).
"""
from hpctrain.localckpt.tier import Found, LocalTier, default_dir, partners

__all__ = ["Found", "LocalTier", "default_dir", "partners"]
