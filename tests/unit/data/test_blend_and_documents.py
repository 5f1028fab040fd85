"""The data side of issue 29 in one process: the blend rule, document streams
over shard files, segments and positions for document masking, the cursor
over blended sources (resumable from its few integers), the prefetcher."""
import numpy as np
import pytest
import torch

from hpctrain.data.blend import assign, normalised
from hpctrain.data.cursor import DataCursor, SampleOrder
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.sequence import cp_positions
from hpctrain.data.sources import TokenSource
from hpctrain.data.streams import DocumentStream, DocumentTable, Shard, segments_and_positions


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1.0, 1.0, 2.0]])
def test_every_prefix_of_a_blend_is_within_one_sample_of_the_weights(weights):
    w = normalised(weights)
    sources, local, counts = assign(w, [0] * len(w), 2000)
    seen = np.zeros(len(w), dtype=np.int64)
    for n, k in enumerate(sources, start=1):
        assert local[n - 1] == seen[k]  # each source's samples in order
        seen[k] += 1
        assert np.all(np.abs(seen - w * n) <= 1.0), (n, seen, w * n)
    assert counts == seen.tolist()


def test_a_blend_resumed_from_its_counts_continues_the_same_stream():
    w = normalised([0.6, 0.25, 0.15])
    whole, _, _ = assign(w, [0, 0, 0], 300)
    first, _, counts = assign(w, [0, 0, 0], 128)
    rest, _, _ = assign(w, counts, 172)
    assert np.array_equal(whole, np.concatenate([first, rest]))


def _stream(tmp_path, docs_per_shard, name="s"):
    """Shards of documents (tokens = 1000 * doc number + position) and the stream over them."""
    shards, tables, n = [], [], 0
    for i, docs in enumerate(docs_per_shard):
        tokens = [np.arange(length, dtype=np.uint16) + 1000 * (n + j) % 60000 for j, length in enumerate(docs)]
        flat = np.concatenate(tokens)
        path = tmp_path / f"{name}{i}.bin"
        flat.tofile(path)
        shards.append(Shard(str(path), "uint16", len(flat)))
        offsets = np.concatenate([[0], np.cumsum(docs)[:-1]])
        tables.append(DocumentTable(np.full(len(docs), i, np.int32), offsets.astype(np.int64),
                                    np.asarray(docs, np.int64)))
        n += len(docs)
    return DocumentStream(name, shards, DocumentTable.concat(tables)), np.concatenate(
        [np.fromfile(s.bin_path, dtype=np.uint16) for s in shards]).astype(np.int64)


def test_a_document_stream_reads_across_documents_and_shards(tmp_path):
    stream, flat = _stream(tmp_path, [[5, 9, 3], [7, 11]])
    assert len(stream) == len(flat) == 35
    for a, b in [(0, 35), (3, 20), (16, 17), (10, 30), (17, 35)]:
        assert np.array_equal(stream[a:b], flat[a:b])
    assert stream.document_starts(3, 20).tolist() == [2, 11, 14]  # documents at 5, 14, 17 (the shard boundary)
    assert stream.document_starts(5, 14).tolist() == []  # one whole document, nothing starts inside it


def test_segments_and_positions_restart_at_each_document():
    seg, pos = segments_and_positions(8, np.array([3, 5]))
    assert seg.tolist() == [0, 0, 0, 1, 1, 2, 2, 2] and pos.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]


def test_the_cursor_marks_documents_and_cp_keeps_its_tokens_of_them(tmp_path):
    stream, _ = _stream(tmp_path, [[5, 9, 3, 40], [7, 11, 29]])
    order = SampleOrder(TokenSource("s", stream, 65536), seq_len=16, seed=3)
    whole = DataCursor(order, 4, 2, 0, 1, document_mask=True).next_step()
    for mb in whole:
        for row in range(mb.inputs.shape[0]):
            seg, pos = mb.segments[row], mb.positions[row]
            starts = torch.nonzero(pos == 0).flatten().tolist()
            assert starts[0] == 0 and seg[starts].tolist() == list(range(len(starts)))
            # a token is the next of its predecessor exactly inside a document (tokens count up within one)
            inside = (seg[1:] == seg[:-1])
            assert torch.equal(inside, mb.inputs[row, 1:] == mb.inputs[row, :-1] + 1)
    for cp in (2, 4):
        for r in range(cp):
            keep = cp_positions(r, cp, 16)
            part = DataCursor(order, 4, 2, 0, 1, positions=keep, document_mask=True).next_step()
            for mb, ref in zip(part, whole):
                assert torch.equal(mb.inputs, ref.inputs[:, keep]) and torch.equal(mb.segments, ref.segments[:, keep])
                assert torch.equal(mb.positions, ref.positions[:, keep])


def test_a_blended_cursor_resumes_from_its_counts_on_another_layout(tmp_path):
    a, _ = _stream(tmp_path, [[50, 70, 90]], "a")
    b, _ = _stream(tmp_path, [[40, 80]], "b")
    orders = [SampleOrder(TokenSource(n, s, 65536), seq_len=8, seed=i) for i, (n, s) in enumerate([("a", a), ("b", b)])]
    straight = DataCursor(orders, 8, 2, 0, 1, weights=[0.7, 0.3])
    steps = [torch.cat([mb.inputs for mb in straight.next_step()]) for _ in range(5)]
    state = None
    resumed = DataCursor(orders, 8, 2, 0, 1, weights=[0.7, 0.3])
    for _ in range(2):
        resumed.next_step()
    state = resumed.state_dict()
    assert state["source_counts"] == [11, 5]  # 16 samples: 0.7 and 0.3 of them, within one
    halves = [DataCursor(orders, 8, 2, r, 2, weights=[0.7, 0.3]) for r in range(2)]  # another layout
    for c in halves:
        c.load_state_dict(state)
    for want in steps[2:]:
        got = torch.cat([mb.inputs for c in halves for mb in c.next_step()])
        assert torch.equal(got, want)


def test_the_prefetcher_hands_over_the_same_steps_and_notices_a_resume(tmp_path):
    stream, _ = _stream(tmp_path, [[60, 50, 70]])
    order = SampleOrder(TokenSource("s", stream, 65536), seq_len=8, seed=1)
    plain = DataCursor(order, 4, 2, 0, 1)
    want = [[mb.inputs for mb in plain.next_step()] for _ in range(4)]
    cursor = DataCursor(order, 4, 2, 0, 1)
    ahead = Prefetcher(cursor)
    got = [[mb.inputs for mb in ahead.next_step()] for _ in range(2)]
    assert cursor.consumed_samples == 8  # only what was handed over
    cursor.load_state_dict({"consumed_samples": 12})  # a resume: the prepared step is dropped
    got.append([mb.inputs for mb in ahead.next_step()])
    ahead.close()
    for g, w in zip(got, [want[0], want[1], want[3]]):
        assert all(torch.equal(x, y) for x, y in zip(g, w))
