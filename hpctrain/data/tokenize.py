"""Tokenizers for ``hpctrain-prepare``: bytes, Hugging Face ``tokenizers``, SentencePiece.

``resolve_tokenizer`` turns the ``--tokenizer`` argument into a
``TokenizerSpec`` (plain data, picklable: what a worker process needs to
load the same tokenizer again, and what the manifest records); ``Encoder``
loads it and turns a batch of documents into one flat array of token ids
plus each document's length, BOS and EOS included.

**What a document becomes**: ``[BOS] + ids(text) + [EOS]``, BOS only where
the tokenizer defines one, EOS always (so a window of the packed stream
shows the model where a document ended, as Megatron's ``--append-eod``
does). ``ids(text)`` is the tokenizer's plain encoding, without the special
tokens its post-processor would add: those are added here, once, by the
rule below, so a tokenizer whose post-processor already adds BOS gets it
once, not twice.

**Where BOS and EOS come from** (``--bos``/``--eos`` override any of it: a
token string, or an id; ``--bos none`` drops BOS):

- ``bytes`` (the default, vocabulary 256, ids = the UTF-8 bytes, as today's
  files): no BOS; EOS is id 0, the NUL byte, which text does not contain,
  so the vocabulary stays 256 and files written before documents existed
  keep their meaning. (A NUL inside an input is kept as is; the shard's
  index, not the EOS id, says where documents end.)
- Hugging Face ``tokenizer.json`` (a file, or a model directory holding
  one): BOS is the token its post-processor puts before a text (Llama 3's
  ``<|begin_of_text|>``, Llama 2's and Mistral's ``<s>``; GPT-2 has none),
  else ``bos_token`` from ``tokenizer_config.json`` beside it when that file
  says ``add_bos_token: true``. EOS is ``eos_token`` from
  ``tokenizer_config.json`` (or ``special_tokens_map.json``) beside it, else
  the token the post-processor puts after a text, else the first of
  ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>`` in the
  vocabulary; else it is an error that asks for ``--eos``. The tokenizer's
  own truncation and padding settings are switched off (a
  ``tokenizer.json`` saved with ``truncation: max_length 512`` would
  otherwise cut every document silently).
- SentencePiece ``.model`` (or a directory holding ``tokenizer.model``):
  ``bos_id()`` and ``eos_id()`` of the model (-1 means it has none; no EOS
  is an error that asks for ``--eos``).

**Long documents** (more than ``LONG_DOCUMENT`` = 262,144 characters, e.g.
a whole book or a web dump read as one text) are encoded in pieces of at
most that many characters, one piece at a time, each piece's ids turned
into a numpy array at once: the ``tokenizers`` library holds about 130 bytes
per character while it encodes (offsets, alignments, token strings) and
Python about 36 bytes per id in a list, so a 50 MB document peaked at 7 GB;
in pieces at 0.23 GB, the input and its ids (measured: ``docs/data.md``,
"Long documents"). A piece ends right before a space that
follows a non-space character (``"word| next"``), the nearest such place
below the limit, and only where the tokenizer itself agrees that the cut
changes nothing: the 256 characters on each side of the cut, encoded
together and apart, give the same ids. The ids are then those of the whole
document for tokenizers whose pre-tokenizer splits there anyway (GPT-2's and
Llama 3's byte-level BPE, Metaspace, SentencePiece with its default
whitespace handling; ``tests/unit/data/test_long_documents.py`` compares
them on a BPE built in the test). A tokenizer that joins text across spaces
(a ``tokenizer.json`` with no pre-tokenizer whose normalizer prepends ``▁``,
as converted SentencePiece models such as Llama 2's are) fails a probe made
once (cuts in a fixed text, encoded together and apart): its long documents
are encoded whole, as before, exact, with one warning naming the size. A
long stretch with no acceptable cut (no space, e.g. a base64 blob) stays in
one piece.

**Token dtype**: Megatron's rule (``indexed.token_dtype``): uint16 below
65,500 ids, else int32.

**Threads**: an ``Encoder`` encodes on one core (the ``tokenizers``
library's thread pool is limited to 1 through ``RAYON_RS_NUM_CPUS`` unless
the user set it, SentencePiece gets ``num_threads=1``), so a rank with
``--workers W`` uses W cores and a job uses ranks x workers, as an HPC
allocation expects; the library's own threads would oversubscribe the node
once per rank.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from itertools import chain, repeat
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from hpctrain.data.indexed import token_dtype

BYTES = "bytes"
HUGGINGFACE = "huggingface"
SENTENCEPIECE = "sentencepiece"

WELL_KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
"""EOS tokens recognised by name in a tokenizer.json without a tokenizer_config.json."""

INSTALL = "pip install 'hpctrain[data]'"


class TokenizerError(Exception):
    """A tokenizer that cannot be used: the message names it and the fix (one line)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer is, in plain data (recorded in the manifest; sent to workers)."""

    kind: str
    """bytes, huggingface or sentencepiece."""
    name: str
    """How to call it: ``bytes``, the model directory's or the file's name."""
    path: Optional[str]
    """The absolute path of the tokenizer.json or .model (None for bytes)."""
    vocab_size: int
    bos_id: Optional[int]
    eos_id: int
    dtype: str
    """Token dtype of the shards (uint16 or int32)."""

    def describe(self) -> dict:
        return asdict(self)


def _limit_threads() -> None:
    os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _import(module: str, why: str):
    try:
        return __import__(module)
    except ImportError:
        raise TokenizerError(f"{why} needs the {module} package, which is not installed; {INSTALL}") from None


def _locate(arg: str) -> Tuple[str, str]:
    """(kind, file) for the --tokenizer argument."""
    if arg == BYTES:
        return BYTES, ""
    path = os.path.abspath(os.path.expanduser(arg))
    if os.path.isdir(path):
        for name, kind in (("tokenizer.json", HUGGINGFACE), ("tokenizer.model", SENTENCEPIECE)):
            if os.path.isfile(os.path.join(path, name)):
                return kind, os.path.join(path, name)
        raise TokenizerError(f"--tokenizer {arg}: the directory holds no tokenizer.json (Hugging Face) or "
                             f"tokenizer.model (SentencePiece); point --tokenizer at the file itself")
    if not os.path.exists(path):
        raise TokenizerError(f"--tokenizer {arg} does not exist; give bytes, a tokenizer.json, a model directory "
                             f"holding one, or a SentencePiece .model (local files only: download it first)")
    if path.endswith(".model"):
        return SENTENCEPIECE, path
    return HUGGINGFACE, path


def tokenizer_vocab_size(arg: str) -> int:
    """How many ids ``--tokenizer arg`` (a tokenizer.json, a .model, a directory holding one) can
    produce, added tokens included; ``TokenizerError`` with one line when it cannot be read."""
    _limit_threads()
    kind, path = _locate(arg)
    if kind == BYTES:
        return 256
    if kind == HUGGINGFACE:
        return int(_load_hf(path, arg).get_vocab_size(with_added_tokens=True))
    return int(_load_sp(path, arg).get_piece_size())


def _config_token(directory: str, key: str) -> Tuple[Optional[str], Optional[dict]]:
    """``key`` (e.g. eos_token) from tokenizer_config.json or special_tokens_map.json, and the config."""
    config = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "tokenizer_config.json":
            config = data
        value = data.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value, config
    return None, config


def _override(value: str, to_id, vocab: int, flag: str, arg: str) -> Optional[int]:
    if value.lower() == "none":
        return None
    if value.lstrip("-").isdigit():
        tid = int(value)
    else:
        tid = to_id(value)
        if tid is None:
            raise TokenizerError(f"{flag} {value}: the tokenizer {arg} has no such token; give one of its tokens "
                                 f"or an id below {vocab}")
    if not 0 <= tid < vocab:
        raise TokenizerError(f"{flag} {value}: id {tid} is outside the vocabulary of {arg} (0..{vocab - 1})")
    return tid


def _load_hf(path: str, arg: str):
    _import("tokenizers", f"--tokenizer {arg}")
    from tokenizers import Tokenizer  # optional: the data extra

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises its own Exception type for every parse error
        raise TokenizerError(f"--tokenizer {arg}: {path} cannot be loaded by the tokenizers library "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); give a tokenizer.json "
                             f"saved by tokenizers/transformers") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def _load_sp(path: str, arg: str):
    spm = _import("sentencepiece", f"--tokenizer {arg}")
    try:
        return spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001 - OSError / RuntimeError from the C++ loader
        raise TokenizerError(f"--tokenizer {arg}: {path} cannot be loaded by sentencepiece "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); give a SentencePiece "
                             f".model file") from None


def _post_processor_ends(tok) -> Tuple[Optional[int], Optional[int]]:
    """The single token the post-processor puts before a text, and after it (None each if not exactly one)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    if not plain or plain == full:
        return None, None
    try:
        at = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
    except StopIteration:
        return None, None
    before, after = full[:at], full[at + len(plain):]
    return (before[0] if len(before) == 1 else None), (after[0] if len(after) == 1 else None)


