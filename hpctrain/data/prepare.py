"""``hpctrain-prepare``: tokenise documents into Megatron-format shards (``.bin`` + ``.idx``) and a manifest.

Usage::

    hpctrain-prepare INPUT... -o OUT [--tokenizer bytes|tokenizer.json|MODEL_DIR|x.model]
                     [--text-key text] [--text-documents file|blank-line|line]
                     [--input-format auto|text|jsonl|parquet] [--workers W]
                     [--bos TOKEN|ID|none] [--eos TOKEN|ID] [--dtype auto|uint16|int32] [--quiet]
                     [--format text|chat|instruction --seq-len N [--train-on assistant|last-assistant|all]
                      [--chat-template FILE] [--messages-key K] [--prompt-key K --response-key K --system-key K]]
    mpirun -n N hpctrain-prepare ...     # N ranks, one shard each

INPUTs are files, directories or globs of plain text, JSON Lines or Parquet,
each optionally .gz/.zst (``hpctrain.data.inputs``). Every document becomes
``[BOS] + ids + [EOS]`` (``hpctrain.data.tokenize`` says where BOS and EOS
come from for each tokenizer; bytes: no BOS, EOS = 0). The old form
``hpctrain-prepare corpus.txt corpus.bin`` still works: the last argument,
ending in ``.bin``, is the output when ``-o`` is not given.

**What is written** (``OUT`` is a path prefix; ``OUT.bin`` etc.):

- one rank: the shard ``OUT.bin`` + ``OUT.idx`` and the manifest ``OUT.json``;
- N ranks: a shard per rank that got input, ``OUT_00000.bin``/``.idx``, ...
  (numbered by rank), each with its description ``OUT_00000.json``, and the
  manifest ``OUT.json`` listing them.

The format is Megatron-Core's indexed dataset (``hpctrain.data.indexed``),
one sequence per document, tokens uint16 below 65,500 ids and int32 above
(Megatron's rule). The manifest is JSON: ``tokenizer`` (kind, name, path),
``vocab_size``, ``bos_id`` (null: none), ``eos_id``, ``dtype``,
``num_tokens``, ``num_documents``, the reading options, and ``shards``: per
shard its ``prefix`` (relative to the manifest's directory), token and
document counts and the input files it holds. A shard's description holds
the same fields for that shard alone. Both carry the fields today's flat
token-file sidecar has (dtype, vocab_size, num_tokens), so a single-shard
uint16 output is also readable as a flat stream by ``data=tokens
data.path=OUT.bin``.

**In parallel.** Rank 0 lists the inputs, loads the tokenizer once (its
vocabulary, BOS and EOS) and splits the files over the ranks, balanced by
size (largest first to the least-loaded rank; a file is never split, so
give at least as many files as ranks), then broadcasts the plan: other
ranks never list or stat the inputs. Each rank reads its files in order
and encodes batches of documents (a document longer than 262,144
characters in pieces cut where the tokenizer agrees nothing changes:
``hpctrain.data.tokenize``, "Long documents") in its own process or, with ``--workers
W``, in W worker processes (spawned, not forked: the rank has MPI
initialised), each on one core; the rank writes its shard as the batches
come back, in input order, so the output does not depend on W. Rank 0
shows the progress of all ranks (each sends its counts to rank 0 about once
a second): on a terminal one line updated in place, otherwise (a batch
job's log, or under mpirun, which hands rank 0 a pipe) a line after 5 s,
10 s, 20 s, ... then every minute; and a summary at the end.

**Errors.** A bad argument, a missing input, a bad tokenizer, a JSON Lines
line without the text key, an unreadable Parquet or compressed file, are
one ``hpctrain: error:`` line naming the file (and line) and the
fix, on rank 0, and exit status 2 on every rank. A rank that fails tells
rank 0, which tells the others to stop (they stop at their next batch, not
at the end of their files); the ranks then agree on the outcome with one
allgather before anything is renamed into place or the manifest written, so
a failed run leaves no shard or manifest of its own (only the files of an
earlier run, untouched) and no rank waits for ever.

**Chat and instruction data** (``--format chat|instruction``,
``hpctrain.data.chat``): JSON Lines of conversations, each rendered by the
tokenizer's chat template (transformers' ``apply_chat_template``) into one
document, with a loss mask written beside the shard (``<prefix>.mask``,
``hpctrain.data.indexed``) and described under ``"loss_mask"``; the
summary counts the trained tokens and the conversations longer than a
sample of ``--seq-len + 1`` tokens (which training will cut; the others
stay whole: ``hpctrain.data.cursor.PackedOrder``). Conversations without an
assistant turn are counted over every rank and refused together (with
``--train-on assistant`` or ``last-assistant``).

``prepare(input, output, dtype)`` is today's flat writer (bytes, no document
boundaries, a ``.json`` sidecar), kept for the files today's
``data=tokens`` loader reads and the tests that damage such files.

About 710 lines: the command's flags, its per-rank work split and the
shard writing; the formats' own logic lives in ``inputs``, ``tokenize`` and
``chat``. The flat writer above is the piece to move out when it grows.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hpctrain.data.chat import (
    ASSISTANT,
    TRAIN_ON,
    ChatEncoder,
    ChatSpec,
    ConversationError,
    ConversationReader,
    conversation_size,
    resolve_chat,
)
from hpctrain.data.chat import FORMATS as CHAT_FORMATS
from hpctrain.data.indexed import MASK_SUFFIX, IndexedWriter, bin_path, idx_path, mask_path, prefix_of
from hpctrain.data.inputs import FORMATS, TEXT_DOCUMENTS, DocumentReader, InputError, InputFile, expand_inputs
from hpctrain.data.tokenize import BYTES, Encoder, TokenizerError, TokenizerSpec, resolve_tokenizer
from hpctrain.errors import write_error

PROG = "hpctrain-prepare"
BATCH_BYTES = 1 << 20
"""Text per batch of documents sent to an encoder (enough to amortise the hand-over to a worker)."""
BATCH_DOCS = 8192
TAG_PROGRESS, TAG_STOP = 2901, 2902
CHUNK = 1 << 24  # the flat writer's read size


class PrepareError(Exception):
    """A problem of the run (not of one input): one line with the fix."""


class _Usage(Exception):
    pass


class _Stopped(Exception):
    """Another rank failed: stop early (its message is the one printed)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block (printed by rank 0 only)
        raise _Usage(f"{message} (see {PROG} --help)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Tokenise documents into Megatron-format shards (.bin + .idx) and a manifest.",
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Run under mpirun/srun to split the files over ranks (one shard each). "
                        "Format and options: docs/data.md.")
    ap.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="text, JSON Lines (.jsonl/.json/.ndjson) or Parquet files, optionally .gz/.zst; "
                         "directories and (quoted) globs are expanded")
    ap.add_argument("-o", "--output", metavar="OUT",
                    help="output prefix: OUT.bin/.idx (one rank) or OUT_<rank>.bin/.idx, and the manifest OUT.json")
    ap.add_argument("--tokenizer", default=BYTES,
                    help="bytes (default: UTF-8 bytes, vocabulary 256, EOS 0), a Hugging Face tokenizer.json or a "
                         "model directory holding one, or a SentencePiece .model")
    ap.add_argument("--text-key", default="text", help="JSON Lines key / Parquet column of the text (default: text)")
    ap.add_argument("--text-documents", default="file", choices=TEXT_DOCUMENTS,
                    help="plain text: one document per file (default), per blank-line-separated block, or per line")
    ap.add_argument("--input-format", default="auto", choices=("auto",) + FORMATS,
                    help="read every input as this format (default: by extension; unknown extensions are text)")
    ap.add_argument("--workers", type=int, default=1,
                    help="encoding processes per rank, one core each (default 1: encode in the rank's process)")
    ap.add_argument("--bos", help="BOS token or id instead of the tokenizer's, or none")
    ap.add_argument("--eos", help="EOS token or id instead of the tokenizer's")
    ap.add_argument("--dtype", default="auto", choices=("auto", "uint16", "int32"),
                    help="token dtype (default auto: uint16 below 65,500 ids, else int32, as Megatron)")
    ap.add_argument("--quiet", action="store_true", help="no progress line (errors and the summary still print)")
    chat = ap.add_argument_group("chat and instruction data (docs/data.md, \"Chat and instruction data\")")
    chat.add_argument("--format", default="text", choices=CHAT_FORMATS,
                      help="text (default: documents), chat (JSON Lines of messages) or instruction (JSON Lines of "
                           "prompt and response), rendered by the tokenizer's chat template with a loss mask")
    chat.add_argument("--train-on", default=ASSISTANT, choices=TRAIN_ON,
                      help="tokens the loss counts: assistant (default: every assistant turn), last-assistant, all")
    chat.add_argument("--seq-len", type=int, help="chat/instruction: the trainer.seq_len you will train with (the "
                      "summary counts conversations longer than a sample of seq_len + 1 tokens)")
    chat.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template instead of the tokenizer's")
    chat.add_argument("--messages-key", default="messages", help="chat: the key of the messages (default: messages)")
    chat.add_argument("--prompt-key", default="prompt", help="instruction: the key of the prompt (default: prompt)")
    chat.add_argument("--response-key", default="response",
                      help="instruction: the key of the response (default: response)")
    chat.add_argument("--system-key", default="system",
                      help="instruction: the key of an optional system message (default: system)")
    return ap


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.output is None:
        if len(args.inputs) >= 2 and args.inputs[-1].endswith(".bin"):
            args.output = args.inputs.pop()  # the old form: INPUT OUT.bin
        else:
            raise _Usage(f"name the output: -o OUT (writes OUT.bin, OUT.idx and OUT.json) (see {PROG} --help)")
    args.output = prefix_of(args.output[:-5] if args.output.endswith(".json") else args.output)
    if args.workers < 1:
        raise _Usage(f"--workers {args.workers}: give 1 or more encoding processes per rank")
    if args.format == "text":
        options = (("--train-on", args.train_on, ASSISTANT), ("--seq-len", args.seq_len, None),
                   ("--chat-template", args.chat_template, None))
        given = [flag for flag, value, default in options if value != default]
        if given:
            raise _Usage(f"{given[0]} is for chat and instruction data: add --format chat or --format instruction")
    elif args.seq_len is None or args.seq_len < 1:
        what = "needs" if args.seq_len is None else f"got --seq-len {args.seq_len}; it needs"
        raise _Usage(f"--format {args.format} {what} --seq-len N, the trainer.seq_len you will train with (the summary "
                     f"counts the conversations longer than a sample)")
    return args


