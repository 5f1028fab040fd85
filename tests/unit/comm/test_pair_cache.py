"""The mpi backend's PairCache on its own: when a remembered (output, input)
pair's buffers may be used, what is not remembered, and that nothing is kept
alive. (all_gather, reduce_scatter and all_to_all repeat ``get``'s checks
inline; tests/mpi/comm/test_repeat_pairs.py runs them through real
collectives.)"""
from __future__ import annotations

import gc
import weakref
from typing import Optional

import torch
from mpi4py import MPI

from hpctrain_comm_mpi.buffers import PairCache, WireBuffer


def _pass(cache: PairCache, output: torch.Tensor, input: Optional[torch.Tensor], *, reduce: bool = False,
          in_place: bool = False, copy: bool = False) -> None:
    """One call's ``remember``, as the communicator makes it: wire buffers
    for both (None for an MPI_IN_PLACE input)."""
    recv = WireBuffer(output, reduce=reduce, read=False, write=True, cuda_aware=False)
    send = None if in_place else WireBuffer(input, reduce=reduce, read=True, write=False, cuda_aware=False,
                                            copy=copy)
    cache.remember(output, input, recv, send)


def _remember(cache: PairCache, output: torch.Tensor, input: Optional[torch.Tensor], **how) -> None:
    """Pass the pair twice: a pair is remembered the second time."""
    _pass(cache, output, input, **how)
    _pass(cache, output, input, **how)


def test_a_pair_is_remembered_the_second_time_it_is_passed():
    cache = PairCache()
    out, inp = torch.zeros(4), torch.zeros(2)
    _pass(cache, out, inp)
    assert cache.get(out, inp) is None and len(cache) == 0  # only noted
    _pass(cache, torch.zeros(4), torch.zeros(2))  # a fresh pair in between (maybe at recycled ids)
    _pass(cache, out, torch.zeros(2))  # the same output with a fresh input
    assert cache.get(out, inp) is None and len(cache) == 0
    _pass(cache, out, inp)
    assert cache.get(out, inp) is not None and len(cache) == 1
    fresh = [(torch.zeros(4), torch.zeros(2)) for _ in range(3)]
    for o, i in fresh:
        _pass(cache, o, i)
    assert len(cache) == 1
    alive = weakref.ref(fresh[0][0])
    del fresh, o, i
    gc.collect()
    assert alive() is None  # being noted keeps nothing alive either


def test_a_sighting_counts_only_for_the_same_tensors():
    """Fresh tensors often get a dead pair's ids: the note under those ids
    is someone else's, so this is their first sighting."""
    cache = PairCache()
    out, inp, others = torch.zeros(4), torch.zeros(2), (torch.zeros(4), torch.zeros(2))
    cache._sightings[(id(out), id(inp))] = (weakref.ref(others[0]), weakref.ref(others[1]))
    _pass(cache, out, inp)
    assert len(cache) == 0


def test_hit_only_for_the_same_pair_at_the_same_addresses_sizes_and_contiguity():
    cache = PairCache()
    out, inp = torch.zeros(4, 4), torch.zeros(8)
    assert cache.get(out, inp) is None
    _remember(cache, out, inp)
    hit = cache.get(out, inp)
    assert hit is not None and hit.out_address == out.data_ptr() and hit.in_nbytes == 32
    assert cache.get(out, torch.zeros(8)) is None  # another input, even of the same shape
    assert cache.get(torch.zeros(4, 4), inp) is None  # another output
    assert cache.get(inp, out) is None  # the same tensors in other roles
    out.t_()
    assert cache.get(out, inp) is None  # same memory, no longer contiguous
    out.t_()
    assert cache.get(out, inp) is not None
    inp.resize_(4)
    assert cache.get(out, inp) is None  # fewer elements
    inp.resize_(8)
    assert cache.get(out, inp) is not None  # the same memory and size again
    inp.set_(torch.zeros(8))
    assert cache.get(out, inp) is None  # other memory


def test_sizes_or_shapes():
    """Byte sizes by default (all_gather, reduce_scatter depend on element
    counts only), shapes with ``by_shape`` (all_to_all: rows)."""
    by_size, by_shape = PairCache(), PairCache(by_shape=True)
    out, inp = torch.zeros(4, 3), torch.zeros(4, 3)
    _remember(by_size, out, inp)
    _remember(by_shape, out, inp)
    inp.resize_(2, 6)  # same memory, same element count, other rows
    assert by_size.get(out, inp) is not None
    assert by_shape.get(out, inp) is None
    inp.resize_(4, 3)
    assert by_shape.get(out, inp) is not None


def test_specs_cover_the_memory_by_address_and_in_place_is_kept():
    cache = PairCache()
    out, inp = torch.zeros(6, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)
    _remember(cache, out, inp)  # a byte move: bfloat16 travels as int16, not staged
    hit = cache.get(out, inp)
    assert hit is not None
    (recv, recv_type), (send, send_type) = hit.recv, hit.send
    assert recv_type == send_type == MPI.INT16_T
    assert recv.address == out.data_ptr() and len(recv) == 12
    assert send.address == inp.data_ptr() and len(send) == 6
    slot = out[3:]
    _remember(cache, out, slot, in_place=True)
    assert cache.get(out, slot).send is MPI.IN_PLACE
    summed, grads = torch.zeros(2, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    _remember(cache, summed, grads, reduce=True)  # a reduction: the dtype MPI adds
    assert cache.get(summed, grads).recv[1] == MPI.DOUBLE


def test_staged_and_empty_pairs_are_not_remembered():
    cache = PairCache()
    pairs = [  # kept alive: a dead tensor's entry would be dropped anyway
        (torch.zeros(3, 4).t(), torch.zeros(6), {}),  # non-contiguous output: staged
        (torch.zeros(12), torch.zeros(3, 4).t(), {}),  # non-contiguous input: staged
        (torch.zeros(2, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16),
         {"reduce": True}),  # reduced in float32: staged
        (torch.zeros(8), torch.zeros(4), {"copy": True}),  # overlapping: a copy
        (torch.zeros(0), torch.zeros(0), {}),
    ]
    for output, input, how in pairs:
        _remember(cache, output, input, **how)
    assert len(cache) == 0
    off = PairCache(capacity=0)
    output, input = torch.zeros(4), torch.zeros(2)
    _remember(off, output, input)
    assert len(off) == 0
    _remember(cache, output, input)
    assert len(cache) == 1  # the same pair where caching is on


def test_oldest_forgotten_beyond_capacity_and_dead_pairs_dropped():
    cache = PairCache(capacity=2)
    out = torch.zeros(4)
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    for t in (a, b, c):
        _remember(cache, out, t)
    assert len(cache) == 2 and cache.get(out, a) is None and cache.get(out, c) is not None
    alive = weakref.ref(c)
    del c, t  # the loop variable held it too
    gc.collect()
    assert alive() is None  # the cache kept neither the tensor nor a view of it
    assert len(cache) == 1 and cache.get(out, b) is not None
    alive = weakref.ref(out)
    del out  # the other tensor of the pair dies
    gc.collect()
    assert alive() is None and len(cache) == 0