def resolve_tokenizer(arg: str, bos: Optional[str] = None, eos: Optional[str] = None,
                      dtype: Optional[str] = None) -> TokenizerSpec:
    """The spec for ``--tokenizer arg`` (loading it once to find its vocabulary,
    BOS and EOS); ``TokenizerError`` with one line naming the fix."""
    _limit_threads()
    kind, path = _locate(arg)
    bos_id: Optional[int]
    eos_id: Optional[int]  # None until found (or overridden): an error below
    if kind == BYTES:
        vocab, to_id = 256, (lambda s: ord(s) if len(s) == 1 and ord(s) < 256 else None)
        name, bos_id, eos_id = BYTES, None, 0
    elif kind == HUGGINGFACE:
        tok = _load_hf(path, arg)
        vocab, to_id = tok.get_vocab_size(with_added_tokens=True), tok.token_to_id
        directory = os.path.dirname(path)
        name = os.path.basename(os.path.abspath(arg)) if os.path.isdir(arg) else os.path.basename(path)
        pre, post = _post_processor_ends(tok)
        bos_name, config = _config_token(directory, "bos_token")
        bos_id = pre
        if bos_id is None and bos_name and config and config.get("add_bos_token") is True:
            bos_id = to_id(bos_name)
        eos_name, _ = _config_token(directory, "eos_token")
        eos_id = to_id(eos_name) if eos_name else None
        if eos_id is None:
            eos_id = post
        if eos_id is None:
            eos_id = next((to_id(t) for t in WELL_KNOWN_EOS if to_id(t) is not None), None)
    else:
        sp = _load_sp(path, arg)
        vocab = sp.get_piece_size()
        unk = sp.unk_id()

        def to_id(s: str) -> Optional[int]:
            i = sp.piece_to_id(s)
            return None if i == unk and s != sp.id_to_piece(unk) else i

        name = os.path.basename(os.path.abspath(arg)) if os.path.isdir(arg) else os.path.basename(path)
        bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
    if bos is not None:
        bos_id = _override(bos, to_id, vocab, "--bos", arg)
    if eos is not None:
        eos_id = _override(eos, to_id, vocab, "--eos", arg)
        if eos_id is None:
            raise TokenizerError("--eos none: every document ends with an EOS token; give a token or an id")
    if eos_id is None:
        raise TokenizerError(f"--tokenizer {arg} defines no EOS token (no eos_token in a tokenizer_config.json "
                             f"beside it, none of {', '.join(WELL_KNOWN_EOS)} in its vocabulary); "
                             f"pass --eos TOKEN")
    chosen = token_dtype(vocab)
    if dtype not in (None, "auto"):
        chosen = np.dtype(dtype)
        if chosen == np.uint16 and vocab > 65536:
            raise TokenizerError(f"--dtype uint16 cannot hold the {vocab} ids of {arg}; use --dtype int32 (or auto)")
    return TokenizerSpec(kind, name, path or None, int(vocab), None if bos_id is None else int(bos_id),
                         int(eos_id), chosen.name)