# -- the plan (rank 0) ------------------------------------------------------------------

def balance(sizes: Sequence[int], parts: int) -> List[List[int]]:
    """Indices of ``sizes`` split into ``parts`` lists of similar total: largest
    first, each to the least-loaded part (ties: the lowest); each list in input order."""
    load = [0] * parts
    out: List[List[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        out[p].append(i)
        load[p] += sizes[i]
    return [sorted(o) for o in out]


def shard_prefix(output: str, rank: int, world: int) -> str:
    return output if world == 1 else f"{output}_{rank:05d}"


@dataclass
class Plan:
    files: List[InputFile]
    spec: TokenizerSpec
    output: str
    assignment: List[List[int]]
    chat: Optional[ChatSpec] = None
    """Chat or instruction data (None: documents of text)."""


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    """Inputs, tokenizer and the split over ranks; an exception with one line for a bad one."""
    spec = resolve_tokenizer(args.tokenizer, args.bos, args.eos, args.dtype)
    chat = None
    if args.format != "text":
        chat = resolve_chat(spec, args.tokenizer, args.format, args.chat_template, args.train_on, args.seq_len,
                            args.messages_key, args.prompt_key, args.response_key, args.system_key)
    files = expand_inputs(args.inputs, args.input_format)
    directory = os.path.dirname(os.path.abspath(args.output))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"-o {args.output}: cannot create {directory} ({e.strerror}); "
                           "choose another output") from None
    if not os.access(directory, os.W_OK):
        raise PrepareError(f"-o {args.output}: {directory} is not writable; choose another output")
    outputs = {os.path.realpath(p) for r in range(world) for p in
               (bin_path(shard_prefix(args.output, r, world)), idx_path(shard_prefix(args.output, r, world)),
                mask_path(shard_prefix(args.output, r, world)))}
    clash = [f.path for f in files if os.path.realpath(f.path) in outputs]
    if clash:
        raise PrepareError(f"-o {args.output} would overwrite the input {clash[0]}; choose another output")
    return Plan(files, spec, args.output, balance([f.size for f in files], world), chat)


# -- progress across ranks ----------------------------------------------------------------

def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class _Progress:
    """Every rank's counts (input bytes, files, documents, tokens), shown by rank 0.

    Other ranks send theirs to rank 0 at most once a second (a small
    non-blocking send) and a last time when done; rank 0 takes them in
    whenever it polls, and also relays a failure: once any rank has failed,
    rank 0 sends every other rank a stop message, and a rank that sees one
    stops at its next poll (``_Stopped``)."""

    def __init__(self, comm: Any, total_bytes: int, total_files: int, quiet: bool, workers: int):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.total_bytes, self.total_files, self.workers = total_bytes, total_files, workers
        self.mine: Tuple[int, ...] = (0, 0, 0, 0)  # bytes, files, documents, tokens (update's)
        self.counts: Dict[int, Tuple[int, ...]] = {}
        self.done: set = set()
        self.failed = False
        self.stopped_by: Optional[int] = None
        self.stop_sent: List[int] = []
        self._requests: List[Any] = []
        self.t0 = time.perf_counter()
        self._last_send = self._last_show = self.t0
        stream = sys.stderr
        self.show = not quiet and self.rank == 0
        self.tty = stream.isatty()
        self.interval = 0.5 if self.tty else 5.0  # a log: after 5 s, then doubling up to a line a minute
        self._width = 0

    def update(self, *counts: int) -> None:
        self.mine = tuple(counts)
        self.poll()

    def poll(self) -> None:
        now = time.perf_counter()
        if self.rank != 0:
            if self.comm.iprobe(source=0, tag=TAG_STOP):
                self.comm.recv(source=0, tag=TAG_STOP)
                self.stopped_by = 0
                raise _Stopped()
            if now - self._last_send >= 1.0:
                self._requests = [r for r in self._requests if not r.Test()]
                self._requests.append(self.comm.isend((self.mine, False, False), dest=0, tag=TAG_PROGRESS))
                self._last_send = now
            return
        self._drain()
        if self.failed:
            self._stop_others()
            raise _Stopped()
        if self.show and now - self._last_show >= self.interval:
            self._display()
            self._last_show = now
            if not self.tty:
                self.interval = min(2 * self.interval, 60.0)

    def _drain(self) -> None:
        from mpi4py import MPI  # after bootstrap: MPI must not start at import

        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_PROGRESS, status=status):
            source = status.Get_source()
            counts, done, failed = self.comm.recv(source=source, tag=TAG_PROGRESS)
            self.counts[source] = counts
            if done:
                self.done.add(source)
            self.failed |= failed

    def _stop_others(self) -> None:
        for r in range(1, self.size):
            if r not in self.done and r not in self.stop_sent:
                self._requests.append(self.comm.isend(None, dest=r, tag=TAG_STOP))
                self.stop_sent.append(r)

    def finish(self, failed: bool) -> None:
        """This rank's work is over (done, failed or stopped). Rank 0 waits
        for every rank's last counts here (stopping them if anyone failed)."""
        if self.rank != 0:
            self.comm.send((self.mine, True, failed), dest=0, tag=TAG_PROGRESS)
            return
        self.failed |= failed
        while len(self.done) < self.size - 1:
            self._drain()
            if self.failed:
                self._stop_others()
            if self.show and time.perf_counter() - self._last_show >= self.interval:
                self._display()
                self._last_show = time.perf_counter()
            time.sleep(0.01)
        if self.show and self.tty and not self.failed:
            self._display(final=True)  # finish the line updated in place (the summary follows)

    def settle(self, stop_sent: List[int]) -> None:
        """After the ranks have agreed (so every message above was sent): take
        a stop message that was sent to this rank after it finished, and
        complete this rank's sends."""
        from mpi4py import MPI  # after bootstrap: MPI must not start at import

        if self.rank in stop_sent and self.stopped_by is None:
            self.comm.recv(source=0, tag=TAG_STOP)
        MPI.Request.Waitall(self._requests)

    def totals(self) -> Tuple[int, int, int, int]:
        every = dict(self.counts)
        every[0] = self.mine
        return tuple(sum(c[i] for c in every.values()) for i in range(4))  # type: ignore[return-value]

    def _display(self, final: bool = False) -> None:
        done_bytes, files, docs, tokens = self.totals()
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        pct = 100.0 * done_bytes / self.total_bytes if self.total_bytes else 100.0
        line = (f"{PROG}: read {pct:5.1f}% of {_size(self.total_bytes)}, {files}/{self.total_files} files, "
                f"{docs:,} documents, {tokens:,} tokens, {tokens / elapsed / 1e6:.2f} M tokens/s "
                f"({self.size} rank{'s' if self.size > 1 else ''} x "
                f"{self.workers} worker{'s' if self.workers > 1 else ''})")
        if self.tty:
            pad = " " * max(0, self._width - len(line))
            sys.stderr.write(f"\r{line}{pad}" + ("\n" if final else ""))
            self._width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


