"""Which torch dtypes travel, and reduce, as which MPI datatypes.

Moving data (all_gather, all_to_all, broadcast, send/recv) never looks at the
values, so every dtype travels as an MPI integer type of the same width
(bfloat16 as int16, float8 as uint8, complex64 as int64...). That needs no MPI
support for the dtype and is bit-exact.

Reducing needs a type MPI can add. float32/float64/int32/int64 reduce
natively. float16 and bfloat16 are reduced in float32 (MPI has no bfloat16,
and a 16-bit sum would round at every addition): the backend stages them
through a float32 buffer and rounds once at the end (see
``hpctrain.comm.protocol.accumulation_dtype``). Anything else (bool, complex,
8-bit) is rejected with a CommError before any message is sent.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from mpi4py import MPI

from hpctrain.comm.protocol import accumulation_dtype

#: dtypes a reduction accepts (16-bit floats via a float32 staging buffer)
REDUCIBLE: Tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
)

#: element width in bytes -> the torch integer dtype of the same width, used as
#: the wire type when only moving bytes
_SAME_WIDTH_INT: Dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: the MPI datatype of every wire dtype (transport integers and native reductions)
_MPI_TYPES: Dict[torch.dtype, Any] = {
    torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
    torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
}


def transport_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype that carries ``dtype``'s bytes (same width, or bytes for 16-byte types)."""
    return _SAME_WIDTH_INT.get(element_size(dtype), torch.uint8)


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def mpi_type(wire_dtype: torch.dtype) -> Any:
    """The predefined MPI datatype of a wire dtype (see ``transport_dtype``, ``reduce_wire_dtype``)."""
    return _MPI_TYPES[wire_dtype]


def reduce_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype MPI reduces ``dtype`` data in (float32 for 16-bit floats)."""
    return accumulation_dtype(dtype)
