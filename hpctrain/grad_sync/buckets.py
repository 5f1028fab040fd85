"""Bucket planning: which gradients travel together, in which order.

Pure logic, no communication. Parameters are visited in *reverse*
registration order, the usual proxy for the order their gradients become
ready in backward (a model registers its layers in forward order), and
packed greedily into buckets of at most ``cap_bytes``:

- a bucket is closed when the next parameter would push it over the cap, so
  a parameter larger than the cap always gets a bucket of its own (and
  ``cap_bytes=0`` gives one bucket per parameter);
- gradients of different dtypes or devices, or reduced over different
  groups (``groups``), never share a bucket (a bucket is one flat buffer
  reduced by one collective); each (group, dtype, device) has its own open
  bucket;
- bucket indices follow the order buckets were *opened*, which is the order
  the reducer launches them in (the same on every rank, see ``reducer``).

We do not re-plan from the gradient order observed in the first step (as
torch DDP can): that order may differ between ranks when control flow
depends on the data, and every rank must issue the same collectives in the
same order. Launching strictly in index order keeps that true regardless.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: ``indices`` into the parameter list and each one's element
    offset in the bucket's flat buffer (``numel`` elements in all)."""

    dtype: torch.dtype
    device: torch.device
    indices: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numel: int
    group: Hashable = None
    """What its parameters are reduced over: ``plan_buckets``'s ``groups`` entry, a
    hashable key (the engine passes its communicator's id), not a mesh Group."""

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class _Open:
    order: int
    dtype: torch.dtype
    device: torch.device
    group: Hashable
    indices: List[int] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    numel: int = 0
    nbytes: int = 0

    def freeze(self) -> BucketPlan:
        return BucketPlan(self.dtype, self.device, tuple(self.indices), tuple(self.offsets), self.numel, self.group)


def plan_buckets(params: Sequence[torch.Tensor], cap_bytes: int,
                 groups: Optional[Sequence[Hashable]] = None) -> List[BucketPlan]:
    """Buckets for ``params`` (in registration order), in launch order.
    ``groups[i]`` (hashable; default all the same) is what parameter ``i`` is
    reduced over."""
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes, got {cap_bytes}")
    closed: List[_Open] = []
    open_by_key: Dict[Tuple[Hashable, torch.dtype, torch.device], _Open] = {}
    opened = 0
    for i in reversed(range(len(params))):
        p = params[i]
        group = groups[i] if groups is not None else None
        key = (group, p.dtype, p.device)
        size = p.numel() * p.element_size()
        cur = open_by_key.get(key)
        if cur is not None and cur.indices and cur.nbytes + size > cap_bytes:
            closed.append(open_by_key.pop(key))
            cur = None
        if cur is None:
            cur = open_by_key[key] = _Open(opened, p.dtype, p.device, group)
            opened += 1
        cur.indices.append(i)
        cur.offsets.append(cur.numel)
        cur.numel += p.numel()
        cur.nbytes += size
        if cur.nbytes >= cap_bytes:
            closed.append(open_by_key.pop(key))
    closed.extend(open_by_key.values())
    return [b.freeze() for b in sorted(closed, key=lambda b: b.order)]


def cap_bytes_from_mb(bucket_mb: float) -> int:
    """``comm.bucket_mb`` (MiB, may be fractional) -> bytes."""
    return int(bucket_mb * (1 << 20))


def given_buckets(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[torch.Tensor]],
                  groups: Optional[Sequence[Hashable]] = None,
                  numel_of: Optional[Callable[[torch.Tensor], int]] = None) -> List[BucketPlan]:
    """BucketPlans for buckets chosen by the caller (a ZeRO plugin's flat
    groups), in the order given; members keep their order, laid out end to
    end. Members not in ``params`` (not synced) are skipped; every one of
    ``params`` must be in exactly one bucket, and a bucket's members must
    share dtype, device and group. ``numel_of``: each gradient's size when a
    parameter is not its own size now (a ZeRO-3 shard)."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: Dict[int, int] = {}
    plans: List[BucketPlan] = []
    for b, members in enumerate(buckets):
        idx = [index[id(p)] for p in members if id(p) in index]
        if not idx:
            continue
        keys = {(groups[i] if groups is not None else None, params[i].dtype, params[i].device) for i in idx}
        if len(keys) > 1:
            raise ValueError(f"bucket {b} mixes parameters of different groups, dtypes or devices")
        offsets, numel = [], 0
        for i in idx:
            if i in seen:
                raise ValueError(f"a parameter is in buckets {seen[i]} and {b}")
            seen[i] = b
            offsets.append(numel)
            numel += numel_of(params[i]) if numel_of is not None else params[i].numel()
        group, dtype, device = keys.pop()
        plans.append(BucketPlan(dtype, device, tuple(idx), tuple(offsets), numel, group))
    missing = [i for i in range(len(params)) if i not in seen]
    if missing:
        raise ValueError(f"{len(missing)} synced parameters are in no bucket (first: index {missing[0]})")
    return plans
