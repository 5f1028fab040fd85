"""The collective operators (``hpctrain.comm.ops``) pass torch's own operator
checks: schema, fake implementation against the real output (shape, strides,
dtype), autograd registration and AOTAutograd tracing (``torch.library.opcheck``),
on a group of two ranks seen from rank 0 whose communicator is the recording
backend's (it moves nothing, and gives each result what it would be if every
rank held this rank's values). And the registry of groups by key."""
from __future__ import annotations

import pytest
import torch

from hpctrain.comm import ops
from hpctrain.errors import CommError
from hpctrain.mesh import Group


def _group(name: str = "tp") -> Group:
    from hpctrain_comm_record.communicator import RecordingCommunicator

    group = Group(name, (0, 1), 0, ((0, 1),), ("tp",))
    group.comm = RecordingCommunicator(group)
    return group


GROUP = _group()
KEY = ops.group_key(GROUP)
X = torch.randn(2, 4, 6, requires_grad=True)

CASES = {
    "all_reduce": (ops.all_reduce, (X.detach(), KEY, "max")),
    "all_gather": (ops.all_gather, (X.detach(), KEY, 1, False)),
    "all_gather again": (ops.all_gather, (X.detach(), KEY, 2, True)),
    "reduce_scatter": (ops.reduce_scatter, (X.detach(), KEY, 1)),
    "all_to_all": (ops.all_to_all, (X.detach(), KEY, None, None)),
    "all_to_all splits": (ops.all_to_all, (X.detach(), KEY, [1, 1], [1, 1])),
    "reduce_from_region": (ops.reduce_from_region, (X, KEY)),
    "scatter_to_region": (ops.scatter_to_region, (X, KEY, 2)),
    "gather_from_region": (ops.gather_from_region, (X, KEY, 2)),
    "gather_from_sequence_region": (ops.gather_from_sequence_region, (X, KEY, 1)),
    "reduce_scatter_to_sequence_region": (ops.reduce_scatter_to_sequence_region, (X, KEY, 1)),
    "all_to_all_region": (ops.all_to_all_region, (X, KEY, [1, 1], [1, 1])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_operator_passes_torch_opcheck(name):
    op, args = CASES[name]
    torch.library.opcheck(op, args)


def test_ring_shift_fake_matches_its_shape():
    # (the recording backend's receive leaves its buffer as it is: values are not compared)
    torch.library.opcheck(ops.ring_shift_region, (X, KEY, 1), test_utils=("test_schema", "test_faketensor",
                                                                         "test_autograd_registration"))


def test_region_gradients_are_the_conjugate_collectives():
    # with every rank holding this rank's values: a gather's gradient is this rank's chunk of it,
    # a reduce-scatter's the gradient gathered (repeated)
    x = X.detach().clone().requires_grad_(True)
    g = torch.randn(2, 8, 6)
    ops.gather_from_sequence_region(x, KEY, 1).backward(g)  # bwd reduce-scatter: rank 0's chunk
    torch.testing.assert_close(x.grad, g[:, :4])
    x.grad = None
    ops.reduce_scatter_to_sequence_region(x, KEY, 1).backward(g[:, :2])  # bwd all-gather: repeated
    torch.testing.assert_close(x.grad, torch.cat([g[:, :2], g[:, :2]], dim=1))


def test_group_keys_are_unique_and_looked_up():
    other = _group()
    assert ops.group_key(GROUP) == KEY != ops.group_key(other)
    assert ops.group_of(KEY) is GROUP and ops.group_of(ops.group_key(other)) is other
    with pytest.raises(CommError, match="no group registered as 'nope'"):
        ops.group_of("nope")
