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
    from tokenizers import Tokenizer

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

    def encode(self, docs: Sequence[Document], open_ended: Optional[Sequence[bool]] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """(every document's tokens back to back, each one's length), BOS/EOS added.

        ``open_ended[i]`` true: document ``i`` is a piece that the next one
        continues (bytes only: a large file read in pieces): no EOS after it,
        and no BOS before the piece that follows."""
        if self._batch is None:
            return self._encode_bytes(docs, open_ended)
        texts = [d.decode("utf-8") if isinstance(d, bytes) else d for d in docs]
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

    def _encode_bytes(self, docs: Sequence[Document], open_ended: Optional[Sequence[bool]]
                      ) -> Tuple[np.ndarray, np.ndarray]:
        parts: List[bytes] = [d if isinstance(d, bytes) else d.encode("utf-8") for d in docs]
        closed = [True] * len(parts) if open_ended is None else [not o for o in open_ended]
        eos = bytes([self.spec.eos_id])  # < 256: the vocabulary is the bytes
        flat = np.frombuffer(b"".join(p + eos if c else p for p, c in zip(parts, closed)), np.uint8).astype(self.dtype)
        lengths = np.array([len(p) + c for p, c in zip(parts, closed)], dtype=np.int64)
        return flat, lengths
