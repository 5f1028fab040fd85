"""Megatron-Core's indexed dataset on disk: ``<prefix>.bin`` + ``<prefix>.idx``.

Shards in this format are what Megatron-LM's ``tools/preprocess_data.py``
and NeMo write, so data tokenised for them trains here unchanged, and what
``hpctrain-prepare`` writes, so ours trains there. The layout below is the
one Megatron-Core's ``megatron/core/datasets/indexed_dataset.py`` reads and
writes (``_IndexWriter`` / ``_IndexReader``); this module is an independent
implementation of it (tests check both directions against an independent
``struct`` reader/writer, and against megatron-core itself when installed).

``<prefix>.idx``, little-endian::

    offset      size         field
    0           9 bytes      magic  b"MMIDIDX\\x00\\x00"
    9           uint64       version, 1
    17          uint8        dtype code of the .bin's tokens (DTYPE_CODES):
                             1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                             6 float64, 7 float32, 8 uint16
    18          uint64       S, the number of sequences
    26          uint64       D, the number of entries of the document index
    34          S x int32    tokens in each sequence
    34 + 4S     S x int64    byte offset of each sequence in the .bin
    34 + 12S    D x int64    document index: document d is the sequences
                             [index[d], index[d + 1]); index[0] = 0,
                             index[-1] = S, so there are D - 1 documents
    34+12S+8D   S x int8     (multimodal files only: a mode per sequence;
                             read past and ignored here)

``<prefix>.bin``: the sequences' tokens back to back in that dtype. Its size
is the sum of the lengths times the item size (checked with
``tokenfile.size_problem``, the same check today's flat files get).

**Sequences and documents.** ``hpctrain-prepare`` writes one sequence per
document (BOS/EOS included in it). Megatron's ``--split-sentences`` writes
a sequence per sentence and groups them into documents with the document
index; this reader exposes *documents* (a document's sequences are
contiguous in the .bin), which is what document masking needs.

**A loss mask** (chat data, ``hpctrain-prepare --format chat``):
``<prefix>.mask`` beside the pair, one uint8 per token of the .bin in the
same order (1: the loss counts the token as a target), so the .idx's
document index reads it as it reads the tokens (document ``d``'s mask is
bytes ``[offset, offset + length)`` of its token offset and length). The
shard's description says so (``"loss_mask"``); Megatron's readers ignore
the file. Written by ``IndexedWriter(..., loss_mask=True)`` with the pair
(renamed into place before the .idx), read by ``IndexedDataset.loss_mask``.

**Token dtype** (``token_dtype``): Megatron's rule (``DType.optimal_dtype``),
uint16 when the vocabulary has fewer than 65,500 entries, else int32 (the
format has no uint32 code). The reader takes any integer code.

**Reading safely.** The ``.idx`` is read whole into memory with ordinary
reads (it is metadata: 12 bytes per sequence and 8 per document); the
``.bin`` is read window by window with positioned reads through
``tokenfile.TokenFile``, never through a memory map: a map turns a read past
the end of a file truncated after it was mapped into SIGBUS, with no word of
why; ``TokenFile`` raises ``ShortRead`` instead, which the trainer turns
into one agreed error (``hpctrain.data.tokenfile``). Megatron maps both
files; that is the one deliberate difference.

**API** (what the loader builds on):

- ``read_index(idx_path) -> Documents(dtype, num_tokens, offsets, lengths)``:
  the document table of one shard (offsets: each document's first token in
  the .bin; int64 arrays); ``IndexFormatError`` (a ValueError, its message a
  short reason without the path) when the file is not a well-formed index;
  OSError when it cannot be read.
- ``read_raw_index(idx_path) -> RawIndex``: the same file's arrays as stored
  (sequence lengths and pointers, document index, dtype).
- ``check_shard(prefix, label) -> Optional[str]``: one line (naming the file
  and the fix) when the pair is missing, the index malformed, or the .bin's
  size disagrees with the index; None when it is good. No exception.
- ``IndexedDataset(prefix)``: an opened shard: ``num_documents``,
  ``num_tokens``, ``dtype``, ``document_lengths``, ``document_offsets``
  (``num_documents + 1`` entries, the last = ``num_tokens``),
  ``document(d)``, and ``tokens``: a flat view of every token (``len()`` and
  contiguous slices across document boundaries, a ``TokenFile``), so
  ``cursor.SampleOrder`` reads it like any other token source. Raises
  ``ConfigError`` (one line) for what ``check_shard`` reports.
- ``IndexedWriter(prefix, dtype)``: ``add_document(tokens)`` /
  ``add_documents(flat, lengths)`` (``open_ended`` for a document written in
  pieces), then ``finish()`` (the .idx written, both files renamed into
  place; or ``close()`` then ``commit()``, for a caller that agrees with
  others in between) or ``abort()`` (the partial files removed); a context
  manager that aborts on an exception.
- ``prefix_of(path)``, ``bin_path(prefix)``, ``idx_path(prefix)``,
  ``token_dtype(vocab_size)``, ``DTYPE_CODES``, ``code_of(dtype)``,
  ``read_description(prefix)`` (the ``<prefix>.json`` hpctrain-prepare writes
  beside a shard: vocab_size, bos_id, eos_id, tokenizer; None without one).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, NamedTuple, Optional, Sequence, Union

import numpy as np

from hpctrain.data.tokenfile import TokenFile, size_problem
from hpctrain.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document index entries
HEADER_BYTES = HEADER.size  # 34

DTYPE_CODES: Dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
"""Megatron-Core's dtype codes (its ``DType`` enum)."""

