"""A tensor as an MPI buffer, for the duration of one operation.

Zero-copy whenever possible: a contiguous CPU tensor whose dtype MPI can
handle as is is passed as a buffer over its own memory
(``MPI.buffer.fromaddress``); pure data movement reinterprets the bytes as a
same-width integer type (``dtypes.transport_dtype``), so bfloat16 moves
without a copy too. A staging copy is made only when it must be:

- the tensor is not contiguous (MPI needs one flat buffer; a derived MPI
  datatype per stride pattern would be more code for a rare case);
- a 16-bit float is being reduced (float32 staging: MPI cannot add bf16, and
  one rounding at the end beats one per addition);
- a CUDA tensor and an MPI that is not CUDA-aware: the data goes through a
  pinned host buffer (fast DMA both ways).

With a CUDA-aware MPI a CUDA tensor is handed to mpi4py directly (it reads
``__cuda_array_interface__``/DLPack); the current stream is synchronised
first because MPI does not order itself after queued kernels.
THE GPU PATHS ARE UNTESTED HERE (no GPU on the development machines).

``finish()`` runs after the operation completed: it scales (AVG) and copies
a staged result back into the caller's tensor. The ``WireBuffer`` object is
kept alive by the Work handle until then, which keeps the buffer over its memory and any
staging buffer alive for MPI.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
from mpi4py import MPI

from hpctrain.errors import ConfigError
from hpctrain.log import get_logger

from hpctrain_comm_mpi.dtypes import mpi_type, reduce_wire_dtype, transport_dtype

log = get_logger(__name__)


def address_buffer(t: torch.Tensor) -> Any:
    """An mpi4py buffer over a contiguous CPU tensor's memory, by address (no copy;
    unlike ``tensor.numpy()`` it leaves the storage resizable, which ZeRO-3 needs to
    free gathered parameters)."""
    return MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size())


class WireBuffer:
    """``tensor`` prepared for MPI.

    ``reduce``: MPI will combine values (wire dtype = accumulation dtype);
    otherwise it only moves bytes. ``read``: MPI reads the tensor's current
    values (so a staging copy must be filled). ``write``: MPI writes results
    that ``finish`` must deliver to the tensor. ``copy``: stage even if a
    view would do (the tensor overlaps another buffer of the same call).
    """

    def __init__(self, tensor: torch.Tensor, *, reduce: bool, read: bool, write: bool, cuda_aware: bool,
                 copy: bool = False):
        self.target = tensor
        self.write = write
        src = tensor.detach()
        wire_dtype = reduce_wire_dtype(src.dtype) if reduce else src.dtype
        via_host = src.is_cuda and not cuda_aware
        self.staged = copy or via_host or not src.is_contiguous() or wire_dtype != src.dtype
        if self.staged:
            device = torch.device("cpu") if via_host else src.device
            self.wire = torch.empty(src.shape, dtype=wire_dtype, device=device, pin_memory=via_host)
            if read:
                self.wire.copy_(src)
        else:
            self.wire = src
        if src.is_cuda:
            # MPI does not know CUDA streams: the data must be final before it reads it
            torch.cuda.current_stream(src.device).synchronize()
        flat = self.wire.reshape(-1)
        if not reduce:
            flat = flat.view(transport_dtype(flat.dtype))
        self.flat = flat
        self.mpi_type = mpi_type(flat.dtype)
        # CPU: a buffer over the tensor's memory. CUDA-aware: the tensor itself
        # (mpi4py takes __cuda_array_interface__ / DLPack objects).
        self.array: Any = address_buffer(flat) if flat.device.type == "cpu" else flat

    @property
    def count(self) -> int:
        """Elements on the wire (transport elements for byte moves)."""
        return self.flat.numel()

    def spec(self) -> list:
        """The ``[buffer, datatype]`` pair mpi4py takes."""
        return [self.array, self.mpi_type]

    def finish(self, divide_by: Optional[int] = None) -> None:
        """After completion: AVG's division (in the wire dtype, before any
        rounding to 16 bits), then the copy back into a staged tensor."""
        if divide_by is not None:
            self.wire.div_(divide_by)
        if self.write and self.staged:
            with torch.no_grad():
                self.target.copy_(self.wire)


class CachedView(NamedTuple):
    """What ``ViewCache`` keeps of one tensor."""

    tensor: "weakref.ref[torch.Tensor]"
    address: int
    numel: int
    spec: list
    """``[buffer, count, datatype]`` over the tensor's memory, by address."""
    floating: bool


