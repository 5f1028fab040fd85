"""Communicator over a torch.distributed process group.

Backend names: ``torch`` (nccl when the run's device is CUDA, else gloo),
``gloo``, ``nccl``. The default process group is created on first use by the
core's MPI rendezvous (``hpctrain.bootstrap.init_torch_distributed``).
Sub-groups are created for every group of an axis at once
(``new_subgroups_by_enumeration``), which is collective over the world, and
cached by their rank partition, so building several meshes in one process
(tests) does not leak process groups.

gloo lacks some operations in some torch versions; they are composed from
ones it has, with the same result: AVG is SUM then divide; where gloo has
no ``reduce_scatter_tensor`` (older torch) reduce_scatter is an all-reduce
then the local chunk, and where it has no ``all_gather_into_tensor`` the
list all_gather. Whether it has them is found by the first call (the same
failure on every rank, before anything is sent) and remembered.
On gloo, float16/bfloat16 reductions run on a float32 copy and are rounded
once (gloo itself adds in 16 bits), matching the mpi and hier backends;
nccl reduces 16-bit floats natively.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hpctrain.comm.protocol import (
    CompletedWork,
    P2POp,
    ReduceOp,
    accumulation_dtype,
    check_all_gather,
    check_all_to_all,
    check_reduce_scatter,
)
from hpctrain.errors import CommError
from hpctrain.mesh import Group

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.AVG: dist.ReduceOp.SUM}
_FLAT_OPS = {"all_gather": True, "reduce_scatter": True}
# newer torch renamed the flat-tensor collectives (the old names warn); the same operations
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""Whether gloo takes the flat-tensor forms (set False when a first call finds it does not)."""
_GROUP_CACHE: Dict[Tuple[str, Tuple[Tuple[int, ...], ...]], List[dist.ProcessGroup]] = {}


def _copy_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.detach().copy_(src)


class _TorchWork:
    """Wraps a torch Work; runs ``then`` (e.g. the AVG division) after wait."""

    def __init__(self, work, then=None):
        self._work, self._then, self._done = work, then, False

    def wait(self) -> None:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._then is not None:
                self._then()
            self._done = True

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed() and self._then is None)


def _finish(work, async_op: bool, then=None):
    w = _TorchWork(work, then)
    if not async_op:
        w.wait()
        return CompletedWork()
    return w


def process_group_for(group: Group, backend: str) -> dist.ProcessGroup:
    key = (backend, group.partition)
    if key not in _GROUP_CACHE:
        _, subgroups = dist.new_subgroups_by_enumeration([list(r) for r in group.partition], backend=backend)
        _GROUP_CACHE[key] = subgroups
    index = next(i for i, ranks in enumerate(group.partition) if ranks == group.ranks)
    return _GROUP_CACHE[key][index]


