"""Megatron-Core's indexed format (``hpctrain.data.indexed``) against an
independent implementation of the published layout: files written here with
``struct`` (not our writer) are read back document for document by our
reader, and our writer's files are parsed field by field by a ``struct``
reader here; both directions again against megatron-core itself when it is
installed (scripts/setup.sh installs it, ``--no-deps``). Then the flat view
under today's ``SampleOrder``, and every way a shard can be damaged: one
line naming the file and the fix."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from hpctrain.data.indexed import IndexedDataset, IndexedWriter, check_shard, code_of, read_index, token_dtype
from hpctrain.errors import ConfigError

# the published layout, written out by hand: magic, <Q version, <B dtype code, <Q sequences, <Q doc-index entries
MAGIC = b"MMIDIDX\x00\x00"
CODES = {"uint8": (1, "B"), "int16": (3, "h"), "int32": (4, "i"), "int64": (5, "q"), "uint16": (8, "H")}


def struct_write(prefix, documents, dtype="uint16", modes=False):
    """``documents``: a list of documents, each a list of sequences (lists of ids)."""
    code, fmt = CODES[dtype]
    item = struct.calcsize(fmt)
    sequences = [s for d in documents for s in d]
    with open(prefix + ".bin", "wb") as f:
        for s in sequences:
            f.write(struct.pack(f"<{len(s)}{fmt}", *s))
    lengths = [len(s) for s in sequences]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * item
    doc_index = [0]
    for d in documents:
        doc_index.append(doc_index[-1] + len(d))
    n, m = len(sequences), len(doc_index)
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", n) + struct.pack("<Q", m))
        f.write(struct.pack(f"<{n}i", *lengths) + struct.pack(f"<{n}q", *pointers) + struct.pack(f"<{m}q", *doc_index))
        if modes:
            f.write(struct.pack(f"<{n}b", *([0] * n)))


def struct_read(prefix):
    """(dtype name, documents as lists of ids) parsed from the bytes alone."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == MAGIC
    (version,) = struct.unpack_from("<Q", idx, 9)
    (code,) = struct.unpack_from("<B", idx, 17)
    n, m = struct.unpack_from("<QQ", idx, 18)
    assert version == 1 and len(idx) == 34 + 12 * n + 8 * m
    lengths = struct.unpack_from(f"<{n}i", idx, 34)
    pointers = struct.unpack_from(f"<{n}q", idx, 34 + 4 * n)
    doc_index = struct.unpack_from(f"<{m}q", idx, 34 + 12 * n)
    name, fmt = next((k, f) for k, (c, f) in CODES.items() if c == code)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = [list(struct.unpack_from(f"<{n_tok}{fmt}", data, p)) for n_tok, p in zip(lengths, pointers)]
    docs = [sum(seqs[doc_index[d]:doc_index[d + 1]], []) for d in range(m - 1)]
    return name, docs


def _documents(rng, count, vocab, max_len=40):
    return [[int(x) for x in rng.integers(0, vocab, rng.integers(0, max_len))] for _ in range(count)]


