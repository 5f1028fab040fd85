"""The sample orders a run draws from: the training sources with their
blend weights, and the validation sources (``data.split`` or
``data.validation.paths``), each a ``cursor.SampleOrder`` over its stream
(a ``cursor.PackedOrder`` of whole conversations for a source with loss
masks: chat data, padded with the tokenizer's EOS)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from hpctrain.data.cursor import PackedOrder, SampleOrder
from hpctrain.data.index import DataIndex, SourceIndex, shared
from hpctrain.data.sources import TokenSource, open_source
from hpctrain.data.streams import DocumentStream, DocumentTable
from hpctrain.log import log_rank0


@dataclass
class Orders:
    """What the cursors draw from: the training sources (with their blend
    weights) and the validation sources (one cursor each)."""

    train: List[SampleOrder]
    weights: List[float]
    names: List[str]
    valid: List[SampleOrder]
    valid_names: List[str]


def sample_orders(data: Any, seq_len: int, model_vocab: int, comm: Any = None, is_main: bool = True) -> Orders:
    """The sample orders of ``data`` (an indexed source's tables broadcast from
    rank 0 over ``comm``, an mpi4py communicator; collective then). Each
    source draws its own permutation (its seed is the data seed plus its index)."""
    if data.source != "indexed":
        return Orders([SampleOrder(open_source(data), seq_len, data.seed)], [1.0], ["data"], [], [])
    index = shared(data, model_vocab, comm, is_main)
    train = [_order(index, s, s.train, s.train_stream(), model_vocab, seq_len, data.seed + i)
             for i, s in enumerate(index.sources)]
    valid_sources = index.validation or [s for s in index.sources if s.valid is not None and len(s.valid)]
    valid = []
    for i, s in enumerate(valid_sources):
        stream = s.train_stream() if index.validation else s.valid_stream()
        table = s.train if index.validation else s.valid
        assert stream is not None and table is not None  # valid_sources holds only sources with held-out documents
        valid.append(_order(index, s, table, stream, model_vocab, seq_len, data.seed + 1000 + i))
    return Orders(train, [s.weight for s in index.sources], [s.name for s in index.sources], valid,
                  [s.name for s in valid_sources])


def _order(index: DataIndex, source: SourceIndex, table: DocumentTable, stream: DocumentStream, vocab: int,
           seq_len: int, seed: int) -> SampleOrder:
    """Windows of the stream, or, for chat data, its conversations packed (logged once, by rank 0)."""
    tokens = TokenSource(stream.name, stream, vocab)
    if not source.masked:
        return SampleOrder(tokens, seq_len, seed)
    order = PackedOrder(tokens, source.mask_stream(table), seq_len, seed, pad_id=index.eos_id or 0)
    packing, total = order.packing, int(table.length.sum())
    log_rank0("data: source %r: %d conversations packed whole into %d samples of %d tokens (%.1f%% filled)%s",
              stream.name, len(table), len(packing), seq_len + 1, 100.0 * total / max(1, len(packing) * (seq_len + 1)),
              f"; {packing.split} longer than a sample, cut over samples of their own" if packing.split else "")
    return order
