"""Communicator over an MPI sub-communicator, with mpi4py on tensor memory.

Every operation maps to one MPI call on the group's own communicator
(``subcomm``): blocking calls use the blocking MPI collective (Open MPI's
tuned algorithms; its non-blocking ones go through a different, generally
slower component), ``async_op=True`` uses the non-blocking one (Iallreduce,
Iallgather, Ireduce_scatter_block, Ialltoall or Ialltoallv, Ibcast,
Isend/Irecv) and returns an ``MpiWork``. Buffers are numpy views of the tensors (zero-copy)
or staging copies (``buffers``); the Work keeps them alive until ``wait()``,
then scales (AVG) and copies staged results back.

- AVG is SUM then a division by the group size in the accumulation dtype.
- all_to_all without splits (``None`` for both) is MPI_Alltoall on the
  plain transport type, the call an MPI program makes (Alltoallv is
  slower). Callers pass ``None`` on every rank or on none: a rank in
  MPI_Alltoall and one in MPI_Alltoallv never meet, they hang
  (``comm.mpi.check_shapes=true`` reports such a mix). With splits, even
  equal ones (one rank's equal splits say nothing of the others'), it is
  Alltoallv of dim-0 rows: one contiguous MPI datatype per row, so counts
  and displacements are row counts (no 32-bit overflow of element counts,
  and uneven splits are just different counts).
- An input that overlaps the output is copied first (MPI forbids aliasing),
  except the all_gather whose input is exactly this rank's slot of the
  output, which uses MPI_IN_PLACE.
- Repeated calls skip the preparation: a tensor passed to all_reduce
  before, or a pair passed to all_gather, reduce_scatter or all_to_all
  (without splits) twice, goes straight to MPI with the buffers remembered
  from before (``buffers.ViewCache``, ``buffers.PairCache``, which say why
  it matters and when an entry is used). Only calls that need no staging
  copy and, for reductions, SUM or AVG take that path; with
  ``check_shapes`` every call goes the full way.
- Non-blocking operations progress when MPI is entered (Open MPI has no
  progress thread by default): ``is_completed()`` tests, which also pushes
  them on; ``wait()`` blocks.
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from mpi4py import MPI

from hpctrain.comm.protocol import (
    CompletedWork,
    P2POp,
    ReduceOp,
    Work,
    check_all_gather,
    check_all_to_all,
    check_reduce_dtype,
    check_reduce_scatter,
    check_rows,
)
from hpctrain.errors import CommError
from hpctrain.mesh import Group

from hpctrain_comm_mpi import agree
from hpctrain_comm_mpi.agree import as_comm_error, mpi_errors
from hpctrain_comm_mpi.buffers import PairCache, ViewCache, WireBuffer, address_buffer
from hpctrain_comm_mpi.dtypes import REDUCIBLE, element_size, mpi_type, transport_dtype
from hpctrain_comm_mpi.subcomm import mpi_comm_for

_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MAX: MPI.MAX}
_SUM, _AVG = ReduceOp.SUM, ReduceOp.AVG  # for hot paths: ``ReduceOp.SUM`` goes through Enum's lookup each time
_DONE = CompletedWork()  # stateless: one instance serves every blocking call
_INT_MAX = 2**31 - 1  # MPI counts are C ints


def _nothing() -> None:
    return None


class MpiWork:
    """Pending MPI requests, the buffers they use, and what to run once done."""

    def __init__(self, what: str, group_name: str, requests: List[MPI.Request],
                 buffers: Sequence[object], finish: Callable[[], object]):
        self._what, self._group_name = what, group_name
        self._requests = requests
        self._buffers = list(buffers)  # MPI reads/writes their memory until completion
        self._finish: Optional[Callable[[], object]] = finish

    def wait(self) -> None:
        if self._finish is None:
            return
        with mpi_errors(self._what, self._group_name):
            MPI.Request.Waitall(self._requests)
        self._complete()

    def is_completed(self) -> bool:
        if self._finish is None:
            return True
        with mpi_errors(self._what, self._group_name):
            done = MPI.Request.Testall(self._requests)
        if done:
            self._complete()
        return done

    def _complete(self) -> None:
        finish, self._finish = self._finish, None
        assert finish is not None  # wait() and is_completed() return early once done
        finish()
        self._requests, self._buffers = [], []


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share bytes (conservative: their address spans meet)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor):
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _row_numel(t: torch.Tensor) -> int:
    """Elements per dim-0 row (a 0-dim tensor is one row of one element)."""
    return math.prod(t.shape[1:]) if t.dim() else 1


_ONE_BYTE = torch.empty(1, dtype=torch.uint8)
_BYTE_DISPLACEMENT_MAX = _INT_MAX
"""The largest output ``all_to_all_rows`` places by byte displacements (beyond, by row-placed types)."""


def _any_buffer(t: torch.Tensor):
    """``address_buffer``, also for an empty tensor (MPI sends or receives nothing there)."""
    return address_buffer(t) if t.numel() else address_buffer(_ONE_BYTE)


def _displacements(counts: Sequence[int]) -> List[int]:
    return [0] + list(accumulate(counts))[:-1]


class MpiCommunicator:
    """The protocol's collectives for one group (``hpctrain.comm.protocol``)."""

    backend = "mpi"

    def __init__(self, group: Group, world: MPI.Comm, *, check_shapes: bool = False, cuda_aware: bool = False):
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.comm = mpi_comm_for(group, world)
        self.check_shapes = check_shapes
        self._row_types: Dict[Tuple[int, int], MPI.Datatype] = {}
        self.cuda_aware = cuda_aware
        # MPI attaches TAG_UB to MPI_COMM_WORLD; a communicator split from it (a job's runtime inside a bigger
        # one) may not carry the attribute, and the bound is the world's
        tag_ub = world.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        assert tag_ub is not None
        self._tag_ub: int = tag_ub
        # with check_shapes every call goes the full way (the caches stay empty)
        capacity = 0 if check_shapes else 256
        self._views = ViewCache(capacity)
        self._view_entries = self._views.entries
        self._gathers = PairCache(capacity)
        self._gather_entries = self._gathers.entries
        self._scatters = PairCache(capacity)
        self._scatter_entries = self._scatters.entries
        self._exchanges = PairCache(capacity, by_shape=True)
        self._exchange_entries = self._exchanges.entries

    def __repr__(self) -> str:
        return f"MpiCommunicator(group={self.group.name}, rank={self.rank}, size={self.size})"

    # -- plumbing ----------------------------------------------------------
    def _buffer(self, tensor: torch.Tensor, *, reduce: bool = False, read: bool = False,
                write: bool = False) -> WireBuffer:
        return WireBuffer(tensor, reduce=reduce, read=read, write=write, cuda_aware=self.cuda_aware)

    def _run(self, what: str, async_op: bool, blocking: Callable[[], None], nonblocking: Callable[[], MPI.Request],
             buffers: Sequence[WireBuffer], finish: Callable[[], None]):
        if async_op:
            with mpi_errors(what, self.group.name):
                request = nonblocking()
            return MpiWork(what, self.group.name, [request], buffers, finish)
        with mpi_errors(what, self.group.name):
            blocking()
        finish()
        return CompletedWork()

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise CommError(f"{what}: peer {peer} is outside group {self.group.name} of size {self.size}")

    def _check_tag(self, tag: int, what: str) -> None:
        if not 0 <= tag <= self._tag_ub:
            raise CommError(f"{what}: tag {tag} must be in [0, {self._tag_ub}] (MPI_TAG_UB)")

    # -- reductions --------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
        # A tensor seen before (``ViewCache`` says why this matters) goes
        # straight to MPI. Written inline, with identity tests for the op (an
        # Enum's hash is Python code): with cold CPU caches every Python call
        # on the way costs microseconds.
        hit = self._view_entries.get(id(tensor))  # empty with check_shapes: every call goes the full way
        if (hit is not None and (op is _SUM or (op is _AVG and hit.floating))
                and hit.tensor() is tensor and hit.address == tensor.data_ptr()
                and hit.numel == tensor.numel() and tensor.is_contiguous()):
            average = op is _AVG
            try:
                if async_op:
                    request = self.comm.Iallreduce(MPI.IN_PLACE, hit.spec, MPI.SUM)
                    finish = (lambda: tensor.detach().div_(self.size)) if average else _nothing
                    return MpiWork("all_reduce", self.group.name, [request], [tensor], finish)
                self.comm.Allreduce(MPI.IN_PLACE, hit.spec, MPI.SUM)
            except MPI.Exception as error:
                raise as_comm_error("all_reduce", self.group.name, error) from error
            if average:
                tensor.detach().div_(self.size)
            return _DONE
        op = ReduceOp(op)
        check_reduce_dtype("all_reduce", tensor.dtype, op, REDUCIBLE)
        if self.check_shapes:
            agree.check_same(self.comm, "all_reduce", self.group.name,
                             dtype=str(tensor.dtype), numel=tensor.numel(), op=op.value)
        buf = self._buffer(tensor, reduce=True, read=True, write=True)
        self._views.remember(tensor, buf)
        spec, mpi_op = buf.spec(), _MPI_OPS[op]
        divide = self.size if op == ReduceOp.AVG else None
        return self._run("all_reduce", async_op,
                         lambda: self.comm.Allreduce(MPI.IN_PLACE, spec, mpi_op),
                         lambda: self.comm.Iallreduce(MPI.IN_PLACE, spec, mpi_op),
                         [buf], lambda: buf.finish(divide))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False):
        # a remembered pair goes straight to MPI, as in all_gather
        hit = self._scatter_entries.get((id(output), id(input)))
        if (hit is not None and (op is _SUM or (op is _AVG and hit.floating))
                and hit.out_address == output.data_ptr() and hit.in_address == input.data_ptr()
                and hit.out_nbytes == output.nbytes and hit.in_nbytes == input.nbytes
                and output.is_contiguous() and input.is_contiguous()):
            average = op is _AVG
            try:
                if async_op:
                    request = self.comm.Ireduce_scatter_block(hit.send, hit.recv, MPI.SUM)
                    finish = (lambda: output.detach().div_(self.size)) if average else _nothing
                    return MpiWork("reduce_scatter", self.group.name, [request], [output, input], finish)
                self.comm.Reduce_scatter_block(hit.send, hit.recv, MPI.SUM)
            except MPI.Exception as error:
                raise as_comm_error("reduce_scatter", self.group.name, error) from error
            if average:
                output.detach().div_(self.size)
            return _DONE
        op = ReduceOp(op)
        check_reduce_scatter(output, input, self.size)
        check_reduce_dtype("reduce_scatter", input.dtype, op, REDUCIBLE)
        if self.check_shapes:
            agree.check_same(self.comm, "reduce_scatter", self.group.name,
                             dtype=str(input.dtype), numel=input.numel(), op=op.value)
        src = self._buffer(input, reduce=True, read=True)
        dst = self._buffer(output, reduce=True, write=True)
        if not dst.staged and _overlaps(output, input):
            # MPI may not write where it still reads: receive into a copy
            dst = WireBuffer(output, reduce=True, read=False, write=True, cuda_aware=self.cuda_aware, copy=True)
        self._scatters.remember(output, input, dst, src)
        send, recv, mpi_op = src.spec(), dst.spec(), _MPI_OPS[op]
        divide = self.size if op == ReduceOp.AVG else None
        return self._run("reduce_scatter", async_op,
                         lambda: self.comm.Reduce_scatter_block(send, recv, mpi_op),
                         lambda: self.comm.Ireduce_scatter_block(send, recv, mpi_op),
                         [src, dst], lambda: dst.finish(divide))

    # -- data movement -----------------------------------------------------
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        # A remembered pair goes straight to MPI, written inline as in
        # all_reduce (``PairCache.get`` has the same checks).
        hit = self._gather_entries.get((id(output), id(input)))
        if (hit is not None and hit.out_address == output.data_ptr() and hit.in_address == input.data_ptr()
                and hit.out_nbytes == output.nbytes and hit.in_nbytes == input.nbytes
                and output.is_contiguous() and input.is_contiguous()):
            try:
                if async_op:
                    request = self.comm.Iallgather(hit.send, hit.recv)
                    return MpiWork("all_gather", self.group.name, [request], [output, input], _nothing)
                self.comm.Allgather(hit.send, hit.recv)
            except MPI.Exception as error:
                raise as_comm_error("all_gather", self.group.name, error) from error
            return _DONE
        check_all_gather(output, input, self.size)
        if self.check_shapes:
            agree.check_same(self.comm, "all_gather", self.group.name, dtype=str(input.dtype), numel=input.numel())
        dst = self._buffer(output, write=True)
        buffers = [dst]
        slot = self.rank * input.numel() * input.element_size()
        src: Optional[WireBuffer] = None
        if (not dst.staged and input.is_contiguous() and input.numel()
                and input.data_ptr() == output.data_ptr() + slot):
            send: object = MPI.IN_PLACE  # input already sits in this rank's slot of the output
        else:
            src = WireBuffer(input, reduce=False, read=True, write=False, cuda_aware=self.cuda_aware,
                             copy=not dst.staged and _overlaps(input, output))
            buffers.append(src)
            send = src.spec()
        self._gathers.remember(output, input, dst, src)
        recv = dst.spec()
        return self._run("all_gather", async_op,
                         lambda: self.comm.Allgather(send, recv),
                         lambda: self.comm.Iallgather(send, recv),
                         buffers, dst.finish)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Optional[Sequence[int]] = None,
                   input_splits: Optional[Sequence[int]] = None, async_op: bool = False):
        equal = output_splits is None and input_splits is None
        if equal:
            # a remembered pair goes straight to MPI, as in all_gather (shapes
            # compared, not sizes: the rows must still divide evenly)
            hit = self._exchange_entries.get((id(output), id(input)))
            if (hit is not None and hit.out_address == output.data_ptr() and hit.in_address == input.data_ptr()
                    and hit.out_shape == output.shape and hit.in_shape == input.shape
                    and output.is_contiguous() and input.is_contiguous()):
                try:
                    if async_op:
                        request = self.comm.Ialltoall(hit.send, hit.recv)
                        return MpiWork("all_to_all", self.group.name, [request], [output, input], _nothing)
                    self.comm.Alltoall(hit.send, hit.recv)
                except MPI.Exception as error:
                    raise as_comm_error("all_to_all", self.group.name, error) from error
                return _DONE
        check_all_to_all(output, input, output_splits, input_splits, self.size)
        row = _row_numel(input)
        if _row_numel(output) != row:
            raise CommError(f"all_to_all: input rows of shape {tuple(input.shape[1:])} and output rows of shape "
                            f"{tuple(output.shape[1:])} differ in size")
        send_rows = [int(s) for s in input_splits] if input_splits is not None else \
            [(input.shape[0] if input.dim() else 1) // self.size] * self.size
        recv_rows = [int(s) for s in output_splits] if output_splits is not None else \
            [(output.shape[0] if output.dim() else 1) // self.size] * self.size
        if self.check_shapes:
            agree.check_all_to_all(self.comm, "all_to_all", self.group.name, str(input.dtype), row,
                                   send_rows, recv_rows, equal)
        if (not equal and not self.check_shapes and output.device.type == "cpu" and input.device.type == "cpu"
                and output.numel() and input.numel() and output.is_contiguous() and input.is_contiguous()
                and not _overlaps(input, output)):
            # uneven splits (the MoE token path, several calls per layer): both
            # tensors are MPI buffers as they are, so skip the staging logic
            wire = transport_dtype(input.dtype)
            row_type = self._row_type(mpi_type(wire), row * (element_size(input.dtype) // element_size(wire)))
            send = [address_buffer(input), (send_rows, _displacements(send_rows)), row_type]
            recv = [address_buffer(output), (recv_rows, _displacements(recv_rows)), row_type]
            if async_op:
                with mpi_errors("all_to_all", self.group.name):
                    request = self.comm.Ialltoallv(send, recv)
                return MpiWork("all_to_all", self.group.name, [request], [output, input], _nothing)
            with mpi_errors("all_to_all", self.group.name):
                self.comm.Alltoallv(send, recv)
            return _DONE
        dst = self._buffer(output, write=True)
        src = WireBuffer(input, reduce=False, read=True, write=False, cuda_aware=self.cuda_aware,
                         copy=not dst.staged and _overlaps(input, output))
        per_element = element_size(input.dtype) // element_size(transport_dtype(input.dtype))
        if equal and max(send_rows[0], recv_rows[0]) * row * per_element <= _INT_MAX:
            # None on every rank (see the module docstring), so every rank
            # calls MPI_Alltoall, which is faster than Alltoallv
            self._exchanges.remember(output, input, dst, src)
            send, recv = src.spec(), dst.spec()
            return self._run("all_to_all", async_op,
                             lambda: self.comm.Alltoall(send, recv),
                             lambda: self.comm.Ialltoall(send, recv),
                             [src, dst], dst.finish)
        # one MPI element = one dim-0 row, in transport elements (the type is
        # made once per row shape and kept: an MoE layer exchanges the same
        # rows every micro-batch)
        row_type = self._row_type(dst.mpi_type, row * per_element)
        send = [src.array, (send_rows, _displacements(send_rows)), row_type]
        recv = [dst.array, (recv_rows, _displacements(recv_rows)), row_type]
        return self._run("all_to_all", async_op,
                         lambda: self.comm.Alltoallv(send, recv),
                         lambda: self.comm.Ialltoallv(send, recv),
                         [src, dst], dst.finish)

    def all_to_all_rows(self, output: torch.Tensor, input: torch.Tensor, rows: torch.Tensor,
                        output_splits: Sequence[int], input_splits: Sequence[int], async_op: bool = False):
        """``all_to_all(output, input[rows], ...)`` with no gathered copy: each
        destination's rows are one MPI indexed datatype over ``input`` (made per
        call, as the rows change with every routing; freed at once, which MPI
        allows while the call runs) in an ``Alltoallw``, so MPI packs them
        straight from ``input`` as it sends. Open MPI's shared-memory transport
        then moves each row once instead of twice (``index_select`` into a send
        buffer, then the buffer). Every rank must call the same MPI collective,
        so only what is the same on all of them (``check_shapes``, the device)
        chooses ``all_to_all`` on gathered rows instead; a view or an overlap on
        one rank is staged through a copy there."""
        check_rows(output, input, rows, output_splits, input_splits, self.size)
        if self.check_shapes or input.device.type != "cpu" or output.device.type != "cpu":
            return self.all_to_all(output, input.index_select(0, rows), output_splits, input_splits, async_op)
        row = _row_numel(input)
        source = input.clone() if _overlaps(input, output) else input.contiguous()
        target = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype)
        index = rows.tolist()
        wire = transport_dtype(input.dtype)
        row_type = self._row_type(mpi_type(wire), row * (element_size(input.dtype) // element_size(wire)))
        types, counts, made, at = [], [], [], 0
        for count in input_splits:
            if count:
                made.append(row_type.Create_indexed_block(1, index[at:at + count]).Commit())
                types.append(made[-1])
            else:
                types.append(row_type)
            counts.append(1 if count else 0)
            at += count
        recv_rows = [int(c) for c in output_splits]
        starts = _displacements(recv_rows)
        if target.nbytes <= _BYTE_DISPLACEMENT_MAX:  # Alltoallw's displacements are bytes, in C ints
            row_bytes = output.element_size() * row
            recv = [_any_buffer(target), (recv_rows, [d * row_bytes for d in starts]), [row_type] * self.size]
        else:  # each source's block as a type placed in rows (a local choice: the signatures still match)
            placed = [row_type.Create_indexed_block(c, [d]).Commit() if c else row_type
                      for c, d in zip(recv_rows, starts)]
            made += [t for t, c in zip(placed, recv_rows) if c]
            recv = [_any_buffer(target), ([1 if c else 0 for c in recv_rows], [0] * self.size), placed]
        send = [_any_buffer(source), (counts, [0] * self.size), types]
        land = _nothing if target is output else (lambda: output.copy_(target))
        try:
            with mpi_errors("all_to_all", self.group.name):
                if async_op:
                    request = self.comm.Ialltoallw(send, recv)
                    return MpiWork("all_to_all", self.group.name, [request], [target, source], land)
                self.comm.Alltoallw(send, recv)
        finally:
            for t in made:
                t.Free()
        land()
        return _DONE

    def _row_type(self, base: MPI.Datatype, count: int) -> MPI.Datatype:
        key = (base.handle, count)
        found = self._row_types.get(key)
        if found is None:
            found = self._row_types[key] = base.Create_contiguous(count).Commit()
        return found

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        self._check_peer(src, "broadcast")
        if self.check_shapes:
            agree.check_same(self.comm, "broadcast", self.group.name, dtype=str(tensor.dtype),
                             numel=tensor.numel(), src=src)
        is_root = self.rank == src
        buf = self._buffer(tensor, read=is_root, write=not is_root)
        spec = buf.spec()
        return self._run("broadcast", async_op,
                         lambda: self.comm.Bcast(spec, root=src),
                         lambda: self.comm.Ibcast(spec, root=src),
                         [buf], buf.finish)

    # -- point to point ----------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._check_peer(dst, "send")
        self._check_tag(tag, "send")
        buf = self._buffer(tensor, read=True)
        with mpi_errors("send", self.group.name):
            self.comm.Send(buf.spec(), dest=dst, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._check_peer(src, "recv")
        self._check_tag(tag, "recv")
        buf = self._buffer(tensor, write=True)
        with mpi_errors("recv", self.group.name, hint="the message is larger than the receive tensor"):
            self.comm.Recv(buf.spec(), source=src, tag=tag)
        buf.finish()

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> List[Work]:
        works: List[Work] = []
        for op in ops:
            self._check_peer(op.peer, f"batch_isend_irecv {op.kind}")
            self._check_tag(op.tag, f"batch_isend_irecv {op.kind}")
            is_send = op.kind == "send"
            buf = self._buffer(op.tensor, read=is_send, write=not is_send)
            with mpi_errors(f"i{op.kind}", self.group.name):
                request = (self.comm.Isend(buf.spec(), dest=op.peer, tag=op.tag) if is_send
                           else self.comm.Irecv(buf.spec(), source=op.peer, tag=op.tag))
            works.append(MpiWork(f"i{op.kind}", self.group.name, [request], [buf], buf.finish))
        return works

    def barrier(self) -> None:
        with mpi_errors("barrier", self.group.name):
            self.comm.Barrier()