# -- one rank's work -------------------------------------------------------------------------

_worker_encoder: Any = None


def _encoder(spec: TokenizerSpec, chat: Optional[ChatSpec]) -> Any:
    """The encoder of documents (``Encoder``) or of conversations (``ChatEncoder``)."""
    return Encoder(spec) if chat is None else ChatEncoder(spec, chat)


def _worker_init(spec: TokenizerSpec, chat: Optional[ChatSpec] = None) -> None:
    global _worker_encoder
    _worker_encoder = _encoder(spec, chat)


def _worker_encode(docs: List[Any], open_ended: Optional[List[bool]]) -> Tuple[np.ndarray, ...]:
    assert _worker_encoder is not None
    return _worker_encoder.encode(docs, open_ended)


@dataclass
class _Batch:
    docs: List[Any] = field(default_factory=list)
    open_ended: List[bool] = field(default_factory=list)
    origins: List[Tuple[int, int]] = field(default_factory=list)  # (file index, line/row)
    text_bytes: int = 0


class _Immediate:
    """A finished result, shaped like a Future."""

    def __init__(self, fn, *args):
        try:
            self._value, self._error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - re-raised by result(), like a Future's
            self._value, self._error = None, e

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


def _describe_failure(e: BaseException, batch: _Batch, plan: Plan, units: Dict[int, str], spec: TokenizerSpec) -> str:
    """One line for a batch that could not be encoded: the first document that fails on its own."""
    encoder = _encoder(spec, plan.chat)
    for doc, origin in zip(batch.docs, batch.origins):
        try:
            encoder.encode([doc])
        except ConversationError as one:  # the reason says what to do
            return f"input {plan.files[origin[0]].path} {units[origin[0]]} {origin[1]}: {one}"
        except Exception as one:  # noqa: BLE001 - any failure of the tokenizer names the document
            path = plan.files[origin[0]].path
            return (f"input {path} {units[origin[0]]} {origin[1]}: the tokenizer cannot encode this document "
                    f"({type(one).__name__}: {one}); fix or drop it")
    first, last = batch.origins[0], batch.origins[-1]
    where = plan.files[first[0]].path + ("" if first[0] == last[0] else f" .. {plan.files[last[0]].path}")
    return (f"encoding the documents of {where} failed ({type(e).__name__}: {e}); a worker process may have run "
            f"out of memory: try fewer --workers")


