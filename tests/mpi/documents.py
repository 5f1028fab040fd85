"""Micro-batches with document masking for the multi-rank tests, before the
data side provides them: the trainer is built as usual, then its step
schedule is handed every micro-batch with ``segments`` (each token's
document index in its sample) and document-relative ``positions``,
derived from a separator token in the sample's inputs (the separator ends
its document, as an EOS does), then cut to this cp rank's zigzag tokens
with ``hpctrain.data.sequence.cp_positions`` exactly as the cursor cuts
inputs. The same wrapping on the one-process reference gives the reference.

How: the trainer's cursor keeps whole samples (its ``positions``, the cp
cut, set to None before the first step), and ``trainer.step_runner`` (every
step's micro-batches pass through it, whether the cursor or a prefetcher
read them) is wrapped to derive segments and positions from the whole
inputs and cut all four tensors.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import torch

from hpctrain.data.cursor import MicroBatch
from hpctrain.data.sequence import cp_positions

SEPARATOR = ord("\n")
"""The document separator: a newline of the built-in byte corpus (1 to 4 documents per 32-token sample)."""


def documents(inputs: torch.Tensor, separator: int = SEPARATOR) -> Tuple[torch.Tensor, torch.Tensor]:
    """(segments, positions) of whole samples ``inputs`` (batch, seq): a
    token's document is the number of separators before it; its position
    counts from its document's first token."""
    ends = inputs == separator
    segments = torch.cumsum(ends.long(), dim=1) - ends.long()
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    first = torch.ones_like(ends)
    first[:, 1:] = ends[:, :-1]  # a document starts at 0 and after every separator
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    return segments, index - starts


class DocumentSchedule:
    """A step schedule that gives ``schedule`` this rank's tokens of every
    whole-sample micro-batch, with segments and document positions."""

    def __init__(self, schedule: Any, keep: Optional[torch.Tensor], segments: bool = True):
        self.schedule, self.keep, self.segments = schedule, keep, segments
        self.seen: List[MicroBatch] = []
        """The micro-batches handed on (the tests check the documents are there)."""

    def cut(self, mb: MicroBatch) -> MicroBatch:
        assert mb.positions is None and mb.segments is None, "the cursor must hand over whole samples"
        segments, positions = documents(mb.inputs.cpu())
        tensors = [mb.inputs, mb.targets, positions.to(mb.inputs.device), segments.to(mb.inputs.device)]
        if self.keep is not None:
            tensors = [t[:, self.keep.to(t.device)] for t in tensors]
        inputs, targets, positions, segments = (t.contiguous() for t in tensors)
        return MicroBatch(inputs, targets, positions=positions, segments=segments if self.segments else None)

    def run(self, model: torch.nn.Module, microbatches: Sequence[MicroBatch], grads: Any,
            autocast: Callable[[], ContextManager] = contextlib.nullcontext):
        cut = [self.cut(mb) for mb in microbatches]
        self.seen += cut
        return self.schedule.run(model, cut, grads, autocast)


def with_documents(trainer: Any, segments: bool = True) -> Any:
    """``trainer`` (before its first step), trained on document-masked
    micro-batches (``segments=False``: document positions, no mask)."""
    mesh = trainer.mesh
    trainer.cursor.positions = None  # whole samples; DocumentSchedule cuts them
    trainer.step_runner = DocumentSchedule(trainer.step_runner,
                                        cp_positions(mesh.rank("cp"), mesh.size("cp"), trainer.cfg.trainer.seq_len),
                                        segments)
    return trainer