Document = Union[str, bytes]

LONG_DOCUMENT = 1 << 18
"""Characters above which a document is encoded in pieces (see "Long documents" above)."""
_WINDOW = 256
"""Characters on each side of a cut that the tokenizer encodes together and apart to accept it."""
_TRIES = 16
"""Candidate cuts tried below the limit (then above it) before a piece is left longer."""
_PROBE = ("Hello world, this is a probe. Numbers 12345 67 and  two spaces;\nnew line\n\n  indented text "
          "(brackets) \"quotes\" it's we'll don't x-y café naïve 東京 😀 end. " * 3)
"""Text whose every cut of the kind above must change nothing for a tokenizer to be encoded in pieces."""


def _cut_ok(text: str, at: int, ids_of: Callable[[str], List[int]]) -> bool:
    """Whether cutting ``text`` at ``at`` changes no id near the cut, by the tokenizer's own encoding."""
    left, right = text[max(0, at - _WINDOW):at], text[at:at + _WINDOW]
    return list(ids_of(left + right)) == list(ids_of(left)) + list(ids_of(right))


def _candidates(text: str, lo: int, hi: int) -> Iterable[int]:
    """Places in ``(lo, hi]`` right before a space that follows a non-space, nearest ``hi`` first."""
    at = hi + 1
    while True:
        at = text.rfind(" ", lo + 1, at)
        if at <= lo:
            return
        if not text[at - 1].isspace():
            yield at


