import numpy as np
import pytest
import torch

from hpctrain.data import DataCursor, SampleOrder, embedded_source


@pytest.fixture
def order():
    return SampleOrder(embedded_source(20000, seed=1), seq_len=16, seed=5)


def _global_batch(order, dp_size, steps, gbs=8, mbs=2):
    """Concatenate every dp rank's micro-batches, per step, in rank order."""
    cursors = [DataCursor(order, gbs, mbs, r, dp_size) for r in range(dp_size)]
    out = []
    for _ in range(steps):
        out.append(torch.cat([x for c in cursors for x, *_ in c.next_step()]))
    return out


def test_global_batch_is_independent_of_dp_size(order):
    one = _global_batch(order, 1, 3)
    for dp in (2, 4):
        for a, b in zip(one, _global_batch(order, dp, 3)):
            assert torch.equal(a, b)


def test_targets_are_inputs_shifted(order):
    (x, y, *_), *_ = DataCursor(order, 4, 2, 0, 1).next_step()
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_resume_continues_the_same_stream(order):
    straight = DataCursor(order, 8, 4, 0, 1)
    for _ in range(3):
        straight.next_step()
    expected = straight.next_step()
    resumed = DataCursor(order, 8, 2, 1, 2)  # another layout
    resumed.load_state_dict({"consumed_samples": 24})
    assert torch.equal(torch.cat([x for x, *_ in resumed.next_step()]), torch.cat([x for x, *_ in expected])[4:])


def test_epochs_visit_every_window_once(order):
    starts = [order.window_start(i) for i in range(order.num_windows)]
    assert sorted(starts) == [w * 16 for w in range(order.num_windows)]
    nxt = [order.window_start(i) for i in range(order.num_windows, 2 * order.num_windows)]
    assert sorted(nxt) == sorted(starts) and nxt != starts  # reshuffled per epoch


def test_embedded_corpus_is_deterministic_text():
    a, b = embedded_source(4096, 3), embedded_source(4096, 3)
    assert np.array_equal(a.tokens, b.tokens) and len(a) == 4096
    text = bytes(a.tokens).decode("ascii")
    assert " = " in text and "the " in text
    assert not np.array_equal(a.tokens, embedded_source(4096, 4).tokens)


def test_cp_ranks_hold_their_zigzag_chunks_with_true_positions(order):
    from hpctrain.data.sequence import cp_positions

    whole = DataCursor(order, 4, 2, 0, 1).next_step()
    for cp in (2, 4):
        parts = [DataCursor(order, 4, 2, 0, 1, positions=cp_positions(r, cp, 16)).next_step() for r in range(cp)]
        chunk = 16 // (2 * cp)
        for r, mbs in enumerate(parts):
            pos = mbs[0].positions
            assert pos.tolist() == list(range(r * chunk, (r + 1) * chunk)) + \
                list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
            for mb, ref in zip(mbs, whole):
                assert torch.equal(mb.inputs, ref.inputs[:, pos]) and torch.equal(mb.targets, ref.targets[:, pos])
        # every position held exactly once
        assert sorted(p for mbs in parts for p in mbs[0].positions.tolist()) == list(range(16))


def test_samples_split_over_dp_times_ep(order):
    """Expert ranks are data-parallel: 4 sample ranks (dp 2 x ep 2) see 4 disjoint quarters."""
    one = torch.cat([x for x, *_ in DataCursor(order, 8, 2, 0, 1).next_step()])
    four = torch.cat([x for r in range(4) for x, *_ in DataCursor(order, 8, 2, r, 4).next_step()])
    assert torch.equal(one, four)
