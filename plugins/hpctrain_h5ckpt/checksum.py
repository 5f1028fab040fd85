"""A per-dataset checksum that any layout can compute from its own hyperslabs.

The dataset's bytes are read as 32-bit words ``w`` (4-byte elements as
they are, 8-byte elements as two words each, 1- and 2-byte elements widened
to one word each) at their flat row-major index ``i`` in the *logical*
tensor. The checksum is the pair, modulo 2**32::

    s1 = sum(w_i)            s2 = sum((i + 1) * w_i)

Both sums are additive over disjoint sets of elements, so every rank
computes the part of the hyperslabs it writes (or reads), one allreduce adds
the parts, and the result is the same whichever layout saved or loads the
tensor: no gather of whole tensors, no extra pass over the file, and a
checkpoint saved on dp=2 verifies while loading on tp=2 or one process.
A CRC or hash of the bytes would need the whole tensor in one place.

What it catches: any change of one word (s1 changes by a nonzero amount
below 2**32), words moved to the wrong place (s2 weights positions), and a
truncated or torn file (missing data reads as zeros or fails); two random
corruptions cancel with a chance of about 2**-64. It is not a defence
against deliberate tampering; it guards against storage and transfer
faults. For speed it is two vectorised passes, row sums and column sums of
the box accumulated in 32 bits (wrap-around is the modulus), rather than an
index array as large as the data: about twice the speed of a memcpy.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np

from hpctrain_h5ckpt.layout import Box, box_shape, full_box

_U32 = np.uint32
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}


def zero() -> np.ndarray:
    return np.zeros(2, dtype=_U32)


def _words(arr: np.ndarray, shape: Sequence[int], box: Box) -> Tuple[np.ndarray, Tuple[int, ...], Box]:
    """(32-bit words as rows x last dim, logical shape, box), both in word units."""
    a = np.require(arr, requirements="C")
    if a.dtype.kind == "S":  # only ever stored whole (config text)
        raw = np.frombuffer(a.tobytes(), dtype=np.uint8).astype(_U32)
        return raw.reshape(1, -1), (raw.size,), ((0, raw.size),)
    size = a.dtype.itemsize
    if size not in _UINT:
        raise TypeError(f"no checksum for dtype {a.dtype}")
    if not shape:
        shape, box, a = (1,), ((0, 1),), a.reshape(1)
    w = a.view(_UINT[size])
    if size < 4:
        w = w.astype(_U32)
    per = 2 if size == 8 else 1  # words per element
    w = w.reshape(-1, (box[-1][1] - box[-1][0]) * per)
    if per == 2:
        shape = tuple(shape[:-1]) + (shape[-1] * 2,)
        box = tuple(box[:-1]) + ((box[-1][0] * 2, box[-1][1] * 2),)
    return w, tuple(shape), box


def partial(arr: np.ndarray, shape: Sequence[int], box: Box) -> np.ndarray:
    """This box's share of the checksum of a dataset of logical ``shape``
    (``arr`` holds exactly the box's elements)."""
    if tuple(arr.shape) != box_shape(box) and arr.dtype.kind != "S":
        raise ValueError(f"array of shape {arr.shape} does not fill the box {box}")
    if arr.size == 0:
        return zero()
    w, shape, box = _words(arr, shape, box)
    # Flat index of word (row r, column j) = rowstart[r] + j, rowstart being
    # the index of the row's first word in the logical tensor (mod 2**32).
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    rowstart = np.zeros(1, dtype=np.uint64)
    for (a, b), st in zip(box[:-1], strides[:-1]):
        rowstart = (rowstart[:, None] + np.arange(a, b, dtype=np.uint64)[None, :] * np.uint64(st)).reshape(-1)
    rowstart = rowstart.astype(_U32)  # modulo 2**32
    a_last, b_last = box[-1]
    cols = np.arange(a_last + 1, b_last + 1, dtype=np.uint64).astype(_U32)
    rowsum = w.sum(axis=1, dtype=_U32)
    colsum = w.sum(axis=0, dtype=_U32)
    parts = np.array([
        [rowsum.sum(dtype=_U32), (rowstart * rowsum).sum(dtype=_U32)],
        [0, (cols * colsum).sum(dtype=_U32)],
    ], dtype=_U32)
    return parts.sum(axis=0, dtype=_U32)


def whole(arr: np.ndarray) -> np.ndarray:
    """Checksum of a whole dataset held in one array."""
    return partial(arr, arr.shape, full_box(arr.shape))


def add(acc: np.ndarray, part: np.ndarray) -> np.ndarray:
    """acc + part modulo 2**32 (array arithmetic wraps without warnings)."""
    return np.add(acc, part, dtype=_U32)


def fmt(c: np.ndarray) -> str:
    return f"{int(c[0]):08x}:{int(c[1]):08x}"