@pytest.mark.parametrize("dtype,vocab", [("uint16", 65499), ("int32", 200000), ("uint8", 256), ("int64", 1 << 40)])
def test_files_written_by_hand_are_read_document_for_document(tmp_path, dtype, vocab):
    rng = np.random.default_rng(5)
    docs = _documents(rng, 30, vocab)
    # documents of several sequences (Megatron's --split-sentences), one of none
    split = [[d[: len(d) // 2], d[len(d) // 2:]] if i % 3 == 0 else [d] for i, d in enumerate(docs)]
    split[7] = []
    docs[7] = []
    struct_write(str(tmp_path / "s"), split, dtype)
    assert check_shard(str(tmp_path / "s")) is None
    ds = IndexedDataset(str(tmp_path / "s.idx"))
    assert ds.dtype == np.dtype(dtype) and ds.num_documents == len(docs)
    assert ds.num_tokens == sum(map(len, docs)) == len(ds.tokens)
    assert list(ds.document_lengths) == [len(d) for d in docs]
    assert list(ds.document_offsets) == list(np.cumsum([0] + [len(d) for d in docs]))
    for i, d in enumerate(docs):
        got = ds.document(i)
        assert got.dtype == np.dtype(dtype) and got.tolist() == d, i
    flat = sum(docs, [])
    assert ds.tokens[5:123].tolist() == flat[5:123]  # across document boundaries


def test_a_multimodal_index_reads_past_its_modes(tmp_path):
    docs = [[[1, 2, 3]], [[4], [5, 6]]]
    struct_write(str(tmp_path / "m"), docs, modes=True)
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds.document(i).tolist() for i in range(2)] == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_our_files_parse_field_by_field(tmp_path, dtype):
    rng = np.random.default_rng(6)
    docs = _documents(rng, 25, 60000)
    with IndexedWriter(str(tmp_path / "w"), dtype) as w:
        w.add_document(docs[0])
        flat = np.concatenate([np.array(d, dtype=np.int64) for d in docs[1:]])
        w.add_documents(flat, [len(d) for d in docs[1:]])
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    name, got = struct_read(str(tmp_path / "w"))
    assert name == dtype and got == docs


def test_a_document_in_pieces_is_one_document(tmp_path):
    with IndexedWriter(str(tmp_path / "p"), "uint16") as w:
        w.add_documents(np.array([1, 2, 3, 4, 5]), [2, 3], open_ended=np.array([False, True]))
        w.add_documents(np.array([6, 7, 8]), [1, 2], open_ended=np.array([True, False]))
    assert struct_read(str(tmp_path / "p"))[1] == [[1, 2], [3, 4, 5, 6, 7, 8]]


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(str(tmp_path / "f"), "uint16") as w:
            w.add_document([1, 2])
            raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_the_flat_view_serves_todays_sample_order(tmp_path):
    from hpctrain.data.cursor import SampleOrder
    from hpctrain.data.sources import TokenSource

    rng = np.random.default_rng(7)
    docs = _documents(rng, 50, 256, max_len=30)
    struct_write(str(tmp_path / "o"), [[d] for d in docs])
    ds = IndexedDataset(str(tmp_path / "o"))
    flat = np.array(sum(docs, []), dtype=np.int64)
    order = SampleOrder(TokenSource("o", ds.tokens, 256), seq_len=16, seed=3)
    for i in range(2 * order.num_windows):
        start = order.window_start(i)
        assert np.array_equal(order.sample(i), flat[start:start + 17])


def test_megatron_dtype_rule_and_codes():
    assert token_dtype(256) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32
    assert [code_of(d) for d in ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16")] \
        == list(range(1, 9))
    with pytest.raises(ValueError, match="uint32 has no dtype code"):
        code_of("uint32")


# -- megatron-core itself ------------------------------------------------------------------

def _megatron():
    # scripts/setup.sh installs megatron-core (--no-deps): missing, the test fails rather than skips
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


@pytest.mark.filterwarnings("ignore")
def test_megatron_core_reads_ours_and_we_read_megatron_cores(tmp_path):
    import torch

    mc = _megatron()
    rng = np.random.default_rng(8)
    docs = _documents(rng, 20, 50000)
    with IndexedWriter(str(tmp_path / "ours"), token_dtype(50000)) as w:
        for d in docs:
            w.add_document(d)
    theirs = mc.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs) and list(theirs.document_indices) == list(range(len(docs) + 1))
    assert [theirs[i].tolist() for i in range(len(docs))] == docs

    builder = mc.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.int32)
    for d in docs:
        half = len(d) // 2
        builder.add_document(torch.tensor(d, dtype=torch.int64), [half, len(d) - half])  # two sequences each
    builder.finalize(str(tmp_path / "mc.idx"))
    ds = IndexedDataset(str(tmp_path / "mc"))
    assert ds.dtype == np.int32 and [ds.document(i).tolist() for i in range(ds.num_documents)] == docs


# -- damaged shards ---------------------------------------------------------------------------

def _good(tmp_path):
    struct_write(str(tmp_path / "g"), [[[1, 2, 3]], [[4, 5]], [[6]]])
    return str(tmp_path / "g")


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def idx_truncated(p):
    os.truncate(p + ".idx", 60)
    return ["g.idx is not a Megatron index", "60 bytes, but its header", "needs 102", "truncated",
            "hpctrain-prepare INPUT... -o"]


def idx_shorter_than_header(p):
    os.truncate(p + ".idx", 20)
    return ["shorter than the 34-byte header"]


def bad_magic(p):
    _patch(p + ".idx", 0, b"XXXXXXXXX")
    return ["starts with b'XXXXXXXXX', not Megatron's magic"]


def bad_version(p):
    _patch(p + ".idx", 9, struct.pack("<Q", 2))
    return ["version 2; this reader knows version 1"]


def float_tokens(p):
    _patch(p + ".idx", 17, struct.pack("<B", 7))
    return ["dtype code 7 means float32: token ids must be integers"]


def unknown_code(p):
    _patch(p + ".idx", 17, struct.pack("<B", 12))
    return ["dtype code 12 is not one of Megatron's"]


def document_index_short(p):
    _patch(p + ".idx", 34 + 12 * 3 + 8 * 3, struct.pack("<q", 2))  # the last entry: 2, not 3 sequences
    return ["document index does not run from 0 to its 3 sequences"]


def pointers_not_back_to_back(p):
    _patch(p + ".idx", 34 + 12 + 8, struct.pack("<q", 8))  # sequence 1 at byte 8 instead of 6
    return ["sequence 1 starts at byte 8, not at 6"]


def bin_truncated(p):
    os.truncate(p + ".bin", 8)
    return ["g.bin is truncated: expected 12 bytes (6 uint16 tokens, from its index g.idx)", "found 8 (4 tokens)",
            "copy it again"]


def bin_longer(p):
    with open(p + ".bin", "ab") as f:
        f.write(b"\0\0")
    return ["g.bin is longer than its index g.idx says: expected 12 bytes", "found 14"]


def bin_missing(p):
    os.remove(p + ".bin")
    return ["g.bin does not exist", "a .bin/.idx pair"]


DAMAGE = [idx_truncated, idx_shorter_than_header, bad_magic, bad_version, float_tokens, unknown_code,
          document_index_short, pointers_not_back_to_back, bin_truncated, bin_longer, bin_missing]


@pytest.mark.parametrize("damage", DAMAGE, ids=[f.__name__ for f in DAMAGE])
def test_a_damaged_shard_is_one_line_naming_it(tmp_path, damage):
    prefix = _good(tmp_path)
    assert check_shard(prefix) is None
    fragments = damage(prefix)
    line = check_shard(prefix, label="data.paths")
    assert line and "\n" not in line and line.startswith("data.paths: ") and prefix in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    with pytest.raises(ConfigError) as e:
        IndexedDataset(prefix, label="data.paths")
    assert str(e.value) == line
    if damage not in (bin_truncated, bin_longer, bin_missing):
        with pytest.raises(ValueError):  # what the loader's index builder catches
            read_index(prefix + ".idx")