def _forward_candidates(text: str, start: int) -> Iterable[int]:
    at = start
    while True:
        at = text.find(" ", at + 1)
        if at < 0:
            return
        if not text[at - 1].isspace():
            yield at


def split_long(text: str, ids_of: Callable[[str], List[int]], limit: int = LONG_DOCUMENT) -> List[Tuple[int, int]]:
    """``(start, end)`` of the pieces a long document is encoded in (one piece when it is not long): each
    at most ``limit`` characters where an acceptable cut exists in its second half, else up to the first
    acceptable cut after the limit (a piece with none stays whole)."""
    pieces: List[Tuple[int, int]] = []
    start, n = 0, len(text)
    while n - start > limit:
        cut = None
        for tries, at in enumerate(_candidates(text, start + limit // 2, start + limit)):
            if tries >= _TRIES:
                break
            if _cut_ok(text, at, ids_of):
                cut = at
                break
        if cut is None:
            for tries, at in enumerate(_forward_candidates(text, start + limit)):
                if tries >= _TRIES:
                    break
                if _cut_ok(text, at, ids_of):
                    cut = at
                    break
        if cut is None:
            break
        pieces.append((start, cut))
        start = cut
    pieces.append((start, n))
    return pieces


def splits_safely(ids_of: Callable[[str], List[int]]) -> bool:
    """Whether every cut of ``split_long``'s kind in ``_PROBE`` changes nothing for this tokenizer."""
    return all(_cut_ok(_PROBE, at, ids_of) for at in _candidates(_PROBE, 0, len(_PROBE) - 1))


class Encoder:
    """Encodes batches of documents with the tokenizer of ``spec`` on one core."""

    def __init__(self, spec: TokenizerSpec):
        _limit_threads()
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self._batch: Optional[Callable[[List[str]], List[List[int]]]]  # texts -> their ids; None: bytes
        if spec.kind == HUGGINGFACE:
            assert spec.path is not None  # a tokenizer file's spec names it
            tok = _load_hf(spec.path, spec.path)
            fast = getattr(tok, "encode_batch_fast", None)  # ids without offsets (tokenizers >= 0.20)
            self._batch = (lambda docs: [e.ids for e in fast(docs, add_special_tokens=False)]) if fast else \
                (lambda docs: [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)])
        elif spec.kind == SENTENCEPIECE:
            assert spec.path is not None  # (as above)
            sp = _load_sp(spec.path, spec.path)
            self._batch = lambda docs: sp.encode(list(docs), out_type=int, num_threads=1)
        else:
            self._batch = None
        self._splittable: Optional[bool] = None  # probed at the first long document
        self.warned = False

    def _one(self, text: str) -> List[int]:
        assert self._batch is not None  # a tokenizer's encoder
        return list(self._batch([text])[0])

    def _long(self, text: str) -> np.ndarray:
        """The ids of one long document, encoded in pieces (module docstring, "Long documents")."""
        if self._splittable is None:
            self._splittable = splits_safely(self._one)
        if not self._splittable:
            if not self.warned:
                self.warned = True
                sys.stderr.write(f"hpctrain: warning: a document of {len(text):,} characters is encoded whole (peak "
                                 f"memory about {130 * len(text) / 2**30:.1f} GiB more): this tokenizer joins text "
                                 "across spaces, so cutting it into pieces would change its ids\n")
            return np.asarray(self._one(text), dtype=self.dtype)
        return np.concatenate([np.asarray(self._one(text[a:b]), dtype=self.dtype)
                               for a, b in split_long(text, self._one, LONG_DOCUMENT)])

    def encode(self, docs: Sequence[Document], open_ended: Optional[Sequence[bool]] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """(every document's tokens back to back, each one's length), BOS/EOS added.

        ``open_ended[i]`` true: document ``i`` is a piece that the next one
        continues (bytes only: a large file read in pieces): no EOS after it,
        and no BOS before the piece that follows."""
        if self._batch is None:
            return self._encode_bytes(docs, open_ended)
        texts = [d.decode("utf-8") if isinstance(d, bytes) else d for d in docs]
        if any(len(t) > LONG_DOCUMENT for t in texts):
            return self._with_long(texts)
        ids = self._batch(texts)
        bos, eos = self.spec.bos_id, self.spec.eos_id
        for one in ids:
            one.append(eos)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        pieces: Iterable[Sequence[int]] = ids
        if bos is not None:
            lengths += 1
            pieces = chain.from_iterable(zip(repeat((bos,)), ids))  # (bos,), ids0, (bos,), ids1, ...
        flat = np.fromiter(chain.from_iterable(pieces), dtype=self.dtype, count=int(lengths.sum()))
        return flat, lengths

    def _with_long(self, texts: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        """``encode`` for a batch holding a long document: every document as an array of its own."""
        assert self._batch is not None  # a tokenizer's encoder
        short = iter(self._batch([t for t in texts if len(t) <= LONG_DOCUMENT]))
        bos = np.array([] if self.spec.bos_id is None else [self.spec.bos_id], dtype=self.dtype)
        eos = np.array([self.spec.eos_id], dtype=self.dtype)
        parts: List[np.ndarray] = []
        lengths = np.zeros(len(texts), dtype=np.int64)
        for i, text in enumerate(texts):
            ids = self._long(text) if len(text) > LONG_DOCUMENT else np.asarray(next(short), dtype=self.dtype)
            parts += [bos, ids, eos]
            lengths[i] = len(bos) + len(ids) + 1
        return np.concatenate(parts), lengths

    def _encode_bytes(self, docs: Sequence[Document], open_ended: Optional[Sequence[bool]]
                      ) -> Tuple[np.ndarray, np.ndarray]:
        parts: List[bytes] = [d if isinstance(d, bytes) else d.encode("utf-8") for d in docs]
        closed = [True] * len(parts) if open_ended is None else [not o for o in open_ended]
        eos = bytes([self.spec.eos_id])  # < 256: the vocabulary is the bytes
        flat = np.frombuffer(b"".join(p + eos if c else p for p, c in zip(parts, closed)), np.uint8).astype(self.dtype)
        lengths = np.array([len(p) + c for p, c in zip(parts, closed)], dtype=np.int64)
        return flat, lengths
