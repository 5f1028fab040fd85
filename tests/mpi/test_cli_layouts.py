"""The issue's layout commands, ``mpiexec -n 4 hpctrain-train parallel...``,
run as ``hpctrain-train``'s ``main`` in this session's four ranks
(tests/mpi/cli_session.py; formerly real 4-rank launches in
tests/launch/test_launchers.py): each logs the same per-step losses as one
process (fp32; 1e-6 relative: only the order of the sums differs) and
counts its communication on the axes it uses. The one-process reference is
``PARITY_RUN``'s, computed once per session (tests/mpi/parity.py)."""
import pytest
from cli_session import metrics, train

from parity import shared_reference

pytestmark = pytest.mark.mpi(min_size=4)

PARITY_RUN = ["trainer.steps=3", "trainer.log_every=3", "trainer.progress=off"]


@pytest.fixture
def one_process_losses(world):
    if world.Get_size() != 4:
        pytest.skip("the commands name 4 ranks")
    return [r.loss for r in shared_reference(("trainer.steps=3",), 3)]


@pytest.mark.parametrize("dp,ep", [(2, 2), (1, 4)], ids=["dp2-ep2", "dp1-ep4"])
def test_expert_ranks_are_data_parallel_on_a_dense_model(world, capfd, shared_tmp, one_process_losses, dp, ep):
    """``mpiexec -n 4 hpctrain-train parallel.dp=2 parallel.ep=2`` and
    ``parallel.dp=1 parallel.ep=4`` on the dense tiny model."""
    j = train(world, capfd, [*PARITY_RUN, f"parallel.dp={dp}", f"parallel.ep={ep}"], shared_tmp, quiet=[])
    assert j.codes == [0] * 4, j.out
    got = metrics(shared_tmp)
    assert [m["loss"] for m in got] == pytest.approx(one_process_losses, rel=1e-6)
    assert all(m[f"comm_bytes.{'ep+dp' if dp > 1 else 'ep'}"] > 0 for m in got)


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=4", "parallel.sequence_parallel=false"]],
                         ids=["tp2", "tp4"])
def test_tensor_parallel_from_the_command_line(world, capfd, shared_tmp, one_process_losses, layout):
    """``mpiexec -n 4 hpctrain-train parallel.tp=2`` (tp 2 x dp 2, sequence
    parallel) and ``parallel.tp=4 parallel.sequence_parallel=false``."""
    j = train(world, capfd, [*PARITY_RUN, *layout], shared_tmp, quiet=[])
    assert j.codes == [0] * 4, j.out
    got = metrics(shared_tmp)
    assert [m["loss"] for m in got] == pytest.approx(one_process_losses, rel=1e-6)
    assert all(m["comm_bytes.tp"] > 0 for m in got)
