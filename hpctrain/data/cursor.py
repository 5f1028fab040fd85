"""The global sample order and the data cursor.

Sample ``i`` of a source is a window of ``seq_len + 1`` tokens. Windows are
the non-overlapping ``seq_len``-token blocks of the source's token stream,
visited in a random permutation per epoch (seed, epoch): a function of
``i`` alone. With several sources (``data.blend``) each sample of the
global stream is first given a source by the blend rule (``blend``: at
every prefix each source's share is within one sample of its weight) and
then the next sample of that source. Step ``s`` consumes samples
``[c, c + global_batch)`` of the global stream, where ``c`` is the number
consumed so far; sample rank ``r`` of ``D`` (``D`` = dp x ep, the mesh's
sample axes) takes the r-th contiguous slice, then cuts it into
micro-batches. With context parallelism each sample's tokens are split too:
the cp rank keeps only its positions (``data.sequence.cp_positions``) of
the inputs and targets, and the micro-batch carries those positions for
RoPE. So the global batch at a step is the same tokens whatever the layout,
and a resumed run continues the same stream on any layout: the cursor is
the count of consumed samples and, with a blend, each source's count.

Document masking (``data.document_mask``): the stream knows where its
documents begin (``streams.DocumentStream``); each micro-batch carries,
per token, its document's index in the sample (``segments``) and its
position in that document (``positions``, restarting at each document), so
attention never crosses a boundary.

Chat data (shards with a loss mask, ``hpctrain-prepare --format chat``):
its samples are not windows of the stream but whole conversations packed
into ``seq_len + 1`` tokens (``PackedOrder``: next fit in stream order,
the rest padded; a conversation longer than that is cut over samples of
its own), visited in a permutation per epoch like windows; document
masking is on for every sample of such a run (packed conversations never
see each other). Targets the loss must not count (the mask's 0s: prompts,
padding, each conversation's first token) are ``MASKED`` (-100, PyTorch's
``ignore_index``), and each micro-batch says how many of its targets count
(``MicroBatch.counted``), so the loss is a mean over the counted targets
of the whole global batch (``hpctrain.train.step_runner``).

A window a token file can no longer supply (it shrank under the job) is
``ShortRead`` at once, or, for the trainer's cursor (``defer_short_reads``),
filled with token 0 and counted in ``short_reads`` for the ranks to agree on
before the update (``raise_if_short``; why: ``hpctrain.data.tokenfile``).
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from hpctrain.data.blend import assign, normalised
from hpctrain.data.sources import TokenSource
from hpctrain.data.streams import pack, segments_and_positions
from hpctrain.data.tokenfile import ShortRead, TokenFileChanged
from hpctrain.errors import ConfigError
from hpctrain.log import log_rank0

MASKED = -100
"""A target the loss does not count (PyTorch's ``ignore_index``): the loss functions skip targets below 0."""


class SampleOrder:
    packed = False
    """Samples are whole documents packed (``PackedOrder``), not windows of the stream."""
    masked = False
    """Samples carry a loss mask (``target_mask``)."""

    def __init__(self, source: TokenSource, seq_len: int, seed: int):
        self.source = source
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = (len(source) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{source.name}: {len(source)} tokens cannot hold one sample of {seq_len + 1}")
        self._perms: Dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.clear()
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def window_start(self, index: int) -> int:
        epoch, pos = divmod(index, self.num_windows)
        return int(self._perm(epoch)[pos]) * self.seq_len

    def sample(self, index: int, short: Optional[List[ShortRead]] = None) -> np.ndarray:
        """Sample ``index``'s tokens. A window the file can no longer supply raises
        ``ShortRead``, or, given a ``short`` list, is appended there and comes back as zeros."""
        start = self.window_start(index)
        try:
            return np.asarray(self.source.tokens[start:start + self.seq_len + 1], dtype=np.int64)
        except ShortRead as e:
            if short is None:
                raise
            short.append(e)
            return np.zeros(self.seq_len + 1, dtype=np.int64)

    def document_starts(self, index: int) -> np.ndarray:
        """Where documents begin inside sample ``index`` (relative, > 0); the
        stream must know its documents (``streams.DocumentStream``)."""
        start = self.window_start(index)
        return self.source.tokens.document_starts(start, start + self.seq_len + 1)

    def target_mask(self, index: int, short: Optional[List[ShortRead]] = None) -> Optional[np.ndarray]:
        """Which of sample ``index``'s ``seq_len`` targets the loss counts (bool); None: all of them."""
        return None

    def batch(self, indices: range, short: Optional[List[ShortRead]] = None) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(i, short) for i in indices]))


