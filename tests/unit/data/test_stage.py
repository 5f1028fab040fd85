"""Data staging's pure parts, one process (hpctrain.data.stage): which shards a
node's ranks read (against what real data cursors open), and one node's copy:
checksummed, reused, a damaged copy or a changed source copied again, and the
fallbacks (missing, not a directory, too small). The 4-rank, 2-node run is
tests/mpi/test_data_stage.py."""
from __future__ import annotations

import hashlib
import json
import os
from collections import namedtuple
from pathlib import Path
from typing import List, Set

import numpy as np
import pytest

from hpctrain.data import stage
from hpctrain.data.cursor import DataCursor
from hpctrain.data.indexed import IndexedWriter
from hpctrain.data.orders import sample_orders
from hpctrain.data.streams import DocumentStream


def _shards(where: Path, count: int, seed: int, length: int = 40) -> None:
    rng = np.random.default_rng(seed)
    for i in range(count):
        with IndexedWriter(str(where / f"part_{i:02d}"), np.uint16) as w:
            w.add_document(rng.integers(0, 250, length))
            w.add_document(rng.integers(0, 250, int(rng.integers(5, 30))))


def _opened_by(monkeypatch, orders, gbs: int, sample_size: int, ranks: Set[int], steps: int) -> List[Set[int]]:
    """The shards real cursors at ``ranks`` open in ``steps`` steps, per training source."""
    opened: List[tuple] = []
    real = DocumentStream._file

    def spy(self, shard):
        opened.append((id(self), shard))
        return real(self, shard)

    monkeypatch.setattr(DocumentStream, "_file", spy)
    for r in ranks:
        cursor = DataCursor(orders.train, gbs, 1, r, sample_size, weights=orders.weights)
        for _ in range(steps):
            cursor.next_step()
        for o in orders.train:
            o.source.tokens.close()  # the next cursor opens its shards again
    monkeypatch.setattr(DocumentStream, "_file", real)
    ids = [id(o.source.tokens) for o in orders.train]
    return [{s for i, s in opened if i == k} for k in ids]


@pytest.mark.parametrize("blend", [False, True])
def test_the_shards_a_node_needs_are_those_its_ranks_cursors_open(make_config, tmp_path, monkeypatch, blend):
    _shards(tmp_path / "a", 10, 1)
    _shards(tmp_path / "b", 6, 2)
    data = (["data.blend=[{weight: 0.7, paths: [%s]}, {weight: 0.3, paths: [%s]}]" % (tmp_path / "a", tmp_path / "b")]
            if blend else [f"data.paths=[{tmp_path / 'a'}]"])
    cfg = make_config("data.source=indexed", "data.index_cache=false", "trainer.seq_len=8", "model.vocab_size=256",
                      *data)
    orders = sample_orders(cfg.data, 8, 256)
    gbs, size, steps = 8, 4, 2
    for ranks in ({0, 1}, {2, 3}, {3}):
        want = _opened_by(monkeypatch, orders, gbs, size, ranks, steps)
        got = stage.needed_shards(orders.train, orders.weights, orders.valid, steps, gbs, size, ranks)
        assert [set(np.flatnonzero(h)) for h in got] == want
        assert all(len(w) < len(o.source.tokens.shards) for w, o in zip(want, orders.train))  # a strict subset


def test_validation_documents_need_their_shards(make_config, tmp_path):
    _shards(tmp_path, 6, 3)
    cfg = make_config("data.source=indexed", "data.index_cache=false", "trainer.seq_len=8", "model.vocab_size=256",
                      f"data.paths=[{tmp_path}]", "data.split=0.3")
    orders = sample_orders(cfg.data, 8, 256)
    got = stage.needed_shards(orders.train, orders.weights, orders.valid, 1, 4, 4, {0})
    valid = orders.valid[0].source.tokens
    assert set(np.flatnonzero(got[-1])) == set(valid.table.shard.tolist())


