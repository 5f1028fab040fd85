"""Read hyperslabs of a checkpoint on any layout, verifying as we go.

``CheckpointReader(path, comm, opts)`` opens the file (collectively under
MPI-IO, or each rank on its own with the default driver), indexes every
dataset and the ``/meta`` attributes, and checks the format name and
version. ``read(wants)`` then gives each rank exactly the boxes it asked
for, by the *loading* layout's ShardSpecs, never whole tensors it does not
hold.

Verification costs no extra pass: the boxes all ranks read are merged into
a Plan (as for saving), one rank is designated per distinct box, each sums
the checksum of the boxes designated to it, and one Allreduce completes
every dataset's checksum. Boxes read independently are read in blocks of
about ``_HOT_BLOCK_BYTES`` and each block is summed (and checked for
non-finite values, where asked) right after it is read, while it is still
in the CPU's cache: a second pass over the whole box would read it from
memory again (docs/checkpointing.md, "Measured"). Datasets that the
loading layout does not read completely (another world size's RNG rows,
tensors nobody holds) are read whole, in blocks, by one rank each, round
robin. Every problem (a missing
dataset, a shape that differs from the model's, an unreadable dataset, a
checksum mismatch) is gathered from all ranks and raised as one
``CheckpointError`` on every rank, naming the file and the datasets.

Reads are collective (datasets of at least ``collective_min_mb``) only
where some rank's hyperslab is strided in the file (a split of a later
dim). A hyperslab that is one contiguous byte range (a split of dim 0, as
ZeRO-3/FSDP and data parallelism load) is read independently: a collective
read would only add the ranks' synchronisation and MPI-IO's two-phase
exchange, which made the bench's load 2.7x slower (docs/checkpointing.md,
"Measured").

The same class with ``MPI.COMM_SELF`` and no wants is ``hpctrain-ckpt
verify``: it reads and checks every dataset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import h5py
import numpy as np
from mpi4py import MPI

from hpctrain_h5ckpt import checksum, h5io
from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.finite import all_finite
from hpctrain_h5ckpt.layout import FORMAT_NAME, FORMAT_VERSION, Box, DatasetDecl, box_shape, build_plan, full_box
from hpctrain_h5ckpt.options import IOOptions
from hpctrain_h5ckpt.snapshot import from_numpy

_BLOCK_BYTES = 64 << 20  # bound on memory when a dataset is verified whole
_HOT_BLOCK_BYTES = 4 << 20  # a block read, then summed while it is still in the last-level cache


@dataclass
class DatasetInfo:
    path: str
    shape: Tuple[int, ...]
    dtype: str
    attrs: Dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def stored_checksum(self) -> Optional[np.ndarray]:
        c = self.attrs.get("checksum")
        return None if c is None else np.asarray(c, dtype=np.uint32).reshape(-1)


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item() if not isinstance(value, np.bytes_) else bytes(value).decode("utf-8", "replace")
    return value


class _Arena:
    """Host memory for every box a rank reads, as views of one allocation.

    One large allocation is backed by transparent huge pages (numpy asks for
    them above 4 MiB), so first touching it costs a fraction of the page
    faults of a separate array per box, most of which are too small for huge
    pages (docs/checkpointing.md, "Measured")."""

    _ALIGN = 64

    def __init__(self, boxes: Mapping[Tuple[str, int], Tuple[str, Tuple[int, ...]]]):
        """``boxes``: (path, k) -> (dtype, shape) of each array wanted."""
        self.views: Dict[Tuple[str, int], Tuple[int, Tuple[int, ...], np.dtype]] = {}
        at = 0
        for key, (dtype, shape) in boxes.items():
            dt = np.dtype(dtype)
            self.views[key] = (at, shape, dt)
            at += -(-math.prod(shape) * dt.itemsize // self._ALIGN) * self._ALIGN
        self.memory = np.empty(at, dtype=np.uint8)

    def take(self, path: str, k: int) -> np.ndarray:
        at, shape, dt = self.views[(path, k)]
        n = math.prod(shape) * dt.itemsize
        return self.memory[at:at + n].view(dt).reshape(shape)


def contiguous(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` is one contiguous byte range of a row-major dataset of
    ``shape``: leading dims of extent 1, then any range of one dim, then whole dims."""
    dims = list(zip(box, shape))
    i = 0
    while i < len(dims) and dims[i][0][1] - dims[i][0][0] == 1:
        i += 1
    return all((a, b) == (0, n) for (a, b), n in dims[i + 1:])