UINT16_LIMIT = 65500
"""Vocabularies smaller than this are stored as uint16 (Megatron's ``optimal_dtype`` threshold)."""


def code_of(dtype) -> int:
    """The dtype code Megatron writes for ``dtype``; ValueError for one it has none for (uint32)."""
    dtype = np.dtype(dtype)
    for code, d in DTYPE_CODES.items():
        if d == dtype:
            return code
    raise ValueError(f"{dtype.name} has no dtype code in Megatron's indexed format; use "
                     f"{', '.join(d.name for d in DTYPE_CODES.values() if d.kind in 'iu')}")


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 below 65,500 token ids, int32 above."""
    return np.dtype(np.uint16 if vocab_size < UINT16_LIMIT else np.int32)


def prefix_of(path: str) -> str:
    """``x.bin``, ``x.idx`` or ``x`` -> ``x``."""
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def description_path(prefix: str) -> str:
    return prefix + ".json"


MASK_SUFFIX = ".mask"
MASK_DTYPE = np.dtype(np.uint8)


def mask_path(prefix: str) -> str:
    """The loss mask beside a shard (chat and instruction data): one uint8 per token of the .bin, in its order."""
    return prefix + MASK_SUFFIX


def described_mask(description: Optional[dict]) -> bool:
    """Whether a shard's description says a loss mask lies beside it."""
    return bool((description or {}).get("loss_mask"))


class IndexFormatError(ValueError):
    """An ``.idx`` that is not a well-formed Megatron index. The message is the
    reason alone (callers add the file and the fix)."""


class RawIndex(NamedTuple):
    """An ``.idx`` as stored."""

    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32, S
    sequence_pointers: np.ndarray  # int64, S (bytes)
    document_index: np.ndarray  # int64, D (= documents + 1)


class Documents(NamedTuple):
    """One shard's documents: where each starts in the .bin (tokens) and how long it is."""

    dtype: np.dtype
    num_tokens: int
    offsets: np.ndarray  # int64, one per document
    lengths: np.ndarray  # int64, one per document


