"""The data index: every source's documents, built once by rank 0 and
broadcast, so other ranks never list, stat or scan the shards.

``data.paths`` (one source) or ``data.blend`` (several, each with a weight
and its paths) name shards: a prefix (``dir/name``, with or without
``.bin``/``.idx``), a directory (every ``.idx`` in it), a glob, or a
manifest written by ``hpctrain-prepare``. Rank 0 reads each shard's
``.idx`` (document lengths and where they start), checks the ``.bin``
size against it, and makes one document table per source. ``data.split``
holds out that fraction of each source's documents for validation (chosen
by the data seed, whole documents); ``data.validation`` names validation
shards of their own instead.

A shard whose description says it has a loss mask (chat data) must have
its ``.mask`` beside it, of one byte per token; a source's shards all have
one or none (``SourceIndex.masked``: such a source is packed by
conversation, ``cursor.PackedOrder``).

The tables are cached next to the data (``.hpctrain-index-<key>.npz`` in
the first shard's directory; ``data.index_cache=false`` turns it off),
keyed by the shards' paths, sizes and modification times and the split:
a relaunch reads one file instead of every ``.idx``.

Problems (a missing shard, an ``.idx`` that does not describe its ``.bin``,
a source with no document, a vocabulary larger than the model's) are found
by rank 0 during validation and agreed by every rank before any collective
(``hpctrain.run.agree_on_problems``): one line each, naming the file and
the fix.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from omegaconf import OmegaConf

from hpctrain.data.indexed import (
    MASK_DTYPE,
    bin_path,
    check_shard,
    described_mask,
    idx_path,
    mask_path,
    prefix_of,
    read_description,
    read_index,
)
from hpctrain.data.streams import DocumentStream, DocumentTable, Shard
from hpctrain.data.tokenfile import TokenFile, size_problem

CACHE_VERSION = 3


@dataclass
class SourceIndex:
    """One source: its shards and its documents, split into training and validation."""

    name: str
    weight: float
    shards: List[Shard]
    train: DocumentTable
    valid: Optional[DocumentTable] = None

    def train_stream(self) -> DocumentStream:
        return DocumentStream(self.name, self.shards, self.train)

    def valid_stream(self) -> Optional[DocumentStream]:
        return DocumentStream(f"{self.name} (validation)", self.shards, self.valid) \
            if self.valid is not None and len(self.valid) else None

    @property
    def masked(self) -> bool:
        """Chat data: every shard has a loss mask (a source never mixes; ``_source`` refuses that)."""
        return bool(self.shards) and all(s.mask_path for s in self.shards)

    def mask_stream(self, table: DocumentTable) -> DocumentStream:
        """The loss masks of ``table``'s documents (this source's ``train`` or ``valid``), read as its tokens are."""
        return DocumentStream(f"{self.name} (loss mask)", [s.mask() for s in self.shards], table)


@dataclass
class DataIndex:
    sources: List[SourceIndex]
    """Training sources (with their held-out documents when data.split > 0)."""
    validation: List[SourceIndex] = field(default_factory=list)
    """Validation sources of their own (data.validation), else empty."""
    vocab_size: Optional[int] = None
    """The tokenizer's vocabulary, from the shards' manifests (None: not recorded)."""
    eos_id: Optional[int] = None
    largest_ids: Dict[str, int] = field(default_factory=dict)
    """The largest token id in each shard that records no vocabulary (a
    foreign Megatron shard: rank 0 scans its .bin once; kept in the cache)."""
    problems: List[str] = field(default_factory=list)


# -- naming shards ---------------------------------------------------------------

def _strip(path: str) -> str:
    return prefix_of(path)  # the format's rule


def resolve(entries: List[str], key: str) -> Tuple[List[str], List[dict], List[str]]:
    """(shard prefixes, manifests read, problems) for the user's ``entries``."""
    prefixes: List[str] = []
    manifests: List[dict] = []
    problems: List[str] = []
    for entry in entries:
        entry = os.path.expanduser(str(entry))
        if entry.endswith(".json") and os.path.isfile(entry):
            try:
                with open(entry) as f:
                    manifest = json.load(f)
                base = os.path.dirname(os.path.abspath(entry))
                found = [os.path.join(base, _strip(s["prefix"] if isinstance(s, dict) else s))
                         for s in manifest.get("shards", [])]
            except (OSError, ValueError, KeyError, TypeError) as e:
                problems.append(f"{key}: manifest {entry} cannot be read ({e}); write it again with hpctrain-prepare")
                continue
            manifests.append(manifest)
        elif entry.endswith(".json"):  # a manifest that is not there, not a shard named x.json
            problems.append(f"{key}: manifest {entry} does not exist; give the OUT.json hpctrain-prepare wrote, "
                            "the shards' directory, or their prefixes")
            continue
        elif os.path.isdir(entry):
            found = [_strip(p) for p in sorted(glob.glob(os.path.join(entry, "*.idx")))]
        elif any(ch in entry for ch in "*?["):
            found = sorted({_strip(p) for p in glob.glob(entry) if p.endswith((".idx", ".bin"))})
        else:
            found = [_strip(entry)]
        if not found:
            problems.append(f"{key}: {entry} names no shard (no .idx file there); write shards with hpctrain-prepare")
        prefixes += found
    return prefixes, manifests, problems