class PackedOrder(SampleOrder):
    """Whole conversations packed into samples (``streams.pack``), with their loss mask: sample ``i`` is
    the packed span ``perm[i]`` of the epoch, padded to ``seq_len + 1`` tokens with ``pad_id`` (padding is
    a document of its own and no target of it counts)."""

    packed = True
    masked = True

    def __init__(self, source: TokenSource, mask: Any, seq_len: int, seed: int, pad_id: int = 0):
        self.source, self.mask, self.seq_len, self.seed, self.pad_id = source, mask, seq_len, seed, int(pad_id)
        self.packing = pack(source.tokens.table.length, seq_len + 1)
        self.num_windows = len(self.packing)
        if self.num_windows < 1:
            raise ValueError(f"{source.name}: no conversation to pack")
        self._perms = {}

    def span(self, index: int) -> Tuple[int, int]:
        """Sample ``index``'s tokens in the stream: ``[start, stop)``."""
        epoch, pos = divmod(index, self.num_windows)
        k = int(self._perm(epoch)[pos])
        return int(self.packing.start[k]), int(self.packing.stop[k])

    def window_start(self, index: int) -> int:
        return self.span(index)[0]

    def _read(self, stream: Any, index: int, fill: int, short: Optional[List[ShortRead]]) -> np.ndarray:
        start, stop = self.span(index)
        out = np.full(self.seq_len + 1, fill, dtype=np.int64)
        try:
            out[:stop - start] = stream[start:stop]
        except ShortRead as e:
            if short is None:
                raise
            short.append(e)
            out[:] = 0
        return out

    def sample(self, index: int, short: Optional[List[ShortRead]] = None) -> np.ndarray:
        return self._read(self.source.tokens, index, self.pad_id, short)

    def document_starts(self, index: int) -> np.ndarray:
        start, stop = self.span(index)
        starts = self.source.tokens.document_starts(start, stop)
        if stop - start < self.seq_len + 1:  # the padding: a document of its own
            starts = np.append(starts, stop - start)
        return starts

    def target_mask(self, index: int, short: Optional[List[ShortRead]] = None) -> np.ndarray:
        return self._read(self.mask, index, 0, short)[1:] != 0


class MicroBatch(NamedTuple):
    """One forward/backward's share of this rank."""

    inputs: torch.Tensor
    """Token ids (micro_batch, tokens)."""
    targets: torch.Tensor
    """Next-token ids, shaped like inputs."""
    positions: Optional[torch.Tensor] = None
    """The tokens' positions for RoPE: their absolute positions in the sample (context parallelism
    holds some of them), or, with document masking, their positions in their own document (0 at
    each document's first token); None: 0, 1, ..."""
    segments: Optional[torch.Tensor] = None
    """Document masking (``data.document_mask``): per token, the index of its document in its
    sample (0, 1, ...; int64, shaped like ``inputs``, the same tokens context parallelism keeps),
    so attention never crosses a document boundary; None: each sample is one sequence."""
    counted: Optional[int] = None
    """Data with a loss mask: how many of ``targets`` the loss counts (those not ``MASKED``; this
    rank's tokens); None: every target counts."""
    loss_weight: Optional[float] = None
    """Data with a loss mask, set by the trainer for the step (``step_runner.weigh_masked``): what
    this micro-batch's mean loss is multiplied by in the objective, so that the step's gradient is
    that of the mean over the counted targets of the whole global batch; None: 1."""

    def to(self, device: torch.device) -> "MicroBatch":
        # the optional tensors stay None, the counts stay numbers
        moved: List[Any] = [t.to(device) if isinstance(t, torch.Tensor) else t for t in self]
        return MicroBatch(*moved)