def _tokenize(args: argparse.Namespace, plan: Plan, mine: List[int], writer: IndexedWriter,
              progress: _Progress) -> Dict[str, int]:
    """Encode this rank's files into ``writer``; counts. Raises InputError /
    PrepareError (one line) or _Stopped."""
    spec, chat = plan.spec, plan.chat
    workers = 1 if spec.kind == BYTES else args.workers  # bytes need no encoding worth a process
    pool = None
    if workers > 1:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init, initargs=(spec, chat))
        def submit(b: _Batch) -> Any:
            return pool.submit(_worker_encode, b.docs, b.open_ended if any(b.open_ended) else None)
    else:
        encoder = _encoder(spec, chat)

        def submit(b: _Batch) -> Any:
            return _Immediate(encoder.encode, b.docs, b.open_ended if any(b.open_ended) else None)
    pending: Deque[Tuple[Any, _Batch]] = deque()
    units: Dict[int, str] = {}
    counts: Dict[str, Any] = {"documents": 0, "tokens": 0}
    if chat is not None:
        counts.update(trained_tokens=0, longer_than_sample=0, no_assistant=0, no_assistant_first=None)
    done_bytes, files_done = 0, 0

    def collect(keep: int) -> None:
        while len(pending) > keep:
            future, batch = pending.popleft()
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 - a worker's failure, named by its document
                raise PrepareError(_describe_failure(e, batch, plan, units, spec)) from None
            flat, lengths = result[0], result[1]
            if chat is None:
                writer.add_documents(flat, lengths, np.array(batch.open_ended) if any(batch.open_ended) else None)
            else:
                _count_conversations(counts, result, batch, plan, units, chat)
                writer.add_documents(flat, lengths, mask=result[2])
            counts["documents"] += sum(1 for o in batch.open_ended if not o)
            counts["tokens"] += int(flat.size)

    try:
        batch = _Batch()
        for i in mine:
            inp = plan.files[i]
            reader: Any = (DocumentReader(inp, args.text_documents, args.text_key, as_bytes=spec.kind == BYTES)
                           if chat is None else ConversationReader(inp, chat))  # documents, or conversations
            units[i] = reader.unit
            for doc, where, open_ended in reader:
                batch.docs.append(doc)
                batch.open_ended.append(open_ended)
                batch.origins.append((i, where))
                batch.text_bytes += len(doc) if chat is None else conversation_size(doc)
                if batch.text_bytes >= BATCH_BYTES or len(batch.docs) >= BATCH_DOCS:
                    pending.append((submit(batch), batch))
                    batch = _Batch()
                    collect(2 * workers)
                    progress.update(done_bytes + reader.consumed(), files_done, counts["documents"], counts["tokens"])
            done_bytes += inp.size
            files_done += 1
            progress.update(done_bytes, files_done, counts["documents"], counts["tokens"])
        if batch.docs:
            pending.append((submit(batch), batch))
        collect(0)
        progress.update(done_bytes, files_done, counts["documents"], counts["tokens"])
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return {**counts, "input_bytes": done_bytes, "files": files_done}


