"""A tensor as an MPI buffer, for the duration of one operation.

Zero-copy whenever possible: a contiguous CPU tensor whose dtype MPI can
handle as is is passed as a numpy view of its own memory
(``tensor.numpy()``); pure data movement reinterprets the bytes as a
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
kept alive by the Work handle until then, which keeps the numpy view and any
staging buffer alive for MPI.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import torch

from hpctrain.errors import ConfigError
from hpctrain.log import get_logger
from hpctrain_comm_mpi.dtypes import mpi_type, reduce_wire_dtype, transport_dtype

log = get_logger(__name__)


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
        # CPU: a numpy view (no copy). CUDA-aware: the tensor itself (mpi4py
        # takes __cuda_array_interface__ / DLPack objects as buffers).
        self.array: Any = flat.numpy() if flat.device.type == "cpu" else flat

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