def _read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_raw_index(path: str) -> RawIndex:
    """The arrays of the index at ``path``; ``IndexFormatError`` if its header or
    sizes are not those of a Megatron index, OSError if it cannot be read."""
    data = _read_all(path)
    if len(data) < HEADER_BYTES:
        raise IndexFormatError(f"{len(data)} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, code, seqs, entries = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise IndexFormatError(f"it starts with {magic!r}, not Megatron's magic {MAGIC!r}")
    if version != VERSION:
        raise IndexFormatError(f"version {version}; this reader knows version {VERSION}")
    if code not in DTYPE_CODES:
        raise IndexFormatError(f"dtype code {code} is not one of Megatron's ({', '.join(map(str, DTYPE_CODES))})")
    dtype = DTYPE_CODES[code]
    if dtype.kind not in "iu":
        raise IndexFormatError(f"dtype code {code} means {dtype.name}: token ids must be integers")
    need = HEADER_BYTES + 12 * seqs + 8 * entries
    if len(data) not in (need, need + seqs):  # + seqs: a multimodal file's modes
        raise IndexFormatError(f"{len(data)} bytes, but its header ({seqs} sequences, {entries} document index "
                               f"entries) needs {need}: a truncated or damaged copy")
    lengths = np.frombuffer(data, np.int32, seqs, HEADER_BYTES)
    pointers = np.frombuffer(data, np.int64, seqs, HEADER_BYTES + 4 * seqs)
    doc_index = np.frombuffer(data, np.int64, entries, HEADER_BYTES + 12 * seqs)
    if entries < 1 or doc_index[0] != 0 or doc_index[-1] != seqs or np.any(np.diff(doc_index) < 0):
        raise IndexFormatError(f"its document index does not run from 0 to its {seqs} sequences in order")
    if seqs and lengths.min() < 0:
        raise IndexFormatError("a sequence has a negative length")
    return RawIndex(dtype, lengths, pointers, doc_index)


def read_index(path: str) -> Documents:
    """One shard's document table from its ``.idx`` (see the module docstring).

    The sequences must lie back to back in the .bin in index order (every
    writer does so: Megatron's builder, its merge tool, ours), so a document
    is one contiguous run of tokens; an index whose pointers say otherwise
    is refused."""
    raw = read_raw_index(path)
    item = raw.dtype.itemsize
    ends = np.cumsum(raw.sequence_lengths, dtype=np.int64)
    starts = ends - raw.sequence_lengths
    if not np.array_equal(raw.sequence_pointers, starts * item):
        bad = int(np.flatnonzero(raw.sequence_pointers != starts * item)[0])
        raise IndexFormatError(f"sequence {bad} starts at byte {int(raw.sequence_pointers[bad])}, not at "
                               f"{int(starts[bad]) * item} right after the sequences before it")
    total = int(ends[-1]) if len(ends) else 0
    bounds = np.append(starts, total)[raw.document_index]  # first token of each document, then the end
    return Documents(raw.dtype, total, bounds[:-1].astype(np.int64), np.diff(bounds).astype(np.int64))


def read_description(prefix: str) -> Optional[dict]:
    """The ``<prefix>.json`` hpctrain-prepare writes beside a shard (dtype,
    vocab_size, num_tokens, num_documents, bos_id, eos_id, tokenizer), or
    None without one. ValueError if it is not a JSON object."""
    return read_json_object(description_path(prefix))


def read_json_object(path: str) -> Optional[dict]:
    """The JSON object in ``path`` (a shard's description, a token file's
    sidecar), or None when there is no such file; ValueError (the caller
    names the file) if it holds something else."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    return meta


def _rewrite_advice(prefix: str) -> str:
    return f"copy the shard again, or write it again (hpctrain-prepare INPUT... -o {prefix})"


def check_shard(prefix: str, label: Optional[str] = None) -> Optional[str]:
    """One line naming what is wrong with the shard at ``prefix`` and the fix, or None."""
    prefix = prefix_of(prefix)
    label = label or prefix
    for path in (idx_path(prefix), bin_path(prefix)):
        if not os.path.isfile(path):
            return (f"{label}: {path} does not exist; a shard is a .bin/.idx pair (hpctrain-prepare or "
                    f"Megatron's preprocess_data.py writes both)")
    try:
        docs = read_index(idx_path(prefix))
    except IndexFormatError as e:
        return f"{label}: {idx_path(prefix)} is not a Megatron index ({e}); {_rewrite_advice(prefix)}"
    except OSError as e:
        return f"{label}: {idx_path(prefix)} cannot be read ({e.strerror or e})"
    size = os.path.getsize(bin_path(prefix))
    return size_problem(f"{label}: {bin_path(prefix)}", bin_path(prefix), size, docs.dtype, docs.num_tokens,
                        f"its index {os.path.basename(idx_path(prefix))}")


class IndexedDataset:
    """An opened shard: its documents and a flat view of its tokens (see the module docstring)."""

    def __init__(self, path: str, label: Optional[str] = None):
        self.prefix = prefix_of(path)
        self.label = label or self.prefix
        problem = check_shard(self.prefix, self.label)
        if problem:
            raise ConfigError(problem)
        docs = read_index(idx_path(self.prefix))
        self.dtype: np.dtype = docs.dtype
        self.num_tokens: int = docs.num_tokens
        self.document_lengths: np.ndarray = docs.lengths
        self.document_offsets: np.ndarray = np.append(docs.offsets, docs.num_tokens).astype(np.int64)
        self.tokens = TokenFile(bin_path(self.prefix), self.dtype, self.num_tokens, label=self.label)
        """Every token, in order: ``len()`` and ``[a:b]`` across documents (positioned reads)."""
        self.loss_mask: Optional[TokenFile] = None
        """The loss mask (chat data: one uint8 per token, read like ``tokens``), or None without one."""
        if os.path.isfile(mask_path(self.prefix)):
            self.loss_mask = TokenFile(mask_path(self.prefix), MASK_DTYPE, self.num_tokens, label=self.label)

    @property
    def num_documents(self) -> int:
        return len(self.document_lengths)

    def document(self, d: int) -> np.ndarray:
        """Document ``d``'s tokens (BOS/EOS included where the writer put them)."""
        d = range(self.num_documents)[d]
        start = int(self.document_offsets[d])
        tokens = self.tokens[start:start + int(self.document_lengths[d])]
        assert isinstance(tokens, np.ndarray)  # a slice of a TokenFile reads an array
        return tokens

    def document_loss_mask(self, d: int) -> np.ndarray:
        """Document ``d``'s loss mask (1: trained on as a target); the shard must have one."""
        if self.loss_mask is None:
            raise ValueError(f"{self.label} has no loss mask ({mask_path(self.prefix)})")
        d = range(self.num_documents)[d]
        start = int(self.document_offsets[d])
        mask = self.loss_mask[start:start + int(self.document_lengths[d])]
        assert isinstance(mask, np.ndarray)  # (as in document)
        return mask

    def close(self) -> None:
        self.tokens.close()
        if self.loss_mask is not None:
            self.loss_mask.close()

    def __enter__(self) -> "IndexedDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class IndexedWriter:
    """Writes one shard: tokens streamed to ``<prefix>.bin.tmp`` as they come,
    the lengths kept (4 bytes per document), the ``.idx`` written by
    ``finish`` and both renamed into place then, so a shard that exists is
    whole. One sequence per document. ``loss_mask``: a loss mask is written
    beside (``<prefix>.mask``, one uint8 per token), given with every
    ``add_documents``."""

    def __init__(self, prefix: str, dtype, loss_mask: bool = False):
        self.prefix = prefix_of(prefix)
        self.dtype = np.dtype(dtype)
        code_of(self.dtype)  # refuse a dtype the format cannot name, before writing anything
        self._bin_tmp, self._idx_tmp = bin_path(self.prefix) + ".tmp", idx_path(self.prefix) + ".tmp"
        self._mask_tmp = mask_path(self.prefix) + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._mask = open(self._mask_tmp, "wb") if loss_mask else None
        self._lengths: List[np.ndarray] = []
        self._open = 0  # tokens of a document written in pieces so far
        self.num_tokens = 0
        self.num_documents = 0

    def add_document(self, tokens: Union[Sequence[int], np.ndarray],
                     mask: Optional[Union[Sequence[int], np.ndarray]] = None) -> None:
        arr = np.asarray(tokens)
        self.add_documents(arr, np.array([arr.size]), mask=None if mask is None else np.asarray(mask))

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray, open_ended: Optional[np.ndarray] = None,
                      mask: Optional[np.ndarray] = None) -> None:
        """Documents back to back in ``flat`` with their ``lengths`` (and
        their loss ``mask``, one 0/1 per token, when the writer has one).
        Where ``open_ended`` is true, that piece's document continues in the
        next piece (this call's or the next call's): their lengths add up to
        one document."""
        flat = np.asarray(flat)
        if flat.dtype != self.dtype:
            flat = flat.astype(self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())}, the tokens are {flat.size}")
        if (mask is None) != (self._mask is None):
            raise ValueError("a writer with a loss mask needs one with every document, and one without takes none")
        if mask is not None:
            mask = np.asarray(mask)
            if mask.size != flat.size:
                raise ValueError(f"the loss mask has {mask.size} entries, the tokens are {flat.size}")
            (mask != 0).astype(MASK_DTYPE).tofile(self._mask)
        flat.tofile(self._bin)
        self.num_tokens += flat.size
        if open_ended is not None and np.any(open_ended):
            merged = []
            for n, more in zip(lengths.tolist(), np.asarray(open_ended, dtype=bool).tolist()):
                self._open += n
                if not more:
                    merged.append(self._open)
                    self._open = 0
            lengths = np.array(merged, dtype=np.int64)
        elif self._open and len(lengths):
            lengths = lengths.copy()
            lengths[0] += self._open
            self._open = 0
        if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document of more than 2**31 - 1 tokens does not fit Megatron's int32 lengths")
        self._lengths.append(lengths.astype(np.int32))
        self.num_documents += len(lengths)

    def close(self) -> None:
        """Write the .idx; both files stay under their ``.tmp`` names (``commit`` moves them)."""
        if self._open:
            raise ValueError("the last document was left open (open_ended on its last piece)")
        self._bin.close()
        if self._mask is not None:
            self._mask.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        write_index(self._idx_tmp, self.dtype, lengths, np.arange(len(lengths) + 1, dtype=np.int64))

    def commit(self) -> None:
        """Move the closed shard into place (the .bin and the mask first: a reader looks for the .idx)."""
        os.replace(self._bin_tmp, bin_path(self.prefix))
        if self._mask is not None:
            os.replace(self._mask_tmp, mask_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def finish(self) -> None:
        """``close`` and ``commit``."""
        self.close()
        self.commit()

    def abort(self) -> None:
        """Remove what was written."""
        self._bin.close()
        if self._mask is not None:
            self._mask.close()
        for path in (self._bin_tmp, self._idx_tmp, self._mask_tmp):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def write_index(path: str, dtype, sequence_lengths: np.ndarray, document_index: np.ndarray) -> None:
    """An ``.idx`` for sequences of ``sequence_lengths`` tokens stored back to back."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    doc_index = np.asarray(document_index, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, code_of(dtype), len(lengths), len(doc_index)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_index.astype("<i8").tobytes())
