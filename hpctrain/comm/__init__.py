"""Communication: the Communicator protocol every backend plugin implements."""
from hpctrain.comm.protocol import (  # noqa: F401
    Communicator,
    CompletedWork,
    LocalCommunicator,
    P2POp,
    ReduceOp,
    Work,
    check_all_gather,
    check_all_to_all,
    check_reduce_scatter,
)
