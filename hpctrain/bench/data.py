"""Data pipeline: tokeniser throughput against the tokenizers library, the loader against the step, index start-up.

Run: ``hpctrain-bench data`` (one process; under ``mpiexec`` rank 0
measures and the other ranks wait, so a core is not shared). Sections run
in order, ``--part NAME`` picks one:

- ``tokenizer``: tokens per second on one core of the encoding path
  ``hpctrain-prepare`` runs in each rank or worker (``tokenize.Encoder``:
  the library's batch call, then BOS/EOS and one flat token array of the
  shard's dtype; in prepare's batches of about 1 MiB of text) against the
  library's own ``Tokenizer.encode_batch`` of the same documents (issue
  29's target: >= 0.8x), for a byte-level BPE trained here on the text
  (nothing downloaded), and the same for SentencePiece
  (``SentencePieceProcessor.encode``, one thread) when it is installed. A
  third row per tokenizer is the whole of one rank's pipeline: JSON Lines
  read and parsed, encoded, written as a Megatron shard. Both sides run on
  one core: the ``tokenizers`` thread pool is limited to one thread
  (``RAYON_RS_NUM_CPUS=1``, set before the library is imported), as
  ``hpctrain-prepare`` limits it in each encoding process. Tokens per
  second count the text's tokens (the library's count) for every row, so
  the EOS ``hpctrain-prepare`` adds is work it does for free. Every row's
  ids are checked against the library's (plus the BOS/EOS rule): a row
  that does other work would say "no". Our encoder calls the library's
  ``encode_batch_fast`` (ids without character offsets) where it exists,
  which is where a ratio above 1 comes from; that call has a row of its
  own (``library, ids only``), so the cost of what we add on top of the
  library is read between those two rows.

- ``loader`` and ``index`` (``hpctrain.bench._data_loader``): the real
  trainer with and without ``data.prefetch``, side by side (data_wait_s and
  its share of the step), the loader's own samples/s against what a step
  consumes, and the index start-up for many shards (rank 0 and a broadcast,
  cold and cached, against every rank indexing); run these under
  ``mpiexec -n 2`` (loader) and ``mpiexec -n 8`` (index).

The tokenizer section's text is the built-in corpus (``hpctrain.data.embedded``; ``--text FILE``
takes a local text file instead), cut into documents of ``--doc-lines``
lines. The built-in corpus has few distinct words, so the library's word
cache makes its encoding fast and our per-token overhead weighs the most:
the hard case for the ratio. Timing: ``common.time_interleaved`` (the
contenders in rotating order, round after round; the median per contender).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from hpctrain.bench import _data_loader as loader
from hpctrain.bench.common import Column, Table, machine_summary, parse_size, print_rank0, refuse, time_interleaved
from hpctrain.data.embedded import generate_corpus
from hpctrain.data.indexed import IndexedDataset, IndexedWriter
from hpctrain.data.prepare import BATCH_BYTES, BATCH_DOCS, _Progress, _tokenize, make_plan, parse_args
from hpctrain.data.tokenize import Encoder, resolve_tokenizer
from hpctrain.errors import ArgumentParser


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="hpctrain-bench data", description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=["all", *SECTIONS],
                    help="the section to run (default: all, in order)")
    ap.add_argument("--markdown", action="store_true", help="GitHub markdown tables")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--iters", type=int, default=5, help="timed rounds (median reported)")
    tok = ap.add_argument_group("tokenizer section")
    tok.add_argument("--corpus-bytes", default="4M", help="text to encode (default 4M; K/M/G suffixes)")
    tok.add_argument("--text", help="a local UTF-8 text file to use instead of the built-in corpus")
    tok.add_argument("--doc-lines", type=int, default=48, help="lines per document (default 48, about 1.7 KB)")
    tok.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary to train (capped by the text)")
    loader.add_arguments(ap)
    return ap


# -- tokenizer section ----------------------------------------------------------------------

def _documents(args: argparse.Namespace) -> List[str]:
    size = parse_size(args.corpus_bytes)
    if args.text:
        with open(args.text, "rb") as f:
            text = f.read(size).decode("utf-8", errors="ignore")
    else:
        text = generate_corpus(size, seed=29).decode()
    lines = text.splitlines()
    return ["\n".join(lines[i:i + args.doc_lines]) for i in range(0, len(lines), args.doc_lines)]


def _train_bpe(docs: List[str], vocab: int, path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional: the data extra

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(path)
    return tok


def _train_sentencepiece(docs: List[str], vocab: int, prefix: str):
    import sentencepiece as spm  # optional: the data extra

    spm.SentencePieceTrainer.train(sentence_iterator=iter("\n".join(docs[:2000]).splitlines()), model_prefix=prefix,
                                   vocab_size=min(vocab, 4000), hard_vocab_limit=False, model_type="bpe",
                                   minloglevel=2, num_threads=1)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def _pipeline(docs: List[str], tokenizer_path: str, workdir: str, name: str) -> Callable[[], Any]:
    """One rank of hpctrain-prepare on a JSON Lines file of ``docs``: read, parse, encode, write a shard."""
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    path = os.path.join(workdir, f"{name}.jsonl")
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    out = os.path.join(workdir, f"{name}_shard")
    args = parse_args([path, "-o", out, "--tokenizer", tokenizer_path, "--quiet"])
    plan = make_plan(args, 1)

    def run():
        writer = IndexedWriter(out, plan.spec.dtype)
        _tokenize(args, plan, [0], writer, _Progress(MPI.COMM_SELF, plan.files[0].size, 1, True, 1))
        writer.finish()
        return out

    return run


def _batched(encoder: Any, docs: List[str]) -> Callable[[], np.ndarray]:
    """The encoder as one rank or worker of hpctrain-prepare calls it: in batches
    of about ``prepare.BATCH_BYTES`` of text (``BATCH_DOCS`` at most)."""
    batches, batch, size = [], [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            batches.append(batch)
            batch, size = [], 0
    batches += [batch] if batch else []
    return lambda: np.concatenate([encoder.encode(b)[0] for b in batches])


def _shard_ids(prefix: str) -> np.ndarray:
    with IndexedDataset(prefix) as ds:
        ids = ds.tokens[0:ds.num_tokens]
        assert isinstance(ids, np.ndarray)  # a slice of a TokenFile reads an array
        return ids


def tokenizer_section(args: argparse.Namespace, comm: Any) -> int:
    if comm.Get_rank() != 0:
        return 0
    os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")  # before tokenizers is imported: one core, as prepare's encoders
    try:
        import tokenizers  # noqa: F401 - optional: the data extra
    except ImportError:
        return refuse(None, "hpctrain-bench data: the tokenizer section needs the tokenizers package; "
                            "pip install 'hpctrain[data]'")
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    docs = _documents(args)
    table = Table([Column("tokenizer", align="<"), Column("contender", align="<"), Column("tokens", "{:,}"),
                   Column("median s", "{:.3f}"), Column("M tokens/s/core", "{:.3f}"), Column("vs library", "{:.2f}x"),
                   Column("same ids", align="<")])
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-data-") as work:
        contenders: Dict[str, Dict[str, Any]] = {}
        tok = _train_bpe(docs, args.vocab, os.path.join(work, "tokenizer.json"))
        spec = resolve_tokenizer(os.path.join(work, "tokenizer.json"))
        assert spec.path is not None  # a tokenizer file's spec names it
        encoder = Encoder(spec)
        bpe_want = [ids + [spec.eos_id] for ids in (e.ids for e in tok.encode_batch(docs))]
        contenders[f"BPE ({spec.vocab_size})"] = {
            "library": lambda: tok.encode_batch(docs),
            "library, ids only": (lambda: tok.encode_batch_fast(docs)) if hasattr(tok, "encode_batch_fast") else None,
            "encode": _batched(encoder, docs),
            "pipeline": _pipeline(docs, spec.path, work, "bpe"),
            "want": bpe_want, "extra": 1}
        try:
            sp = _train_sentencepiece(docs, args.vocab, os.path.join(work, "sp"))
        except ImportError:
            sp = None
        if sp is not None:
            sp_spec = resolve_tokenizer(os.path.join(work, "sp.model"))
            assert sp_spec.path is not None  # (as above)
            sp_encoder = Encoder(sp_spec)
            contenders[f"SentencePiece ({sp_spec.vocab_size})"] = {
                "library": lambda: sp.encode(docs, out_type=int, num_threads=1),
                "library, ids only": None,
                "encode": _batched(sp_encoder, docs),
                "pipeline": _pipeline(docs, sp_spec.path, work, "sp"),
                "want": sp.encode(docs, out_type=int, add_bos=True, add_eos=True, num_threads=1), "extra": 2}
        for name, c in contenders.items():
            fast = [c["library, ids only"]] if c["library, ids only"] else []
            fns = [c["library"], c["encode"], c["pipeline"]] + fast
            library, ours, pipeline, *fast = time_interleaved(fns, MPI.COMM_SELF, warmup=args.warmup, iters=args.iters)
            want = np.fromiter((t for ids in c["want"] for t in ids), dtype=np.int64)
            text_tokens = int(want.size) - c["extra"] * len(docs)
            flat = c["encode"]()
            same_encode = np.array_equal(flat.astype(np.int64), want)
            same_pipeline = np.array_equal(_shard_ids(c["pipeline"]()).astype(np.int64), want)
            lib_rate = text_tokens / library.median
            table.add(name, "library batch encode", text_tokens, library.median, lib_rate / 1e6, 1.0, "-")
            if fast:
                table.add(name, "library, ids only (encode_batch_fast)", text_tokens, fast[0].median,
                          text_tokens / fast[0].median / 1e6, library.median / fast[0].median, "-")
            table.add(name, "hpctrain-prepare encode", text_tokens, ours.median, text_tokens / ours.median / 1e6,
                      library.median / ours.median, "yes" if same_encode else "NO")
            table.add(name, "hpctrain-prepare JSONL -> shard", text_tokens, pipeline.median,
                      text_tokens / pipeline.median / 1e6, library.median / pipeline.median,
                      "yes" if same_pipeline else "NO")
    print_rank0(None, f"# hpctrain-bench data: tokenizer ({len(docs):,} documents, {parse_size(args.corpus_bytes):,} "
                      f"bytes of {'text from ' + args.text if args.text else 'the built-in corpus'}; one core: "
                      f"RAYON_RS_NUM_CPUS={os.environ.get('RAYON_RS_NUM_CPUS')})",
                "", table.render(args.markdown), "")
    return 0


SECTIONS: Dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "tokenizer": tokenizer_section, "loader": loader.loader_section, "index": loader.index_section}
"""Sections in the order ``--part all`` runs them: name -> fn(args, comm) -> exit status."""


def main(argv: Optional[List[str]] = None) -> int:
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    args = _parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    print_rank0(comm, f"machine: {machine_summary(comm)}", "")
    status = 0
    for name, section in SECTIONS.items():
        if args.part in ("all", name):
            status = max(status, int(section(args, comm) or 0))
            comm.Barrier()
    return status
