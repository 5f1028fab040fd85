"""The mpi backend's ViewCache on its own: when a remembered tensor's buffer
may be used, what is forgotten, and that nothing is kept alive. (The
all_reduce fast path repeats ``get``'s checks inline; tests/mpi/comm/
test_repeat_calls.py runs them through real collectives.)"""
from __future__ import annotations

import gc
import weakref

import torch

from hpctrain_comm_mpi.buffers import ViewCache, WireBuffer


def _remember(cache: ViewCache, t: torch.Tensor) -> None:
    cache.remember(t, WireBuffer(t, reduce=True, read=True, write=True, cuda_aware=False))


def test_hit_only_while_address_size_and_contiguity_hold():
    cache = ViewCache()
    t = torch.zeros(4, 4)
    assert cache.get(t) is None
    _remember(cache, t)
    hit = cache.get(t)
    assert hit is not None and hit.address == t.data_ptr() and hit.numel == 16 and hit.floating
    assert hit.spec[1] == 16  # element count on the wire
    assert cache.get(torch.zeros(4, 4)) is None  # another tensor, even of the same shape
    t.t_()
    assert cache.get(t) is None  # same memory, no longer contiguous
    t.t_()
    t.resize_(8)
    assert cache.get(t) is None  # fewer elements
    t.set_(torch.zeros(16))
    assert cache.get(t) is None  # other memory


def test_staged_and_empty_tensors_are_not_remembered():
    cache = ViewCache()
    _remember(cache, torch.zeros(3, 4).t())  # non-contiguous: staged through a copy
    _remember(cache, torch.zeros(4, dtype=torch.bfloat16))  # reduced in float32: staged
    _remember(cache, torch.zeros(0))
    assert len(cache) == 0
    assert len(ViewCache(capacity=0)) == 0
    off = ViewCache(capacity=0)
    _remember(off, torch.zeros(2))
    assert len(off) == 0


def test_oldest_forgotten_beyond_capacity_and_dead_tensors_dropped():
    cache = ViewCache(capacity=2)
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    for t in (a, b, c):
        _remember(cache, t)
    assert len(cache) == 2 and cache.get(a) is None and cache.get(c) is not None
    alive = weakref.ref(c)
    del c, t  # the loop variable held it too
    gc.collect()
    assert alive() is None  # the cache kept neither the tensor nor a view of it
    assert len(cache) == 1
