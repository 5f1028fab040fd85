"""Input files for ``hpctrain-prepare``: finding them, and reading their documents.

**Which files.** Each input argument is a file, a directory (every file
under it, recursively, whose name has a known extension, hidden files
skipped, in sorted order) or a glob (``'data/*.jsonl.zst'``, ``**``
allowed; quote it to let hpctrain-prepare expand it, which also avoids the
shell's argument limit with many thousands of files). A named file is read
whatever its extension (plain text unless ``--input-format`` says
otherwise); a directory or glob that finds nothing is an error, as is a
missing file.

**Formats**, from the extension after ``.gz``/``.zst`` is taken off:

- ``.jsonl``, ``.ndjson``, ``.json``: JSON Lines, one object per line, the
  document in ``--text-key`` (default ``text``); blank lines are skipped, a
  line that is not a JSON object or lacks the key is an error naming the
  file and the line.
- ``.parquet``: the ``--text-key`` column (a string column), row by row.
- anything else (``.txt``, ...): plain UTF-8 text, split into documents by
  ``--text-documents``: ``file`` (default: the whole file is one document,
  today's behaviour), ``blank-line`` (documents separated by one or more
  blank lines, the text between them with its inner newlines, without the
  line ending of its last line) or ``line`` (each non-blank line, without
  its line ending).

Each may be compressed: ``.gz`` (gzip) or ``.zst``/``.zstd`` (zstandard,
multi-frame files included). An empty document (``""``, a JSON ``null``, a
Parquet null) is skipped: it carries no text, only BOS/EOS.

**Reading.** ``DocumentReader`` streams a file and yields its documents with
where they came from (line, row or document number, for error messages),
and says how many bytes of the file (compressed bytes for a compressed
file) it has consumed, for the progress line. With the bytes tokenizer the
text is passed on as bytes, undecoded (any byte sequence is valid, as
before), and a ``file``-mode document is read in pieces of ``PIECE_BYTES``
so a file larger than memory still works; the other tokenizers need
``str``, so text is decoded as UTF-8 (an invalid byte is an error naming
the file and where) and a ``file``-mode document is held whole.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple, Union

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
FORMATS = (TEXT, JSONL, PARQUET)
EXTENSIONS = {".txt": TEXT, ".text": TEXT, ".jsonl": JSONL, ".ndjson": JSONL, ".json": JSONL, ".parquet": PARQUET}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TEXT_DOCUMENTS = ("file", "blank-line", "line")
PIECE_BYTES = 16 << 20
INSTALL = "pip install 'hpctrain[data]'"


class InputError(Exception):
    """An input that cannot be read: the message names the file (and line) and the fix, in one line."""


@dataclass(frozen=True)
class InputFile:
    path: str
    size: int
    format: str
    compression: Optional[str]


def _kind(path: str) -> Tuple[Optional[str], Optional[str]]:
    """(format by extension or None, compression or None)."""
    base, ext = os.path.splitext(path)
    compression = COMPRESSIONS.get(ext.lower())
    if compression:
        base, ext = os.path.splitext(base)
    return EXTENSIONS.get(ext.lower()), compression


def _walk(directory: str) -> List[str]:
    found = []
    for root, dirs, files in os.walk(directory, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files) if not f.startswith(".") and _kind(f)[0]]
    return found


def expand_inputs(args: List[str], input_format: str = "auto") -> List[InputFile]:
    """Every input file, in order, without repeats; ``InputError`` for an argument that finds none."""
    paths: List[str] = []
    for arg in args:
        path = os.path.expanduser(arg)
        if os.path.isdir(path):
            found = _walk(path)
            if not found:
                raise InputError(f"input directory {arg} holds no file with a known extension "
                                 f"({', '.join(sorted(EXTENSIONS))}, optionally .gz/.zst); name the files instead")
        elif os.path.isfile(path):
            found = [path]
        elif any(c in path for c in "*?["):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise InputError(f"input pattern {arg} matches no file; check the path (quote the pattern so "
                                 f"the shell leaves it to hpctrain-prepare)")
        else:
            raise InputError(f"input {arg} does not exist; give text, JSON Lines or Parquet files, a directory "
                             f"or a glob")
        paths += found
    out, seen = [], set()
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            continue
        seen.add(key)
        fmt, compression = _kind(path)
        if input_format != "auto":
            fmt = input_format
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise InputError(f"input {path} cannot be read ({e.strerror}); check its permissions") from None
        out.append(InputFile(path, size, fmt or TEXT, compression))
    return out


Document = Union[str, bytes]


class _Counting(io.RawIOBase):
    """A file whose bytes read so far are known (the progress line; compressed files included)."""

    def __init__(self, f):
        self._f = f
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        self.consumed += n or 0
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


class _ZstdReader(io.RawIOBase):
    """A zstd stream, frame after frame, that raises EOFError when the file ends
    inside a frame: zstandard's own ``stream_reader`` returns the part it
    could decode and stops, so a truncated file would pass for a shorter one."""

    def __init__(self, raw, zstandard):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = None
        self._buf, self._pos, self._eof = b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos == len(self._buf) and not self._eof:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._obj is not None and not self._obj.eof:
                    raise EOFError("the zstd stream ends inside a frame (a truncated file)")
                self._eof = True
                break
            out = []
            while chunk:
                if self._obj is None or self._obj.eof:
                    self._obj = self._dctx.decompressobj()
                out.append(self._obj.decompress(chunk))
                chunk = self._obj.unused_data if self._obj.eof else b""
            self._buf, self._pos = b"".join(out), 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n


class DocumentReader:
    """The documents of one input file (see the module docstring)."""

    def __init__(self, inp: InputFile, text_documents: str = "file", text_key: str = "text", as_bytes: bool = False):
        self.inp = inp
        self.text_documents = text_documents
        self.text_key = text_key
        self.as_bytes = as_bytes
        self._raw: Optional[_Counting] = None
        self._parquet_done = 0.0

    @property
    def unit(self) -> str:
        return {JSONL: "line", PARQUET: "row"}.get(self.inp.format, "line")

    def consumed(self) -> int:
        """Bytes of the file read so far."""
        if self.inp.format == PARQUET:
            return int(self._parquet_done * self.inp.size)
        return self._raw.consumed if self._raw is not None else 0

    def _open(self) -> io.BufferedIOBase:
        path = self.inp.path
        try:
            self._raw = _Counting(open(path, "rb", buffering=0))
        except OSError as e:
            raise InputError(f"input {path} cannot be read ({e.strerror}); check its permissions") from None
        raw = io.BufferedReader(self._raw, 1 << 20)
        if self.inp.compression == "gzip":
            return gzip.GzipFile(fileobj=raw, mode="rb")
        if self.inp.compression == "zstd":
            try:
                import zstandard  # optional: the data extra
            except ImportError:
                raise InputError(f"input {path} is zstd-compressed and the zstandard package is not installed; "
                                 f"{INSTALL}") from None
            return io.BufferedReader(_ZstdReader(raw, zstandard), 1 << 20)
        return raw

    def __iter__(self) -> Iterator[Tuple[Document, int, bool]]:
        """(document, where, open_ended) for each document: ``where`` is the
        line (text, JSON Lines) or row (Parquet) it starts at; ``open_ended``
        is true for a piece of a document that the next piece continues."""
        path = self.inp.path
        try:
            if self.inp.format == PARQUET:
                yield from self._parquet()
                return
            with self._open() as stream:
                if self.inp.format == JSONL:
                    yield from self._jsonl(stream)
                elif self.text_documents == "file":
                    yield from self._whole(stream)
                else:
                    yield from self._lines(stream)
        except InputError:
            raise
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(f"input {path} cannot be read: {self._compression_hint(e)}") from None
        except Exception as e:
            if type(e).__module__.startswith("zstandard") or "Zstd" in type(e).__name__:
                raise InputError(f"input {path} cannot be read: {self._compression_hint(e)}") from None
            raise

    def _compression_hint(self, e: BaseException) -> str:
        what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if self.inp.compression:
            return f"{what}; it is named as {self.inp.compression}-compressed: check that it is, and whole"
        return what

    def _decode(self, data: bytes, where: str) -> Document:
        if self.as_bytes:
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"input {self.inp.path}{' ' + where if where else ''} is not UTF-8 text (byte {e.start}: "
                             f"{data[e.start:e.start + 1]!r}); convert it (iconv -t UTF-8) or use --tokenizer bytes"
                             ) from None

    def _whole(self, stream) -> Iterator[Tuple[Document, int, bool]]:
        if not self.as_bytes:
            text = self._decode(stream.read(), "")
            if text:
                yield text, 1, False
            return
        piece = stream.read(PIECE_BYTES)
        while piece:
            following = stream.read(PIECE_BYTES)
            yield piece, 1, bool(following)
            piece = following

    def _lines(self, stream) -> Iterator[Tuple[Document, int, bool]]:
        per_line = self.text_documents == "line"
        block: List[bytes] = []
        start = 0
        for number, line in enumerate(stream, 1):
            if not line.strip():
                if block:
                    yield self._block(block, start), start, False
                    block = []
                continue
            if per_line:
                yield self._block([line], number), number, False
                continue
            if not block:
                start = number
            block.append(line)
        if block:
            yield self._block(block, start), start, False

    def _block(self, lines: List[bytes], start: int) -> Document:
        last = lines[-1]
        end = last[:-1] if last.endswith(b"\n") else last
        if end.endswith(b"\r"):
            end = end[:-1]
        data = b"".join(lines[:-1]) + end
        return self._decode(data, f"line {start}")

    def _jsonl(self, stream) -> Iterator[Tuple[Document, int, bool]]:
        path, key = self.inp.path, self.text_key
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"input {path} line {number} is not JSON ({e}); JSON Lines needs one JSON object "
                                 f"per line") from None
            if not isinstance(obj, dict):
                raise InputError(f"input {path} line {number} is a JSON {type(obj).__name__}, not an object; JSON "
                                 f"Lines needs one object per line, the text under --text-key ({key})")
            if key not in obj:
                keys = ", ".join(map(str, list(obj)[:8])) or "none"
                raise InputError(f"input {path} line {number} has no key {key!r} (its keys: {keys}); pass "
                                 f"--text-key KEY, or fix the line")
            text = obj[key]
            if text is None:
                continue
            if not isinstance(text, str):
                raise InputError(f"input {path} line {number}: {key!r} holds a JSON {type(text).__name__}, not a "
                                 f"string; pass the --text-key of the text")
            if text:
                yield text, number, False

    def _parquet(self) -> Iterator[Tuple[Document, int, bool]]:
        path, key = self.inp.path, self.text_key
        try:
            import pyarrow  # optional: the data extra
            import pyarrow.parquet as pq  # optional: the data extra
        except ImportError:
            raise InputError(f"input {path} is Parquet and the pyarrow package is not installed; {INSTALL}") from None
        try:
            source: Union[str, io.BytesIO]
            if self.inp.compression:
                with self._open() as stream:
                    source = io.BytesIO(stream.read())
            else:
                source = path
            pf = pq.ParquetFile(source)
        except InputError:
            raise
        except (OSError, EOFError, zlib.error, pyarrow.ArrowException) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise InputError(f"input {path} is not a readable Parquet file ({reason}); "
                             f"check that it is whole, or pass --input-format for what it is") from None
        names = pf.schema_arrow.names
        if key not in names:
            raise InputError(f"input {path} has no column {key!r} (its columns: {', '.join(names[:8])}); pass "
                             f"--text-key COLUMN")
        kind = pf.schema_arrow.field(key).type
        if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)
                or getattr(pyarrow.types, "is_string_view", lambda t: False)(kind)):
            raise InputError(f"input {path}: column {key!r} holds {kind}, not strings; pass the --text-key of the "
                             f"text column")
        total = max(1, pf.metadata.num_rows)
        row = 0
        try:
            for batch in pf.iter_batches(batch_size=4096, columns=[key]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if text:
                        yield (text.encode("utf-8") if self.as_bytes else text), row, False
                self._parquet_done = row / total
        except (OSError, pyarrow.ArrowException) as e:
            raise InputError(f"input {path} cannot be read past row {row} ({str(e).splitlines()[0]}); check that "
                             f"it is whole") from None