def _shard(prefix: str, key: str) -> Tuple[Optional[Shard], Optional[DocumentTable], Optional[dict], Optional[str]]:
    """A shard's .bin, its documents (shard column 0) and its description
    (``hpctrain-prepare``'s ``<prefix>.json``: vocabulary, BOS/EOS), or the problem."""
    problem = check_shard(prefix, key)
    if problem:
        return None, None, None, problem
    docs = read_index(idx_path(prefix))
    try:
        described = read_description(prefix)
    except (OSError, ValueError) as e:
        return None, None, None, f"{key}: {prefix}'s description cannot be read ({e}); write the shard again"
    table = DocumentTable(np.zeros(len(docs.lengths), np.int32), docs.offsets, docs.lengths)
    mask = None
    if described_mask(described):
        mask = mask_path(prefix)
        if not os.path.isfile(mask):
            return None, None, None, (f"{key}: {mask} does not exist, but {prefix}.json says the shard has a loss "
                                      f"mask; copy it with the shard (hpctrain-prepare --format chat writes .bin, "
                                      f".idx, .mask and .json)")
        problem = size_problem(f"{key}: {mask}", mask, os.path.getsize(mask), MASK_DTYPE, int(docs.num_tokens),
                               f"its index {os.path.basename(idx_path(prefix))}")
        if problem:
            return None, None, None, problem
    return Shard(bin_path(prefix), docs.dtype.name, int(docs.num_tokens), mask), table, described, None


# -- the tables ------------------------------------------------------------------

def _split(table: DocumentTable, fraction: float, seed: int, salt: int) -> Tuple[DocumentTable, DocumentTable]:
    """Hold out ``fraction`` of the documents (whole documents, chosen by the seed)."""
    n = len(table)
    held = int(round(fraction * n))
    if fraction > 0 and n > 1:
        held = min(max(held, 1), n - 1)
    order = np.random.Generator(np.random.PCG64([seed, 104729, salt])).permutation(n)
    keep = np.zeros(n, dtype=bool)
    keep[order[held:]] = True
    return table.take(np.flatnonzero(keep)), table.take(np.flatnonzero(~keep))


def largest_id(shard: Shard) -> int:
    """The largest token id in ``shard``'s .bin (positioned reads, in chunks)."""
    tokens = TokenFile(shard.bin_path, np.dtype(shard.dtype), shard.num_tokens)
    try:
        return tokens.max()
    finally:
        tokens.close()