class DataCursor:
    """Hands each rank its micro-batches, step by step, from the global order.

    ``orders``: one sample order, or one per blended source with their
    ``weights``. ``sample_rank``/``sample_size``: this rank's place among
    the ranks that split the samples (dp x ep). ``positions``: the token
    positions this rank keeps of every sample (context parallelism), or
    None for all. ``document_mask``: micro-batches carry ``segments`` and
    document-relative ``positions``. ``defer_short_reads``: a window the
    token file can no longer supply is zeros and counted in ``short_reads``
    (the caller agrees on it over the ranks and calls ``raise_if_short``
    before using the step), instead of ``ShortRead`` from ``next_step``.
    """

    def __init__(self, orders: Union[SampleOrder, Sequence[SampleOrder]], global_batch_size: int,
                 micro_batch_size: int, sample_rank: int, sample_size: int, consumed_samples: int = 0,
                 positions: Optional[torch.Tensor] = None, defer_short_reads: bool = False,
                 weights: Optional[Sequence[float]] = None, document_mask: bool = False):
        if global_batch_size % (sample_size * micro_batch_size):
            raise ValueError("global batch must be divisible by dp * ep * micro batch (validated earlier)")
        self.orders: List[SampleOrder] = [orders] if isinstance(orders, SampleOrder) else list(orders)
        self.weights = normalised(weights if weights is not None else [1.0] * len(self.orders))
        if len(self.weights) != len(self.orders):
            raise ValueError(f"{len(self.orders)} sources but {len(self.weights)} blend weights")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.sample_rank = sample_rank
        self.sample_size = sample_size
        self.consumed_samples = consumed_samples
        self.counts: List[int] = [consumed_samples] + [0] * (len(self.orders) - 1)
        """Samples each source has given so far (the blend's state)."""
        self.positions = positions
        self.loss_mask = any(o.masked for o in self.orders)
        """Samples carry a loss mask (chat data): micro-batches say how many targets count."""
        self.document_mask = document_mask or any(o.packed for o in self.orders)
        """Micro-batches carry segments (``data.document_mask``, or packed conversations)."""
        self.defer_short_reads = defer_short_reads
        self.short_reads = 0
        """1 when a window of the last step could not be read whole (deferred), else 0."""
        self.last_samples: Optional[np.ndarray] = None
        """This rank's samples of the last step: rows of (source, index in that source)."""

    @property
    def order(self) -> SampleOrder:
        """The first source's order (the only one without a blend)."""
        return self.orders[0]

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.sample_size * self.micro_batch_size)

    def local_indices(self) -> range:
        """This rank's samples of the next step in the global stream."""
        per_rank = self.global_batch_size // self.sample_size
        start = self.consumed_samples + self.sample_rank * per_rank
        return range(start, start + per_rank)

    def _assign(self, counts: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, List[int]]:
        """Every sample of the next global batch: its source, its index there; the counts after."""
        n = self.global_batch_size
        if len(self.orders) == 1:
            first = int(counts[0])
            return np.zeros(n, dtype=np.int64), np.arange(first, first + n, dtype=np.int64), [first + n]
        return assign(self.weights, counts, n)

    def prepare(self, consumed: int, counts: Sequence[int]) -> Tuple[List[MicroBatch], List[int], int, np.ndarray]:
        """This rank's micro-batches of the step that starts after ``consumed``
        samples (``counts`` per source), the counts after it, its short-read
        flag and its samples (rows of (source, index in that source)). Reads
        only; changes nothing (a prefetcher runs it ahead on a thread)."""
        sources, local, after = self._assign(counts)
        per_rank = self.global_batch_size // self.sample_size
        mine = slice(self.sample_rank * per_rank, (self.sample_rank + 1) * per_rank)
        sources, local = sources[mine], local[mine]
        short: Optional[List[ShortRead]] = [] if self.defer_short_reads else None
        mbs = []
        for k in range(0, per_rank, self.micro_batch_size):
            picks = list(zip(sources[k:k + self.micro_batch_size], local[k:k + self.micro_batch_size]))
            window = torch.from_numpy(np.stack([self.orders[int(s)].sample(int(i), short) for s, i in picks]))
            inputs, targets = window[:, :-1], window[:, 1:]
            if self.loss_mask:
                count = np.stack([self._counts(int(s), int(i), short) for s, i in picks])
                targets = targets.masked_fill(~torch.from_numpy(count), MASKED)
            positions, segments = self.positions, None
            if self.document_mask:
                seg_pos = [segments_and_positions(window.shape[1] - 1, self._starts(int(s), int(i)))
                           for s, i in picks]
                segments = torch.from_numpy(np.stack([sp[0] for sp in seg_pos]))
                positions = torch.from_numpy(np.stack([sp[1] for sp in seg_pos]))
                if self.positions is not None:
                    segments, positions = segments[:, self.positions], positions[:, self.positions]
            if self.positions is not None:
                inputs, targets = inputs[:, self.positions], targets[:, self.positions]
            counted = int((targets >= 0).sum()) if self.loss_mask else None
            mbs.append(MicroBatch(inputs.contiguous(), targets.contiguous(), positions,
                                  None if segments is None else segments.contiguous(), counted))
        return mbs, after, int(bool(short)), np.stack([sources, local], axis=1)

    def _counts(self, source: int, index: int, short: Optional[List[ShortRead]]) -> np.ndarray:
        """Which targets of a sample count (bool, ``seq_len``): its order's mask, else all."""
        order = self.orders[source]
        mask = order.target_mask(index, short)
        return np.ones(order.seq_len, dtype=bool) if mask is None else mask

    def _starts(self, source: int, index: int) -> np.ndarray:
        starts = self.orders[source].document_starts(index)
        return starts[starts < self.orders[source].seq_len]  # a document starting at the last target is no input's

    def next_step(self) -> List[MicroBatch]:
        """This rank's micro-batches for the next step; advances the cursor."""
        mbs, after, short, samples = self.prepare(self.consumed_samples, self.counts)
        self.advance(after, short, samples)
        return mbs

    def advance(self, counts: List[int], short: int, samples: np.ndarray) -> None:
        """Take a prepared step (``prepare`` at this cursor's state) as consumed."""
        self.consumed_samples += self.global_batch_size
        self.counts = list(counts)
        self.short_reads = short
        self.last_samples = samples

    def raise_if_short(self, ranks: int, step: int) -> None:
        """``TokenFileChanged`` when ``ranks`` (the agreed count of ranks whose
        ``short_reads`` was 1 at ``step``) is not 0; called by every rank alike."""
        if ranks:
            tokens = self.order.source.tokens
            describe = getattr(tokens, "changed_message", None)
            raise TokenFileChanged(describe(step, ranks) if describe else
                                   f"{self.order.source.name}: step {step} could not read its data on {ranks} rank(s)")

    allow_batch_change = False
    """Accept a state saved with another global batch size (``checkpoint.allow_batch_change``; the trainer sets it)."""

    def state_dict(self) -> dict:
        state: Dict[str, Any] = {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size}
        if len(self.orders) > 1:
            state["source_counts"] = list(self.counts)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state["consumed_samples"]``. A state saved with another
        ``global_batch_size`` (when it says) is refused, unless
        ``allow_batch_change``: the run would look like the saved run's
        continuation while its batches, and so its updates, differ. Allowed,
        the rule is logged: the stream of samples continues unchanged, cut into
        batches of the new size, and the learning-rate schedule follows the
        step. The rule lives here, in the core, so that every checkpoint format
        gets it by handing over the state it saved; a format that saved no
        batch size is not checked."""
        consumed = int(state["consumed_samples"])
        saved = state.get("global_batch_size")
        if saved is not None and int(saved) != self.global_batch_size:
            if not self.allow_batch_change:
                raise ConfigError(
                    f"saved with trainer.global_batch_size={int(saved)}, resumed with trainer.global_batch_size="
                    f"{self.global_batch_size}; resume with trainer.global_batch_size={int(saved)}, or set "
                    "checkpoint.allow_batch_change=true to continue the same sample stream in batches of the new size")
            log_rank0("checkpoint.allow_batch_change=true: saved with trainer.global_batch_size=%d, now %d: the global "
                      "sample cursor continues at sample %d, so the stream of samples is the same, cut into batches "
                      "of %d; the learning-rate schedule follows the step, not the samples", int(saved),
                      self.global_batch_size, consumed, self.global_batch_size)
        self.consumed_samples = consumed
        counts = state.get("source_counts")
        if len(self.orders) > 1:
            if counts is None or len(counts) != len(self.orders):
                raise ConfigError(
                    f"the checkpoint's data cursor holds {len(counts) if counts else 'no'} blend counts, this run "
                    f"blends {len(self.orders)} sources; resume with the blend it was saved with")
            self.counts = [int(c) for c in counts]
        else:
            self.counts = [consumed]