def _count_conversations(counts: Dict[str, Any], result: Tuple[np.ndarray, ...], batch: _Batch, plan: Plan,
                         units: Dict[int, str], chat: ChatSpec) -> None:
    """A batch of conversations' counts: trained tokens, longer than a sample, without an assistant turn."""
    _, lengths, mask, lacking = result
    counts["trained_tokens"] += int(mask.sum())
    counts["longer_than_sample"] += int((lengths > chat.seq_len + 1).sum())
    if chat.train_on != "all" and lacking.any():
        counts["no_assistant"] += int(lacking.sum())
        if counts["no_assistant_first"] is None:
            origin = batch.origins[int(np.flatnonzero(lacking)[0])]
            counts["no_assistant_first"] = f"{plan.files[origin[0]].path} {units[origin[0]]} {origin[1]}"


# -- the run ----------------------------------------------------------------------------------

def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _description(spec: TokenizerSpec, num_tokens: int, num_documents: int, chat: Optional[ChatSpec] = None,
                 counts: Optional[Sequence[Dict[str, Any]]] = None) -> dict:
    out = {"format": "megatron-indexed", "dtype": spec.dtype, "vocab_size": spec.vocab_size,
           "bos_id": spec.bos_id, "eos_id": spec.eos_id, "num_tokens": num_tokens, "num_documents": num_documents,
           "tokenizer": {"kind": spec.kind, "name": spec.name, "path": spec.path}}
    if chat is not None:
        every = list(counts or [])
        out["loss_mask"] = {"file": MASK_SUFFIX, "dtype": "uint8", **chat.describe(),
                            "trained_tokens": sum(c.get("trained_tokens", 0) for c in every),
                            "longer_than_sample": sum(c.get("longer_than_sample", 0) for c in every)}
    return out