class ViewCache:
    """MPI buffer specs of contiguous CPU tensors that are passed again and
    again (DP bucket buffers, persistent staging buffers), so the next call on
    the same tensor goes straight to MPI.

    Why it matters: right after a large collective the CPU caches hold message
    data, not the interpreter's, so every Python operation before the next MPI
    call is a cache miss. Building a ``WireBuffer`` then costs several times
    what it costs in a warm loop, enough to make ``all_reduce`` visibly slower
    than a bare mpi4py call (docs/comm.md, "Overhead", has the figures).

    An entry holds no reference to the tensor or its memory (a weak reference
    and an address-based mpi4py buffer), so caching never keeps memory alive;
    it is used only while the same live tensor still has the same address,
    element count and contiguity (``set_``/``resize_`` change one of those).
    At most ``capacity`` tensors are remembered, oldest forgotten first
    (0: none).
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.entries: Dict[int, CachedView] = {}
        """By ``id(tensor)``; read directly by hot paths (see ``get`` for the checks)."""

    def get(self, tensor: torch.Tensor) -> Optional[CachedView]:
        hit = self.entries.get(id(tensor))
        if (hit is not None and hit.tensor() is tensor and hit.address == tensor.data_ptr()
                and hit.numel == tensor.numel() and tensor.is_contiguous()):
            return hit
        return None

    def remember(self, tensor: torch.Tensor, buffer: "WireBuffer") -> None:
        """Remember ``tensor`` if ``buffer`` is a zero-copy view of it in host memory."""
        if buffer.staged or tensor.device.type != "cpu" or tensor.numel() == 0 or self.capacity <= 0:
            return
        key = id(tensor)
        if key not in self.entries and len(self.entries) >= self.capacity:
            del self.entries[next(iter(self.entries))]
        entries = self.entries

        def forget(_: Any, key: int = key) -> None:
            entry = entries.get(key)
            if entry is not None and entry.tensor() is None:
                del entries[key]

        memory = address_buffer(tensor)
        self.entries[key] = CachedView(weakref.ref(tensor, forget), tensor.data_ptr(), tensor.numel(),
                                        [memory, buffer.count, buffer.mpi_type], tensor.dtype.is_floating_point)

    def __len__(self) -> int:
        return len(self.entries)


class CachedPair(NamedTuple):
    """What ``PairCache`` keeps of one (output, input) pair."""

    output: "weakref.ref[torch.Tensor]"
    input: "weakref.ref[torch.Tensor]"
    out_address: int
    in_address: int
    out_nbytes: int
    in_nbytes: int
    out_shape: torch.Size
    in_shape: torch.Size
    send: Any
    """``[buffer, datatype]`` over the input's memory, by address (no
    reference to it), or ``MPI.IN_PLACE``. No count: mpi4py divides the
    buffer into one block per rank where the call needs it."""
    recv: list
    """``[buffer, datatype]`` over the output's memory, likewise."""
    floating: bool