def _agree(comm: Any, errors: List[str]) -> List[str]:
    """Every rank's problems, on every rank, each once, in rank order."""
    merged: List[str] = []
    for rank_errors in comm.allgather(errors):
        merged += [e for e in rank_errors if e not in merged]
    return merged


class CheckpointReader:
    def __init__(self, path: str, comm: Any, opts: IOOptions):
        self.path, self.comm, self.opts = path, comm, opts
        self.file: Optional[h5py.File] = None
        error: List[str] = []
        try:
            self.file = h5io.open_file(path, "r", comm if opts.parallel else None, opts.access())
        except (OSError, ValueError) as e:
            error = [f"checkpoint {path}: cannot be opened as HDF5 ({e}); "
                     "the file is truncated, torn or not a checkpoint"]
        errors = _agree(comm, error)
        if errors:
            self.close()
            raise CheckpointError("\n".join(errors))
        try:
            self.index = self._index()
            self.meta = {k: _decode(v) for k, v in self.opened["meta"].attrs.items()} if "meta" in self.opened else {}
        except Exception as e:
            self.close()
            raise CheckpointError(f"checkpoint {path}: its structure is unreadable ({type(e).__name__}: {e})") from e
        problem = self._format_problem()
        if problem:
            self.close()
            raise CheckpointError(f"checkpoint {path}: {problem}")

    def _index(self) -> Dict[str, DatasetInfo]:
        # h5py's low-level calls: its high-level objects cost twice HDF5's own
        # metadata reads here, once per dataset on every rank at every load
        names: List[bytes] = []

        def visit(name: bytes, info: Any) -> None:
            if info.type == h5py.h5o.TYPE_DATASET:
                names.append(name)

        fid = self.opened.id
        h5py.h5o.visit(fid, visit, info=True)
        out: Dict[str, DatasetInfo] = {}
        for name in names:
            dsid = h5py.h5d.open(fid, name)
            attrs: Dict[str, Any] = {}
            for i in range(h5py.h5a.get_num_attrs(dsid)):
                aid = h5py.h5a.open(dsid, index=i)
                value = np.empty(aid.shape, dtype=aid.dtype)
                aid.read(value)
                key = aid.name.decode()
                attrs[key] = value if key == "checksum" else _decode(value[()])
            path = "/" + name.decode()
            out[path] = DatasetInfo(path, tuple(dsid.shape), dsid.dtype.str, attrs)
        return out

    def _format_problem(self) -> Optional[str]:
        name, version = self.meta.get("format"), self.meta.get("format_version")
        if name != FORMAT_NAME:
            return f"not an {FORMAT_NAME} checkpoint (/meta format attribute is {name!r})"
        if not isinstance(version, int) or version > FORMAT_VERSION:
            return f"format version {version!r} is newer than this reader's {FORMAT_VERSION}; upgrade hpctrain"
        unsummed = [p for p, d in self.index.items() if d.stored_checksum is None or d.stored_checksum.size != 2]
        if unsummed:
            return f"dataset {unsummed[0]} has no checksum attribute (torn or foreign file)"
        return None

    @property
    def opened(self) -> h5py.File:
        """The file, until ``close``."""
        assert self.file is not None, f"checkpoint {self.path} is closed"
        return self.file

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading -------------------------------------------------------------
    def read(self, wants: Mapping[str, Sequence[Box]], shapes: Optional[Mapping[str, Tuple[int, ...]]] = None,
             finite: Sequence[str] = (), into: Optional[Mapping[str, Sequence[Optional[np.ndarray]]]] = None,
             ) -> Dict[str, List[np.ndarray]]:
        """This rank's boxes of each wanted dataset (collective over the comm).

        ``shapes`` gives the logical shape the caller expects for a path; a
        different shape in the file is an error naming both. Floating-point
        datasets whose path starts with one of ``finite`` are checked for
        NaN and infinity as they are read: those holding any are in
        ``self.nonfinite`` afterwards (this rank's boxes only). ``into``
        gives, per path and box, a C-contiguous array of the dataset's dtype
        and the box's shape to read into (None: host memory of the reader's);
        the returned arrays are then those.
        """
        errors: List[str] = []
        for p in wants:
            info = self.index.get(p)
            if info is None:
                errors.append(f"checkpoint {self.path}: dataset {p} is missing")
            elif shapes is not None and p in shapes and tuple(shapes[p]) != info.shape:
                errors.append(f"checkpoint {self.path}: dataset {p} has shape {info.shape} but this run expects "
                              f"{tuple(shapes[p])} (a different model configuration?)")
        errors = _agree(self.comm, errors)
        if errors:
            raise CheckpointError("\n".join(errors))
        decls = [DatasetDecl(p, self.index[p].shape, self.index[p].dtype) for p in wants]
        per_rank = self.comm.allgather((decls, {p: list(b) for p, b in wants.items()}, {}))
        plan = build_plan(per_rank, require_cover=False)
        # Collective reads only where some rank's hyperslab is strided in the
        # file; the decision is a function of the gathered wants, so every rank
        # makes the same one.
        rounds = {p: max(len(w.get(p, ())) for _, w, _ in per_rank) for p in plan.owners
                  if not all(contiguous(b, self.index[p].shape) for b, _ in plan.owners[p])}
        inspect = _Inspector(self.index, plan, self.comm.Get_rank(), self.opts.verify, tuple(finite))
        out, errors = self._read_boxes(wants, rounds, inspect, into or {})
        if self.opts.verify:
            errors += self._verify(inspect.sums, plan)
        self.nonfinite = inspect.nonfinite
        errors = _agree(self.comm, errors)
        if errors:
            raise CheckpointError("\n".join(errors))
        return out

    def _read_boxes(self, wants: Mapping[str, Sequence[Box]], rounds: Mapping[str, int], inspect: "_Inspector",
                    into: Mapping[str, Sequence[Optional[np.ndarray]]],
                    ) -> Tuple[Dict[str, List[np.ndarray]], List[str]]:
        out: Dict[str, List[np.ndarray]] = {}
        errors: List[str] = []
        collective = self.opts.parallel
        dxpl = h5io.collective_dxpl() if collective else None
        given: Dict[Tuple[str, int], np.ndarray] = {}
        for p, destinations in into.items():
            for k, arr in enumerate(destinations):
                if arr is not None and arr.dtype == np.dtype(self.index[p].dtype) and arr.flags.c_contiguous \
                        and tuple(arr.shape) == box_shape(wants[p][k]):
                    given[(p, k)] = arr
        arena = _Arena({(p, k): (self.index[p].dtype, box_shape(b)) for p in wants for k, b in enumerate(wants[p])
                        if (p, k) not in given})

        def take(p: str, k: int) -> np.ndarray:
            return given[(p, k)] if (p, k) in given else arena.take(p, k)

        for p in sorted(self.index):  # same order on every rank: collective calls must match
            mine = list(wants.get(p, ()))
            try:
                dset = self.opened[p]
                if collective and p in rounds and self.index[p].nbytes >= self.opts.collective_min_bytes:
                    arrays = []
                    for k in range(rounds.get(p, 0)):
                        if k < len(mine):
                            arrays.append(h5io.read_box(dset, mine[k], dxpl, take(p, k)))
                            inspect(p, mine[k], arrays[-1], inspect.start(p, mine[k]))
                        else:
                            h5io.read_none(dset, dxpl)
                else:
                    arrays = [self._read_hot(dset, p, b, take(p, k), inspect) for k, b in enumerate(mine)]
                if mine:
                    out[p] = arrays
            except Exception as e:  # noqa: BLE001 - named in the errors every rank agrees on
                errors.append(f"checkpoint {self.path}: dataset {p} is unreadable ({type(e).__name__}: {e})")
        return out, errors

    def _read_hot(self, dset: h5py.Dataset, path: str, box: Box, out: np.ndarray, inspect: "_Inspector"
                  ) -> np.ndarray:
        """``box`` into ``out`` in blocks along its first dim, each inspected while in cache."""
        summed = inspect.start(path, box)
        if not box or out.size == 0:
            h5io.read_box(dset, box, None, out)
            inspect(path, box, out, summed)
            return out
        (a, b), rest = box[0], tuple(box[1:])
        rows = max(1, _HOT_BLOCK_BYTES // max(1, out.nbytes // (b - a)))
        for r in range(a, b, rows):
            part = ((r, min(b, r + rows)),) + rest
            block = out[r - a:min(b, r + rows) - a]
            h5io.read_box(dset, part, None, block)
            inspect(path, part, block, summed)
        return out

    def _verify(self, sums: Mapping[str, np.ndarray], plan: Any) -> List[str]:
        """Compare each dataset's checksum, this rank's parts (``sums``) added
        over the ranks, with the stored one; datasets the loading layout does
        not cover are summed whole here, round robin."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        paths = sorted(self.index)
        total = np.zeros((len(paths), 2), dtype=np.uint32)
        errors: List[str] = []
        whole = {p: k for k, p in enumerate(p for p in paths if not plan.covered.get(p, False))}
        for i, p in enumerate(paths):
            try:
                if p in whole:
                    if whole[p] % size == rank:
                        total[i] = self._checksum_whole(p)
                elif p in sums:
                    total[i] = sums[p]
            except Exception as e:  # noqa: BLE001 - named in the errors every rank agrees on
                errors.append(f"checkpoint {self.path}: dataset {p} is unreadable ({type(e).__name__}: {e})")
        self.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        for i, p in enumerate(paths):
            stored = self.index[p].stored_checksum
            assert stored is not None  # _format_problem refused files without
            if not np.array_equal(stored, total[i]):
                errors.append(f"checkpoint {self.path}: dataset {p}: checksum mismatch (stored {checksum.fmt(stored)}, "
                              f"computed {checksum.fmt(total[i])}); the data is corrupt")
        return errors

    def _checksum_whole(self, p: str) -> np.ndarray:
        info, dset = self.index[p], self.opened[p]
        if not info.shape:
            return checksum.partial(h5io.read_box(dset, ()), (), ())
        row_bytes = max(1, info.nbytes // max(1, info.shape[0]))
        step = max(1, _BLOCK_BYTES // row_bytes)
        acc = checksum.zero()
        for r0 in range(0, info.shape[0], step):
            box = ((r0, min(info.shape[0], r0 + step)),) + full_box(info.shape[1:])
            acc = checksum.add(acc, checksum.partial(h5io.read_box(dset, box), info.shape, box))
        return acc


class _Inspector:
    """What is checked of each block as it is read: this rank's part of the
    dataset's checksum (for the boxes the plan designates to this rank) and,
    for the datasets asked for, whether every value is finite."""

    def __init__(self, index: Mapping[str, DatasetInfo], plan: Any, rank: int, verify: bool, finite: Tuple[str, ...]):
        self.index, self.verify, self.finite = index, verify, finite
        self.owned = {p: {b for b, owner in pairs if owner == rank} for p, pairs in plan.owners.items()}
        self.sums: Dict[str, np.ndarray] = {}
        self.nonfinite: Set[str] = set()

    def start(self, path: str, box: Box) -> bool:
        """Whether this rank sums ``box`` of ``path`` (once, however often it reads it)."""
        if not self.verify or box not in self.owned.get(path, ()):
            return False
        self.owned[path].discard(box)
        return True

    def __call__(self, path: str, part: Box, arr: np.ndarray, summed: bool) -> None:
        """``arr`` holds ``part`` of ``path``, a block of a box that this rank sums if ``summed``."""
        info = self.index[path]
        if summed:
            part_sum = checksum.partial(arr, info.shape, part)
            self.sums[path] = checksum.add(self.sums.get(path, checksum.zero()), part_sum)
        if self.finite and path.startswith(self.finite) and path not in self.nonfinite:
            dtype = info.attrs.get("torch_dtype", "")
            if dtype and not all_finite(from_numpy(arr, dtype)):
                self.nonfinite.add(path)