def _blake(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def _files(where: Path, sizes=(1000, 30000, 5)) -> List[str]:
    rng = np.random.default_rng(0)
    out = []
    for i, n in enumerate(sizes):
        p = where / f"s{i}.bin"
        p.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        out.append(str(p))
    return out


def test_a_node_copies_checksums_reuses_and_copies_again(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "local").mkdir()
    files = _files(tmp_path / "shared")
    first = stage.stage_node(str(tmp_path / "local"), 1, True, files)
    assert first.fallback is None and (first.copied, first.reused, first.recopied) == (3, 0, 0)
    assert first.copied_bytes == first.bytes == 31005
    root = Path(first.root)
    assert root == tmp_path / "local" / "node_1"
    manifest = json.loads((root / stage.MANIFEST).read_text())["files"]
    for src in files:
        dst = Path(first.paths[src])
        assert dst.read_bytes() == Path(src).read_bytes()
        rec = manifest[str(dst.relative_to(root))]
        assert rec["size"] == os.path.getsize(src) and rec["blake2b"] == _blake(Path(src))

    again = stage.stage_node(str(tmp_path / "local"), 1, True, files)
    assert (again.copied, again.reused, again.recopied, again.copied_bytes) == (0, 3, 0, 0)
    assert again.paths == first.paths

    damaged = Path(first.paths[files[1]])
    data = bytearray(damaged.read_bytes())
    data[7] ^= 0xFF
    damaged.write_bytes(bytes(data))  # same size: only the checksum sees it
    Path(files[2]).write_bytes(b"12345678")  # the source changed
    fixed = stage.stage_node(str(tmp_path / "local"), 1, True, files)
    assert (fixed.copied, fixed.reused, fixed.recopied) == (1, 1, 1)
    assert damaged.read_bytes() == Path(files[1]).read_bytes()
    assert Path(fixed.paths[files[2]]).read_bytes() == b"12345678"


def test_same_names_in_two_directories_stay_apart(tmp_path):
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "part.bin").write_bytes(d.encode() * 10)
    (tmp_path / "local").mkdir()
    out = stage.stage_node(str(tmp_path / "local"), 0, True, [str(tmp_path / "x" / "part.bin"),
                                                               str(tmp_path / "y" / "part.bin")])
    assert len(set(out.paths.values())) == 2 and out.copied == 2


def test_fallbacks_say_why_and_copy_nothing(tmp_path):
    (tmp_path / "shared").mkdir()
    files = _files(tmp_path / "shared")
    missing = stage.stage_node(str(tmp_path / "nope"), 0, True, files)
    assert missing.fallback == f"data.stage.dir={tmp_path / 'nope'} does not exist on this node"
    assert not missing.paths and not (tmp_path / "nope").exists()
    (tmp_path / "file").write_text("x")
    assert stage.stage_node(str(tmp_path / "file"), 0, True, files).fallback.endswith("is not a directory on this node")
    (tmp_path / "local").mkdir()
    (tmp_path / "local2").mkdir()
    Usage = namedtuple("Usage", "total used free")
    room = stage.stage_node(str(tmp_path / "local"), 0, True, files,
                            disk_usage=lambda p: Usage(1 << 30, 0, stage.FREE_MARGIN + 31005))
    assert room.fallback is None and room.copied == 3  # just enough room
    small = stage.stage_node(str(tmp_path / "local2"), 0, True, files,
                             disk_usage=lambda p: Usage(1 << 30, 0, 10 << 20))
    assert small.fallback == (f"data.stage.dir={tmp_path / 'local2'} has 10 MiB free on this node, 64 MiB needed")
    assert not small.paths and not list((tmp_path / "local2").glob("*/*/*.bin"))
    report = stage.StageReport(1.0, 0, 0, [missing, small])
    assert stage.summary(report, "X") == [f"{missing.fallback}: node(s) 0 read the shared paths",
                                          f"{small.fallback}: node(s) 0 read the shared paths"]


def test_the_copier_is_each_nodes_lowest_rank():
    nodes = (0, 0, 1, 1, 2, 2)
    assert [r for r in range(6) if stage.copier(nodes, r)] == [0, 2, 4]
    assert [stage.copier((1, 0, 1, 0), r) for r in range(4)] == [True, True, False, False]
    picked = stage.node_samples(8, 16, 8, 4, {1, 3})  # steps 1 and 2 of a batch of 8 over 4 sample ranks
    assert picked.tolist() == [10, 11, 14, 15, 18, 19, 22, 23]