def _source(name: str, weight: float, entries: List[str], key: str, split: float, seed: int, salt: int,
            largest: Dict[str, int]) -> Tuple[Optional[SourceIndex], List[dict], List[str]]:
    prefixes, manifests, problems = resolve(entries, key)
    shards: List[Shard] = []
    tables: List[DocumentTable] = []
    for prefix in prefixes:
        shard, table, described, problem = _shard(prefix, key)
        if problem:
            problems.append(problem)
            continue
        assert shard is not None and table is not None  # read when there is no problem
        if described:
            manifests.append(described)
        if not (described or {}).get("vocab_size"):
            largest[shard.bin_path] = largest_id(shard)
        table.shard[:] = len(shards)
        shards.append(shard)
        tables.append(table)
    if problems:
        return None, manifests, problems
    masked = [bool(s.mask_path) for s in shards]
    if any(masked) and not all(masked):
        plain = shards[masked.index(False)].bin_path
        chat = shards[masked.index(True)].bin_path
        return None, manifests, [f"{key}: source {name!r} mixes shards with a loss mask ({chat}) and without "
                                 f"({plain}); put chat and plain shards in separate data.blend sources"]
    table = DocumentTable.concat(tables)
    table = table.take(np.flatnonzero(table.length > 0))
    if not len(table):
        return None, manifests, [f"{key}: source {name!r} has no document with a token ({', '.join(entries)}); "
                                 "check the paths or drop the source from the blend"]
    train, valid = _split(table, split, seed, salt) if split > 0 else (table, None)
    return SourceIndex(name, weight, shards, train, valid), manifests, []


def _entries(data: Any) -> List[Tuple[str, float, List[str], str]]:
    """(name, weight, paths, config key) per training source."""
    if data.blend:
        return [(str(b.name or f"source{i}"), float(b.weight), [str(p) for p in b.paths], f"data.blend[{i}].paths")
                for i, b in enumerate(data.blend)]
    return [("data", 1.0, [str(p) for p in data.paths], "data.paths")]


def build(data: Any) -> DataIndex:
    """Every source's tables and the problems with the files (rank 0; no
    collective); ``vocab_problems`` checks the ids against the model."""
    out = DataIndex([])
    manifests: List[dict] = []
    for salt, (name, weight, entries, key) in enumerate(_entries(data)):
        src, found, problems = _source(name, weight, entries, key, float(data.split), int(data.seed), salt,
                                       out.largest_ids)
        manifests += found
        out.problems += problems
        if src is not None:
            out.sources.append(src)
    if data.validation.paths:
        src, found, problems = _source("validation", 1.0, [str(p) for p in data.validation.paths],
                                       "data.validation.paths", 0.0, int(data.seed), 0, out.largest_ids)
        manifests += found
        out.problems += problems
        if src is not None:
            out.validation.append(src)
    vocabs = {v for m in manifests if (v := m.get("vocab_size")) is not None}
    eos = {e for m in manifests if (e := m.get("eos_id")) is not None}
    if len(vocabs) > 1:
        out.problems.append(f"the shards were written with different tokenizers (vocabularies {sorted(vocabs)}); "
                            "tokenise every source with the same tokenizer")
    out.vocab_size = max(vocabs) if vocabs else None
    out.eos_id = eos.pop() if len(eos) == 1 else None
    return out


def vocab_problems(index: DataIndex, model_vocab: int) -> List[str]:
    """Token ids the model's embedding cannot hold: the recorded vocabulary,
    or for a shard that records none, its largest id."""
    problems = []
    if index.vocab_size is not None and model_vocab and index.vocab_size > model_vocab:
        problems.append(f"the data's tokenizer has {index.vocab_size} tokens but model.vocab_size={model_vocab}; "
                        f"set model.vocab_size={index.vocab_size} (or model.vocab_size=auto)")
    for path, largest in index.largest_ids.items():
        if model_vocab and largest >= model_vocab:
            problems.append(f"{path} holds token id {largest}, at or above model.vocab_size={model_vocab}; set "
                            f"model.vocab_size to the tokenizer's size (at least {largest + 1}) or tokenise the data "
                            "again with the model's tokenizer")
    return problems


# -- cache -----------------------------------------------------------------------