def _no_assistant(outcome: Sequence[Dict[str, Any]], chat: ChatSpec) -> Optional[str]:
    """The line refusing conversations without an assistant turn (counted over every rank), or None."""
    counts = [o["counts"] for o in outcome if o["counts"].get("no_assistant")]
    if not counts:
        return None
    total = sum(c["no_assistant"] for c in counts)
    return (f"{total:,} conversation{'s have' if total != 1 else ' has'} no assistant turn (the first: input "
            f"{counts[0]['no_assistant_first']}), so --train-on {chat.train_on} would train on nothing in "
            f"{'them' if total != 1 else 'it'}; drop such lines from the input, or pass --train-on all")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mpi4py import MPI  # after bootstrap: MPI must not start at import

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    try:
        args = parse_args(argv)
    except _Usage as e:  # every rank parsed the same arguments: rank 0 speaks for all
        if rank == 0:
            write_error(str(e))
        return 2

    plan, problem = None, None
    if rank == 0:
        try:
            plan = make_plan(args, world)
        except (InputError, TokenizerError, PrepareError) as e:
            problem = str(e)
    plan, problem = comm.bcast((plan, problem), root=0)
    if problem:
        if rank == 0:
            write_error(problem)
        return 2

    mine = plan.assignment[rank]
    progress = _Progress(comm, sum(f.size for f in plan.files), len(plan.files), args.quiet, args.workers)
    prefix = shard_prefix(plan.output, rank, world)
    writer: Optional[IndexedWriter] = None
    error, stopped, counts = None, False, {}
    try:
        writer = IndexedWriter(prefix, plan.spec.dtype, loss_mask=plan.chat is not None)
        counts = _tokenize(args, plan, mine, writer, progress)
        writer.close()
    except _Stopped:
        stopped = True
    except (InputError, TokenizerError, PrepareError) as e:
        error = str(e)
    except OSError as e:
        error = f"rank {rank} cannot write its shard {prefix}.bin ({e.strerror or e}); check the space and permissions"
    except Exception as e:  # noqa: BLE001 - a bug: still one line, and every rank still meets below
        error = f"rank {rank}: {type(e).__name__}: {e} (a bug in {PROG}: please report it)"
    try:
        progress.finish(failed=error is not None)
    except Exception as e:  # noqa: BLE001 - the agreement below must still happen
        error = error or f"rank {rank}: progress messages failed ({e})"

    outcome = comm.allgather({"error": error, "stopped": stopped, "counts": counts,
                              "stop_sent": progress.stop_sent if rank == 0 else []})
    progress.settle(outcome[0]["stop_sent"])
    errors = [o["error"] for o in outcome if o["error"]]
    total_docs = sum(o["counts"].get("documents", 0) for o in outcome)
    if not errors and total_docs == 0:
        errors = [f"the inputs hold no document with text ({', '.join(args.inputs[:3])}"
                  f"{', ...' if len(args.inputs) > 3 else ''}); check --text-key and --input-format"]
    if not errors and plan.chat is not None:
        errors = [e for e in [_no_assistant(outcome, plan.chat)] if e]
    keep = not errors and counts.get("documents", 0) > 0
    if writer is not None:
        if keep:
            try:
                writer.commit()
                if world > 1:
                    _write_json(prefix + ".json", {**_description(plan.spec, counts["tokens"], counts["documents"],
                                                                  plan.chat, [counts]),
                                                   "manifest": os.path.basename(plan.output) + ".json"})
            except OSError as e:
                error = f"rank {rank} cannot move its shard {prefix} into place ({e.strerror or e})"
        else:
            writer.abort()
    late = comm.allgather(error if not errors else None)
    errors += [e for e in late if e]
    if errors:
        if rank == 0:
            for line in dict.fromkeys(errors):
                write_error(line)
        return 2
    if rank == 0:
        elapsed = time.perf_counter() - progress.t0
        shards = [{"prefix": os.path.basename(shard_prefix(plan.output, r, world)),
                   "num_tokens": o["counts"]["tokens"], "num_documents": o["counts"]["documents"],
                   "inputs": [os.path.abspath(plan.files[i].path) for i in plan.assignment[r]]}
                  for r, o in enumerate(outcome) if o["counts"].get("documents", 0) > 0]
        tokens = sum(s["num_tokens"] for s in shards)
        every = [o["counts"] for o in outcome]
        manifest = {**_description(plan.spec, tokens, total_docs, plan.chat, every),
                    "created_by": PROG, "text_key": args.text_key, "text_documents": args.text_documents,
                    "input_format": args.input_format, "shards": shards}
        _write_json(plan.output + ".json", manifest)
        spec = plan.spec
        what = "document" if plan.chat is None else "conversation"
        sys.stdout.write(
            f"{PROG}: wrote {total_docs:,} {what}{'s' if total_docs != 1 else ''}, {tokens:,} tokens ({spec.dtype}; "
            f"tokenizer {spec.name} ({spec.kind}), vocabulary {spec.vocab_size}, BOS "
            f"{'none' if spec.bos_id is None else spec.bos_id}, EOS {spec.eos_id}) to {len(shards)} "
            f"shard{'s' if len(shards) != 1 else ''} in {elapsed:.1f} s ({tokens / max(elapsed, 1e-9):,.0f} "
            f"tokens/s); manifest {plan.output}.json\n")
        if plan.chat is not None:
            sys.stdout.write(_chat_summary(manifest["loss_mask"], total_docs, tokens))
        sys.stdout.flush()
    return 0


