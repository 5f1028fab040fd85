"""The sample orders a run draws from: the training sources with their
blend weights, and the validation sources (``data.split`` or
``data.validation.paths``), each a ``cursor.SampleOrder`` over its stream."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from hpctrain.data.cursor import SampleOrder
from hpctrain.data.index import shared
from hpctrain.data.sources import TokenSource, open_source


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
    train = [SampleOrder(TokenSource(s.name, s.train_stream(), model_vocab), seq_len, data.seed + i)
             for i, s in enumerate(index.sources)]
    valid_sources = index.validation or [s for s in index.sources if s.valid is not None and len(s.valid)]
    valid = []
    for i, s in enumerate(valid_sources):
        stream = s.train_stream() if index.validation else s.valid_stream()
        assert stream is not None  # valid_sources holds only sources with held-out documents
        valid.append(SampleOrder(TokenSource(stream.name, stream, model_vocab), seq_len, data.seed + 1000 + i))
    return Orders(train, [s.weight for s in index.sources], [s.name for s in index.sources], valid,
                  [s.name for s in valid_sources])