class PairCache:
    """``ViewCache`` for the operations with an output and an input tensor
    (all_gather, reduce_scatter, all_to_all: one cache per operation, since
    the wire types differ): the MPI buffer specs of a pair of contiguous CPU
    tensors passed together again and again (ZeRO's shard and bucket, a
    layer's persistent all_to_all buffers), remembered the second time the
    pair is passed (``remember`` says why not the first), so later calls
    with the same pair go straight to MPI.

    Same reason as ``ViewCache``, and the same rules: no reference to either
    tensor or its memory is kept (not even for a pair noted once); an entry
    is used only while both tensors are contiguous and at the addresses and
    sizes they had (then whether they overlap, and so which buffers MPI
    gets, cannot have changed either); it is dropped as soon as one of them
    dies, by the weak references' callbacks, which run while the tensor is
    deallocated, before its id can be reused. So an entry found under the
    ids of two live tensors is theirs, and the hot paths, unlike
    ``ViewCache``'s, do not dereference the weak references (measurably
    slower with cold caches).

    Sizes are byte sizes (``nbytes``: a property, cheaper than ``numel()``
    with cold caches; a tensor's dtype never changes) where the operation
    depends on element counts only, shapes (``by_shape``) where it depends
    on dim-0 rows (all_to_all). Keyed on both tensors: the same output with
    another input is another entry. At most ``capacity`` pairs are
    remembered, oldest forgotten first (0: none).
    """

    def __init__(self, capacity: int = 256, *, by_shape: bool = False):
        self.capacity = capacity
        self.by_shape = by_shape
        self.entries: Dict[Tuple[int, int], CachedPair] = {}
        """By ``(id(output), id(input))``; read directly by hot paths (see ``get`` for the checks)."""
        self._sightings: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
        """Pairs seen once: weak references (no callback, so cheap), by the same key."""

    def get(self, output: torch.Tensor, input: torch.Tensor) -> Optional[CachedPair]:
        hit = self.entries.get((id(output), id(input)))
        if (hit is not None and hit.out_address == output.data_ptr() and hit.in_address == input.data_ptr()
                and ((hit.out_shape == output.shape and hit.in_shape == input.shape) if self.by_shape
                     else (hit.out_nbytes == output.nbytes and hit.in_nbytes == input.nbytes))
                and output.is_contiguous() and input.is_contiguous()):
            return hit
        return None

    def remember(self, output: torch.Tensor, input: torch.Tensor, recv: WireBuffer,
                 send: Optional[WireBuffer]) -> None:
        """Remember the pair, the second time it is passed, if ``recv`` (for
        ``output``) and ``send`` (for ``input``; None: the input goes as
        MPI_IN_PLACE) are zero-copy views in host memory.

        The first time, the pair is only noted (two weak references): most
        pairs that come this way are fresh tensors never passed again (a
        layer's activations and outputs), and making an entry would cost
        each of their calls microseconds with cold caches.
        """
        if recv.staged or (send is not None and send.staged) or self.capacity <= 0:
            return
        key = (id(output), id(input))
        seen = self._sightings.pop(key, None)
        if seen is None or seen[0]() is not output or seen[1]() is not input:
            sightings = self._sightings
            if len(sightings) >= 16 * self.capacity:  # dead or rare pairs, oldest first
                del sightings[next(iter(sightings))]
            sightings[key] = (weakref.ref(output), weakref.ref(input))
            return
        if not (output.is_cpu and input.is_cpu):
            return
        out_address, in_address, out_nbytes, in_nbytes = (output.data_ptr(), input.data_ptr(),
                                                          output.nbytes, input.nbytes)
        if not (out_nbytes and in_nbytes):
            return
        entries = self.entries
        if key not in entries and len(entries) >= self.capacity:
            del entries[next(iter(entries))]

        def forget(_: Any, key: Tuple[int, int] = key) -> None:
            entry = entries.get(key)
            if entry is not None and (entry.output() is None or entry.input() is None):
                del entries[key]

        entries[key] = CachedPair(
            weakref.ref(output, forget), weakref.ref(input, forget), out_address, in_address, out_nbytes, in_nbytes,
            output.shape, input.shape,
            MPI.IN_PLACE if send is None else [MPI.buffer.fromaddress(in_address, in_nbytes), send.mpi_type],
            [MPI.buffer.fromaddress(out_address, out_nbytes), recv.mpi_type], output.dtype.is_floating_point)

    def __len__(self) -> int:
        return len(self.entries)


def detect_cuda_aware(setting: str) -> bool:
    """Whether CUDA tensors may be handed to MPI directly.

    ``on``/``off`` force it; ``auto`` asks Open MPI (``MPIX_Query_cuda_support``,
    which reports the runtime state, not just the build) and otherwise trusts
    the switches Cray MPICH and MVAPICH2 use to turn GPU support on. Any
    doubt means staging through host memory: slower, never wrong.
    """
    if setting not in ("auto", "on", "off"):
        raise ConfigError(f"comm.mpi.cuda_aware={setting!r} must be auto, on or off")
    if setting != "auto":
        return setting == "on"
    if not torch.cuda.is_available():
        return False
    try:
        query = ctypes.CDLL(None).MPIX_Query_cuda_support  # Open MPI's extension, when loaded
        return bool(query())
    except (AttributeError, OSError):
        pass
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1" or os.environ.get("MV2_USE_CUDA") == "1":
        return True
    log.info("comm.mpi: cannot tell whether MPI is CUDA-aware; staging GPU tensors through pinned host memory "
             "(set comm.mpi.cuda_aware=on to pass device pointers)")
    return False