class TorchCommunicator:
    def __init__(self, group: Group, backend: str):
        self.group = group
        self.backend = backend
        self.rank = group.rank
        self.size = group.size
        self.pg = process_group_for(group, backend)
        self._ranks = group.ranks

    # -- reductions ------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
        op = ReduceOp(op)
        # gloo adds 16-bit floats in 16 bits (a rounding per addition): reduce a
        # float32 copy and round once, like the other backends. A strided
        # tensor is reduced through a contiguous copy (gloo silently
        # mis-reduces non-dense views).
        wire_dtype = tensor.dtype if self.backend == "nccl" else accumulation_dtype(tensor.dtype)
        if wire_dtype != tensor.dtype or not tensor.is_contiguous():
            wide = torch.empty(tensor.shape, dtype=wire_dtype, device=tensor.device)
            wide.copy_(tensor.detach())
            work = dist.all_reduce(wide, op=_TORCH_OPS[op], group=self.pg, async_op=True)

            def narrow():
                if op == ReduceOp.AVG:
                    wide.div_(self.size)
                with torch.no_grad():
                    tensor.copy_(wide)

            return _finish(work, async_op, narrow)
        work = dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self.pg, async_op=True)
        then = (lambda: tensor.div_(self.size)) if op == ReduceOp.AVG else None
        return _finish(work, async_op, then)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        check_all_gather(output, input, self.size)
        if self.backend == "nccl" or _FLAT_OPS["all_gather"]:
            flat = output if output.is_contiguous() else torch.empty(output.shape, dtype=output.dtype,
                                                                     device=output.device)
            try:
                work = _ALL_GATHER_FLAT(flat.view(-1), input.contiguous().view(-1), group=self.pg,
                                                   async_op=True)
            except (RuntimeError, NotImplementedError):
                if self.backend == "nccl":
                    raise
                _FLAT_OPS["all_gather"] = False
            else:
                then = None if flat is output else (lambda: output.copy_(flat))
                return _finish(work, async_op, then)
        staging = [torch.empty_like(input.reshape(-1)) for _ in range(self.size)]
        work = dist.all_gather(staging, input.contiguous().view(-1), group=self.pg, async_op=True)

        def place():
            with torch.no_grad():
                if output.is_contiguous():
                    torch.stack(staging, out=output.view(self.size, -1))
                else:  # a strided output: copy_ follows its strides
                    output.copy_(torch.stack(staging).view(output.shape))

        return _finish(work, async_op, place)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False):
        check_reduce_scatter(output, input, self.size)
        op = ReduceOp(op)
        if self.backend == "nccl":
            work = _REDUCE_SCATTER_FLAT(output.view(-1), input.contiguous().view(-1), op=_TORCH_OPS[op],
                                              group=self.pg, async_op=True)
            then = (lambda: output.div_(self.size)) if op == ReduceOp.AVG else None
            return _finish(work, async_op, then)
        # contiguous, in float32 for 16-bit floats as in all_reduce (a copy only when needed)
        acc = accumulation_dtype(input.dtype)
        if input.is_contiguous() and input.dtype == acc:
            full = input.detach().view(-1)
        else:
            full = torch.empty(input.shape, dtype=acc, device=input.device)
            full.copy_(input.detach())
            full = full.view(-1)
        if _FLAT_OPS["reduce_scatter"]:
            mine = output.view(-1) if output.is_contiguous() and output.dtype == acc else \
                torch.empty(output.numel(), dtype=acc, device=output.device)
            try:
                work = _REDUCE_SCATTER_FLAT(mine, full, op=_TORCH_OPS[op], group=self.pg, async_op=True)
            except (RuntimeError, NotImplementedError):
                _FLAT_OPS["reduce_scatter"] = False
            else:
                def land():
                    if op == ReduceOp.AVG:
                        mine.div_(self.size)
                    if mine.data_ptr() != output.data_ptr():
                        with torch.no_grad():
                            output.copy_(mine.view(output.shape))

                return _finish(work, async_op, land)
        if full.data_ptr() == input.data_ptr():  # the all-reduce below works in place: never on the caller's input
            full = full.clone()
        work = dist.all_reduce(full, op=_TORCH_OPS[op], group=self.pg, async_op=True)

        def take():
            chunk = full.view(self.size, -1)[self.rank]
            with torch.no_grad():
                output.copy_((chunk / self.size if op == ReduceOp.AVG else chunk).view(output.shape))

        return _finish(work, async_op, take)

    def all_to_all(self, output, input, output_splits: Optional[Sequence[int]] = None,
                   input_splits: Optional[Sequence[int]] = None, async_op: bool = False):
        check_all_to_all(output, input, output_splits, input_splits, self.size)
        contiguous_out = (output if output.is_contiguous()
                          else torch.empty_like(output, memory_format=torch.contiguous_format))
        work = dist.all_to_all_single(
            contiguous_out, input.contiguous(),
            output_split_sizes=list(output_splits) if output_splits is not None else None,
            input_split_sizes=list(input_splits) if input_splits is not None else None,
            group=self.pg, async_op=True,
        )
        then = None if contiguous_out is output else (lambda: output.copy_(contiguous_out))
        return _finish(work, async_op, then)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        self._check_peer(src)
        if tensor.is_contiguous():
            return _finish(dist.broadcast(tensor, src=self._ranks[src], group=self.pg, async_op=True), async_op)
        staged = tensor.contiguous()  # gloo silently mis-broadcasts non-dense views

        def land():
            if self.rank != src:
                with torch.no_grad():
                    tensor.copy_(staged)

        return _finish(dist.broadcast(staged, src=self._ranks[src], group=self.pg, async_op=True), async_op, land)

    # -- point to point --------------------------------------------------
    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise CommError(f"peer {peer} is outside group {self.group.name} of size {self.size}")

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._check_peer(dst)
        dist.send(tensor.contiguous(), dst=self._ranks[dst], group=self.pg, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._check_peer(src)
        landing = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        dist.recv(landing, src=self._ranks[src], group=self.pg, tag=tag)
        if landing is not tensor:  # torch receives into contiguous memory only
            with torch.no_grad():
                tensor.copy_(landing)

    def batch_isend_irecv(self, ops: Sequence[P2POp]):
        if not ops:
            return []
        torch_ops, thens = [], []
        for op in ops:
            self._check_peer(op.peer)
            buf, then = op.tensor, None
            if not buf.is_contiguous():  # torch moves contiguous memory only: stage, copy back after a recv
                buf = buf.contiguous()
                if op.kind == "recv":
                    then = functools.partial(_copy_back, op.tensor, buf)
            fn = dist.isend if op.kind == "send" else dist.irecv
            torch_ops.append(dist.P2POp(fn, buf, self._ranks[op.peer], group=self.pg, tag=op.tag))
            thens.append(then)
        return [_TorchWork(w, then) for w, then in zip(dist.batch_isend_irecv(torch_ops), thens)]

    def barrier(self) -> None:
        dist.barrier(group=self.pg)