def _key(data: Any) -> Optional[Tuple[str, str]]:
    """(cache file, its key) for this data config, or None when it names nothing resolvable."""
    parts: List[Any] = [CACHE_VERSION, float(data.split), int(data.seed)]
    first = None
    groups = [(n, w, e) for n, w, e, _ in _entries(data)] + [("validation", 1.0, list(data.validation.paths))]
    for name, weight, entries in groups:
        prefixes, _, problems = resolve(entries, "")
        if problems:
            return None
        parts.append((name, weight))
        for p in prefixes:
            first = first or p
            try:
                stats = [(os.path.getsize(p + ext), os.path.getmtime(p + ext)) for ext in (".idx", ".bin")]
            except OSError:
                return None
            parts.append((os.path.abspath(p), stats))
    if first is None:
        return None
    key = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(os.path.abspath(first)), f".hpctrain-index-{key}.npz"), key


def _save(path: str, index: DataIndex) -> None:
    arrays: Dict[str, Any] = {}  # ndarrays (Any: np.savez's stub would have ** fill its bool allow_pickle)
    meta: Dict[str, Any] = {"vocab_size": index.vocab_size, "eos_id": index.eos_id, "largest_ids": index.largest_ids,
            "sources": [], "validation": []}
    for group, sources in (("sources", index.sources), ("validation", index.validation)):
        for i, s in enumerate(sources):
            meta[group].append({"name": s.name, "weight": s.weight, "shards": [vars(x) for x in s.shards],
                                "valid": s.valid is not None})
            for part in ("train", "valid"):
                table = getattr(s, part)
                if table is not None:
                    for column in ("shard", "offset", "length"):
                        arrays[f"{group}{i}_{part}_{column}"] = getattr(table, column)
    tmp = path + f".{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        os.replace(tmp, path)
    except OSError:  # a read-only data directory: no cache, no harm
        try:
            os.remove(tmp)
        except OSError:
            pass


def _load(path: str) -> Optional[DataIndex]:
    try:
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            out = DataIndex([], vocab_size=meta["vocab_size"], eos_id=meta["eos_id"], largest_ids=meta["largest_ids"])
            for group in ("sources", "validation"):
                for i, s in enumerate(meta[group]):
                    tables = {part: DocumentTable(*(z[f"{group}{i}_{part}_{f}"] for f in ("shard", "offset", "length")))
                              for part in ("train", "valid") if part == "train" or s["valid"]}
                    getattr(out, group).append(SourceIndex(s["name"], s["weight"], [Shard(**x) for x in s["shards"]],
                                                           tables["train"], tables.get("valid")))
        return out
    except (OSError, ValueError, KeyError):
        return None


_BUILT: Dict[str, DataIndex] = {}
"""Rank 0's index per data config (built during validation, broadcast by ``shared``)."""


def _config_key(data: Any, model_vocab: int) -> str:
    return json.dumps([OmegaConf.to_container(data, resolve=True) if OmegaConf.is_config(data) else str(data),
                       model_vocab], sort_keys=True, default=str)


def index_on_rank0(data: Any, model_vocab: int) -> DataIndex:
    """Rank 0: the index for ``data`` (from the cache file when it is valid), kept for ``shared``."""
    key = _config_key(data, model_vocab)
    if key in _BUILT:
        return _BUILT[key]
    cached = _key(data) if data.index_cache else None
    index = _load(cached[0]) if cached else None
    if index is None:
        index = build(data)
        if cached and not index.problems:
            _save(cached[0], index)
    index.problems += vocab_problems(index, model_vocab)
    _BUILT[key] = index
    return index


def shared(data: Any, model_vocab: int, comm: Any, is_main: bool) -> DataIndex:
    """Every rank's copy of rank 0's index (one broadcast over ``comm``, an mpi4py communicator)."""
    index = index_on_rank0(data, model_vocab) if is_main else None
    if comm is None or comm.Get_size() == 1:
        assert index is not None  # the only rank is the main one
        return index
    return comm.bcast(index, root=0)
