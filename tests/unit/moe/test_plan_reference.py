"""The dispatch plan's integer work against a plain-Python reference written from its
contract (plan.c's header, ``_index_plan``'s docstring, ``DispatchPlan``'s fields):
loops over lists, no sort of torch's or numpy's, so a mistake that the C and torch
paths share is caught too. Both paths are held to it: C (``native.library()``) and
torch (``lib=None``)."""
from __future__ import annotations

import pytest
import torch

from hpctrain_moe import dispatch as D
from hpctrain_moe import native

TOKENS = (0, 1, 2, 7, 40)
KEEPS = ("none", "random", "all-false", "all-true")


def _reference(experts, keep, num_experts, lo, hi):
    """The plan of ``experts`` (N lists of k ids), ``keep`` (N lists of k bools, or None)
    straight from the contract: a dict of counts, offsets, kept, order, token, bag_rows."""
    k = len(experts[0]) if experts else 0
    slots, ids, offsets = [], [], [0]
    for t, row in enumerate(experts):  # the kept assignments j in (token, choice) order
        for c, e in enumerate(row):
            if keep is None or keep[t][c]:
                slots.append(t * k + c)
                ids.append(e)
        offsets.append(len(slots))
    counts = [0] * num_experts
    buckets = [[] for _ in range(num_experts)]  # each expert's assignments, j ascending
    for j, e in enumerate(ids):
        counts[e] += 1
        buckets[e].append(j)
    order = [j for bucket in buckets for j in bucket]  # grouped by expert, stable within one
    combine = ([j for j in order if lo <= ids[j] < hi]  # the combine's rows: own experts' first,
               + [j for j in order if not lo <= ids[j] < hi])  # then the others, each in send order
    bag_rows = [0] * len(ids)
    for row, j in enumerate(combine):
        bag_rows[j] = row
    return dict(counts=counts, offsets=offsets, kept=None if keep is None else slots, order=order,
                token=[slots[j] // k for j in order], bag_rows=bag_rows)


def _own_ranges(num_experts):
    """The own-expert slices of every ep rank, ep in {1, 2, 4} where the experts divide."""
    return [(r * (num_experts // ep), (r + 1) * (num_experts // ep))
            for ep in (1, 2, 4) if num_experts % ep == 0 for r in range(ep)]


def _keep(how, n, k, g):
    if how == "none":
        return None
    if how == "random":
        return torch.rand(n, k, generator=g) > 0.4
    return torch.full((n, k), how == "all-true")


def _cases(num_experts, seed):
    """(experts, keep) for every token count, k in 1..4 and keep mask; the ids drawn from
    a few experts half the time, so one expert gets several (stability is visible)."""
    g = torch.Generator().manual_seed(seed)
    for n in TOKENS:
        for k in range(1, 5):
            for how in KEEPS:
                span = num_experts if k % 2 else min(num_experts, 3)
                base = int(torch.randint(0, num_experts - span + 1, (1,), generator=g))
                yield base + torch.randint(0, span, (n, k), generator=g), _keep(how, n, k, g)


@pytest.fixture(params=["c", "torch"])
def lib(request):
    """The C library (which must load: a test that quietly ran torch only would prove less), or None."""
    if request.param == "torch":
        return None
    lib = native.library()
    assert lib is not None, "plan.c did not build or load: the C path would go untested"
    return lib


@pytest.mark.parametrize("num_experts", [1, 2, 8, 300])
def test_index_plan_matches_the_plain_reference(num_experts, lib):
    """Every output of ``_index_plan`` (counts, offsets, kept slots, send order, tokens,
    combine bags) equals the reference for N in {0, 1, 2, 7, 40}, k in 1..4, no / random /
    all-dropped / nothing-dropped keep masks and every ep rank's own-expert slice."""
    for experts, keep in _cases(num_experts, seed=num_experts):
        e_list = experts.tolist()
        keep_list = None if keep is None else keep.tolist()
        for lo, hi in _own_ranges(num_experts):
            want = _reference(e_list, keep_list, num_experts, lo, hi)
            counts = torch.full((num_experts,), -7, dtype=torch.long)  # all overwritten
            order, token, bag_rows, offsets, kept = D._index_plan(experts, keep, num_experts, (lo, hi), counts, lib)
            where = f"n={experts.shape[0]} k={experts.shape[1]} keep={keep_list} own=({lo}, {hi}) ids={e_list}"
            assert counts.tolist() == want["counts"], where
            assert offsets.tolist() == want["offsets"], where
            assert (None if kept is None else kept.tolist()) == want["kept"], where
            assert order.tolist() == want["order"], where
            assert token.tolist() == want["token"], where
            assert bag_rows.tolist() == want["bag_rows"], where


@pytest.mark.parametrize("num_experts", [1, 8, 300])
def test_plan_dispatch_without_a_group_matches_the_plain_reference(num_experts, lib, monkeypatch):
    """``plan_dispatch(group=None)`` end to end: its tokens, kept positions, bags, offsets,
    kept router weights (in (token, choice) order, exactly the router's values) and one
    (expert, rows) segment per expert, all as the reference has them; C on CPU, or torch
    where ``native.library()`` is None."""
    monkeypatch.setattr(native, "library", lambda: lib)
    g = torch.Generator().manual_seed(100 + num_experts)
    for experts, keep in _cases(num_experts, seed=200 + num_experts):
        weights = torch.rand(experts.shape, generator=g)
        keep_list = None if keep is None else keep.tolist()
        want = _reference(experts.tolist(), keep_list, num_experts, 0, num_experts)
        plan = D.plan_dispatch(experts, weights, keep, num_experts, None)
        w = weights.tolist()
        k = experts.shape[1]
        slots = want["kept"] if keep is not None else list(range(experts.numel()))
        where = f"n={experts.shape[0]} k={k} keep={keep_list}"
        assert plan.token.tolist() == want["token"], where
        assert plan.kept_position.tolist() == want["order"], where
        assert plan.bag_rows.tolist() == want["bag_rows"], where
        assert plan.offsets.tolist() == want["offsets"], where
        assert plan.kept_weight.tolist() == [w[s // k][s % k] for s in slots], where
        assert plan.segments == list(enumerate(want["counts"])), where
        assert plan.send_splits == plan.recv_splits == [len(slots)] and not plan.exchange, where


@pytest.mark.parametrize("num_experts", [1, 8, 300])
@pytest.mark.parametrize("bad", [lambda e: -1, lambda e: -2 ** 40, lambda e: e, lambda e: e + 1, lambda e: 2 ** 40],
                         ids=["-1", "-2**40", "E", "E+1", "2**40"])
def test_expert_ids_outside_the_experts_are_refused_by_the_c_plan(num_experts, bad):
    """An id < 0 or >= E among the kept assignments (first, middle or last slot, with or
    without a keep mask) makes the C plan raise ValueError ("outside") instead of writing
    past its counts, and the library still plans correctly afterwards."""
    lib = native.library()
    assert lib is not None, "plan.c did not build or load: the C path would go untested"
    value = bad(num_experts)
    n, k = 6, 3
    for slot in (0, n * k // 2, n * k - 1):
        for keep in (None, torch.ones(n, k, dtype=torch.bool)):
            experts = torch.zeros(n, k, dtype=torch.long)
            experts.view(-1)[slot] = value
            counts = torch.empty(num_experts, dtype=torch.long)
            with pytest.raises(ValueError, match="outside"):
                D._index_plan(experts, keep, num_experts, (0, num_experts), counts, lib)
    experts = torch.arange(n * k).reshape(n, k) % num_experts
    counts = torch.empty(num_experts, dtype=torch.long)
    order, token, bag_rows, offsets, _ = D._index_plan(experts, None, num_experts, (0, num_experts), counts, lib)
    want = _reference(experts.tolist(), None, num_experts, 0, num_experts)
    assert (order.tolist(), token.tolist(), bag_rows.tolist()) == (want["order"], want["token"], want["bag_rows"])