def _chat_summary(mask: Dict[str, Any], conversations: int, tokens: int) -> str:
    """The summary's lines about the loss mask and the conversations longer than a sample."""
    trained, long, seq = mask["trained_tokens"], mask["longer_than_sample"], mask["seq_len"]
    out = (f"{PROG}: loss mask ({mask['file']} beside each shard): --train-on {mask['train_on']} trains on "
           f"{trained:,} of the {tokens:,} tokens ({100.0 * trained / max(tokens, 1):.1f}%); chat template "
           f"{mask['chat_template']}\n")
    if long:
        out += (f"{PROG}: {long:,} of the {conversations:,} conversations are longer than a sample (--seq-len {seq}: "
                f"{seq + 1} tokens) and will be split across samples; every other conversation stays whole in "
                f"one sample\n")
    else:
        out += (f"{PROG}: every conversation fits in a sample (--seq-len {seq}: {seq + 1} tokens): none will be "
                f"split across samples\n")
    return out


# -- today's flat format ------------------------------------------------------------------------

def prepare(input_path: str, output_path: str, dtype: str = "uint16") -> int:
    """Today's flat token file: the input's bytes as tokens (vocabulary 256, no
    document boundaries, no EOS) in ``output_path`` (uint16 or uint32), read in
    chunks so files larger than memory work, plus the ``.json`` sidecar the
    ``data=tokens`` loader reads (dtype, vocab_size, num_tokens). Returns the
    token count."""
    from hpctrain.data.sources import TOKEN_DTYPES, sidecar_path  # heavy: keeps --help fast

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input text file {input_path} does not exist")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(TOKEN_DTYPES)}")
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp = output_path + ".tmp"
    n = 0
    with open(input_path, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(CHUNK):
            arr = np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPES[dtype])
            arr.tofile(dst)
            n += arr.size
    os.replace(tmp, output_path)
    with open(sidecar_path(output_path), "w") as f:
        json.dump({"dtype": dtype, "vocab_size": 256, "num_tokens": n, "tokenizer": "bytes",
                   "source": os.path.abspath(input_path)}, f, indent=1)
    return n


if __name__ == "__main__":
    sys.exit(main())
