"""debug.comm_delay_*: the communicator of a group spanning the slowed axis waits before every operation,
and still does the operation; other groups are untouched."""
import time

import torch

from hpctrain.comm.delay import DelayedCommunicator, delayed
from hpctrain.comm.protocol import LocalCommunicator
from hpctrain.mesh import AXES, Mesh
from hpctrain.run import backend_factory


class _Recorder(LocalCommunicator):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv",
                    "batch_isend_irecv", "barrier"):
            super().__getattribute__("calls").append(name)
        return attr


def test_every_operation_waits_then_runs():
    inner = _Recorder()
    comm = DelayedCommunicator(inner, 0.02)
    t = torch.ones(4)
    ops = [lambda: comm.all_reduce(t), lambda: comm.all_gather(torch.empty(4), t),
           lambda: comm.reduce_scatter(torch.empty(4), t), lambda: comm.all_to_all(torch.empty(4), t),
           lambda: comm.broadcast(t, 0), lambda: comm.barrier()]
    for op in ops:
        t0 = time.perf_counter()
        op()
        assert time.perf_counter() - t0 >= 0.02
    assert inner.calls == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier"]
    assert comm.size == inner.size and comm.rank == inner.rank and comm.backend == inner.backend
    assert torch.equal(t, torch.ones(4))  # the operation itself is the inner one's (one rank: unchanged)
    t0 = time.perf_counter()
    assert comm.batch_isend_irecv([]) == inner.batch_isend_irecv([])
    assert time.perf_counter() - t0 >= 0.02


def test_only_groups_spanning_the_axis_are_wrapped():
    inner = LocalCommunicator()
    assert delayed(inner, ("tp", "dp"), "dp", 5.0).seconds == 0.005
    assert delayed(inner, ("tp",), "dp", 5.0) is inner
    assert delayed(inner, ("dp",), "none", 5.0) is inner
    assert delayed(inner, ("dp",), "dp", 0.0) is inner


class _Plugins:
    """A plugin manager whose backend hook hands out local communicators."""

    class hook:
        @staticmethod
        def hpctrain_make_backend(name, group, cfg):
            return LocalCommunicator()


def test_backend_factory_applies_the_debug_keys(make_config):
    cfg = make_config("comm.backend=torch", "debug.comm_delay_axis=dp", "debug.comm_delay_ms=3")
    mesh = Mesh({"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 1}, 0, 4)
    make = backend_factory(cfg, _Plugins(), torch.device("cpu"))
    assert isinstance(make(mesh.group("dp")), DelayedCommunicator)
    assert isinstance(make(mesh.group(AXES)), DelayedCommunicator)  # the world crosses dp too
    assert not isinstance(make(mesh.group("tp")), DelayedCommunicator)
