"""A source's documents as one flat token stream.

A source is many shards (Megatron-format ``.bin``/``.idx`` pairs); its
documents, in the order its shards are named, make one stream of tokens
that the sample order cuts into windows (``cursor.SampleOrder``). The
stream knows where each document starts, so a window can say where its
documents begin (document masking: attention never crosses a boundary,
positions restart).

The table (which shard, where in it, how long: three integer arrays, one
entry per document) is built once by rank 0 (``index``) and broadcast;
every rank reads only the windows it samples, with positioned reads of the
shards' ``.bin`` files (``tokenfile.TokenFile``: a shard that shrinks under
the job is an agreed error, not SIGBUS).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hpctrain.data.indexed import MASK_DTYPE
from hpctrain.data.tokenfile import TokenFile


@dataclass(frozen=True)
class Shard:
    """One ``.bin`` file: where its tokens are and how many (and its loss mask, for chat data)."""

    bin_path: str
    dtype: str
    num_tokens: int
    mask_path: Optional[str] = None
    """The loss mask beside the .bin (``indexed.mask_path``: one uint8 per token), or None."""

    def mask(self) -> "Shard":
        """The loss mask as a shard of its own (uint8, read with the same document table)."""
        assert self.mask_path is not None  # only a masked shard has one
        return Shard(self.mask_path, MASK_DTYPE.name, self.num_tokens)


@dataclass
class DocumentTable:
    """Documents in stream order: shard, first token in that shard, length (tokens)."""

    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def take(self, which: np.ndarray) -> "DocumentTable":
        return DocumentTable(self.shard[which], self.offset[which], self.length[which])

    @staticmethod
    def concat(tables: Sequence["DocumentTable"]) -> "DocumentTable":
        if not tables:
            return DocumentTable(np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return DocumentTable(*(np.concatenate([getattr(t, f) for t in tables]) for f in ("shard", "offset", "length")))


class DocumentStream:
    """The documents of ``table`` back to back: ``stream[a:b]`` reads tokens
    ``[a, b)`` across document (and shard) boundaries; ``document_starts``
    says where documents begin inside a span."""

    def __init__(self, name: str, shards: Sequence[Shard], table: DocumentTable):
        self.name = name
        self.shards = list(shards)
        self.table = table
        self.ends = np.cumsum(table.length, dtype=np.int64)
        """End (exclusive) of each document in the stream."""
        self._files: Dict[int, TokenFile] = {}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _file(self, shard: int) -> TokenFile:
        if shard not in self._files:  # opened on first read: a rank touches only the shards it samples
            s = self.shards[shard]
            self._files[shard] = TokenFile(s.bin_path, np.dtype(s.dtype), s.num_tokens, label=s.bin_path)
        return self._files[shard]

    def _span(self, start: int, stop: int) -> Tuple[int, int]:
        """The documents overlapping ``[start, stop)``: first and last + 1."""
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right")) + 1
        return first, last

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, stride = key.indices(len(self))
        if stride != 1:
            raise IndexError("a document stream is read in contiguous windows")
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        first, last = self._span(start, stop)
        pieces = []
        for d in range(first, last):
            doc_start = int(self.ends[d] - self.table.length[d])
            a, b = max(start, doc_start), min(stop, int(self.ends[d]))
            offset = int(self.table.offset[d]) + (a - doc_start)
            pieces.append(self._file(int(self.table.shard[d])).read(offset, b - a).astype(np.int64))
        return np.concatenate(pieces)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Positions (relative to ``start``) in ``(0, stop - start)`` where a document begins."""
        first, last = self._span(start, stop)
        begins = self.ends[first:last - 1]  # the next documents' starts
        return (begins[(begins > start) & (begins < stop)] - start).astype(np.int64)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def segments_and_positions(length: int, starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """For a window of ``length`` tokens whose documents begin at ``starts``
    (relative, ascending, > 0): each token's document index in the window and
    its position in its document (the window's first document counts from the
    window's start, as Megatron's position reset does)."""
    seg = np.zeros(length, dtype=np.int64)
    if len(starts):
        seg[starts] = 1
        seg = np.cumsum(seg)
    first = np.concatenate([[0], starts]).astype(np.int64)
    pos = np.arange(length, dtype=np.int64) - first[seg]
    return seg, pos


class Packing(NamedTuple):
    """Samples of whole documents (``pack``): sample ``i`` is the stream's tokens ``[start[i], stop[i])``."""

    start: np.ndarray
    stop: np.ndarray
    split: int
    """Documents longer than a sample, cut over several samples."""

    def __len__(self) -> int:
        return len(self.start)


def pack(lengths: np.ndarray, sample_tokens: int) -> Packing:
    """Documents of ``lengths`` (back to back in a stream, in this order) packed into samples of at most
    ``sample_tokens`` tokens (``seq_len + 1``: inputs and the shifted targets): each sample the next
    documents that fit whole, in order (next fit), so it is one contiguous span of the stream and no
    document that fits a sample is cut. A longer document gets samples of its own, ``[k s, k s + s + 1)``
    for ``s = sample_tokens - 1`` (consecutive pieces share one token: a piece's last target is the next
    piece's first input, as the windows of a plain stream do); its last piece may be shorter."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths, dtype=np.int64)
    begins = ends - lengths
    starts, stops = [], []
    split = 0
    step = sample_tokens - 1
    i, n = 0, len(lengths)
    while i < n:
        a = int(begins[i])
        if lengths[i] > sample_tokens:
            pieces = -(-(int(lengths[i]) - 1) // step)
            first = a + step * np.arange(pieces, dtype=np.int64)
            starts.append(first)
            stops.append(np.minimum(first + sample_tokens, ends[i]))
            split += 1
            i += 1
            continue
        j = int(np.searchsorted(ends, a + sample_tokens, side="right")) - 1  # the last document ending in reach
        starts.append(np.array([a], dtype=np.int64))
        stops.append(np.array([ends[j]], dtype=np.int64))
        i = j + 1
    if not starts:
        return Packing(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    return Packing(np.concatenate(starts), np.concatenate(stops), split)


def unknown_documents(name: str) -> str:
    """Why a flat token source (the embedded corpus, a legacy ``.bin``) has no document boundaries."""
    return (f"{name} records no document boundaries; data.document_mask=true needs data shards written by "
            "hpctrain-prepare (Megatron .bin/.idx, with data.paths)")
