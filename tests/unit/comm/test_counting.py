"""Bus bytes (nccl-tests convention) counted by the wrapper every group's communicator gets."""
import pytest
import torch

from hpctrain.comm.counting import CountingCommunicator, unwrap
from hpctrain.comm.protocol import CompletedWork, P2POp


class Quiet:
    """A stand-in backend of ``size`` ranks that moves nothing."""

    backend = "quiet"

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank

    def __getattr__(self, name):
        return lambda *a, **k: [CompletedWork()] if name == "batch_isend_irecv" else CompletedWork()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_each_op_counts_what_one_rank_sends_on_a_ring(n):
    c = CountingCommunicator(Quiet(n, rank=1))
    x = torch.zeros(n * 16)  # 64n bytes
    c.all_reduce(x)
    c.all_gather(torch.zeros(n * 16), torch.zeros(16))
    c.reduce_scatter(torch.zeros(16), torch.zeros(n * 16))
    c.all_to_all(torch.zeros(n * 16), x)
    c.broadcast(x, src=0)
    s = 64 * n
    assert c.counter.by_op == pytest.approx({
        "all_reduce": 2 * (n - 1) / n * s, "all_gather": (n - 1) / n * s, "reduce_scatter": (n - 1) / n * s,
        "all_to_all": (n - 1) / n * s, "broadcast": s})
    assert c.counter.calls == 5 and c.counter.bytes == pytest.approx(sum(c.counter.by_op.values()))


def test_uneven_all_to_all_counts_the_rows_sent_to_others_and_p2p_counts_sends():
    c = CountingCommunicator(Quiet(3, rank=1))
    rows = torch.zeros(7, 2, dtype=torch.float64)  # 16 bytes a row
    c.all_to_all(torch.zeros(5, 2, dtype=torch.float64), rows, output_splits=[1, 2, 2], input_splits=[3, 4, 0])
    assert c.counter.by_op == {"all_to_all": (7 - 4) * 16}  # its own 4 rows stay home
    c.batch_isend_irecv([P2POp("send", torch.zeros(10), 2), P2POp("recv", torch.zeros(10), 0)])
    c.send(torch.zeros(2, dtype=torch.bfloat16), 0)
    c.recv(torch.zeros(99), 0)
    assert c.counter.by_op["send"] == 40 + 4
    assert unwrap(c).backend == "quiet" and c.backend == "quiet"


def test_all_to_all_rows_counts_the_indexed_rows_sent_to_others():
    c = CountingCommunicator(Quiet(3, rank=1))
    source = torch.zeros(2, 4)  # 16 bytes a row, picked 7 times
    picks = torch.tensor([0, 1, 1, 0, 0, 1, 1])
    c.all_to_all_rows(torch.zeros(5, 4), source, picks, output_splits=[1, 2, 2], input_splits=[3, 4, 0])
    assert c.counter.by_op == {"all_to_all": (7 - 4) * 16}  # the 4 rows for itself stay home
