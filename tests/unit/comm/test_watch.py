"""The numbering and wait records the hang watchdog reads (hpctrain.comm.watch),
through the wrapper every group's communicator gets."""
import torch

from hpctrain.comm.counting import CountingCommunicator
from hpctrain.comm.protocol import CompletedWork, P2POp
from hpctrain.comm.watch import OpBoard


class Spy:
    """A stand-in backend that records what the board says while it is inside a call."""

    backend = "spy"

    def __init__(self, board, size=4, rank=1):
        self.board, self.size, self.rank = board, size, rank
        self.seen = []

    def _call(self, *a, **k):
        self.seen.append(self.board.waiting)
        return SpyWork(self)

    all_reduce = all_gather = reduce_scatter = all_to_all = broadcast = send = recv = barrier = _call

    def batch_isend_irecv(self, ops):
        return [SpyWork(self) for _ in ops]


class SpyWork(CompletedWork):
    def __init__(self, backend):
        self.backend = backend

    def wait(self):
        self.backend.seen.append(self.backend.board.waiting)


def test_collectives_are_numbered_per_group_and_blocking_calls_recorded():
    board = OpBoard()
    dp = CountingCommunicator(Spy(board), board, "dp", (0, 2, 4, 6))
    tp = CountingCommunicator(Spy(board), board, "tp", (2, 3))
    x = torch.zeros(8)
    dp.all_reduce(x)
    tp.all_gather(torch.zeros(16), x)
    dp.barrier()
    assert board.issued == {"dp": 2, "tp": 1} and board.last_op == ("barrier", "dp", 2)
    first, _ = dp.inner.seen
    assert (first.op, first.group, first.seq, first.members) == ("all_reduce", "dp", 1, (0, 2, 4, 6))
    assert tp.inner.seen[0].seq == 1 and board.waiting is None


def test_an_async_collective_is_issued_at_once_and_waited_in_wait():
    board = OpBoard()
    dp = CountingCommunicator(Spy(board), board, "dp", (0, 1, 2, 3))
    work = dp.reduce_scatter(torch.zeros(2), torch.zeros(8), async_op=True)
    assert board.issued == {"dp": 1} and dp.inner.seen == [None]  # issued, not blocked
    work.wait()
    assert dp.inner.seen[-1].op == "reduce_scatter" and dp.inner.seen[-1].seq == 1 and board.waiting is None


def test_point_to_point_waits_name_the_peer_by_world_rank():
    board = OpBoard()
    pp = CountingCommunicator(Spy(board, size=2, rank=0), board, "pp", (3, 7))
    pp.recv(torch.zeros(2), src=1)
    works = pp.batch_isend_irecv([P2POp("send", torch.zeros(2), 1), P2POp("recv", torch.zeros(2), 1)])
    for w in works:
        w.wait()
    waits = pp.inner.seen
    assert [(w.op, w.seq, w.members) for w in waits] == [("recv", None, (7,)), ("send", None, (7,)),
                                                          ("recv", None, (7,))]
    assert "pp" not in board.issued  # point-to-point does not advance the collective count


def test_a_marked_region_counts_as_one_op_and_nested_waits_restore_it():
    board = OpBoard()
    dp = CountingCommunicator(Spy(board), board, "dp", (0, 1))
    with board.collective("checkpoint save", "checkpoint", (0, 1)):
        assert board.waiting.op == "checkpoint save" and board.waiting.seq == 1
        dp.all_reduce(torch.zeros(1))
        assert board.waiting.op == "checkpoint save"
    assert board.waiting is None and board.issued == {"checkpoint": 1, "dp": 1}
