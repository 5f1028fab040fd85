"""``mpiexec -n 8 hpctrain-parity --steps 2 parallel=3d ...``, run as
``hpctrain-parity``'s ``main`` in this session's eight ranks
(tests/mpi/cli_session.py; formerly a real 8-rank launch in
tests/launch/test_layout_commands.py): the README's 3D preset trains what one
process trains, exit 0 and an OK line. (A broken plugin failing it:
tests/mpi/test_parity_command.py.)"""
import pytest
from cli_session import command, run_main

SMALL = ["trainer.global_batch_size=8", "trainer.micro_batch_size=1", "trainer.seq_len=32"]


@pytest.mark.mpi(min_size=8)
def test_parity_command_passes_the_3d_preset(world, capfd):
    if world.Get_size() != 8:
        pytest.skip("tp 2 x dp 2 x pp 2")
    argv = ["--steps", "2", "parallel=3d", "model.n_layers=4", *SMALL]
    r = run_main(world, capfd, lambda: command("hpctrain-parity")(argv))
    assert r.codes == [0] * 8, r.out[-3000:]
    lines = r.outputs[0].splitlines()
    ok = [i for i, line in enumerate(lines) if line.startswith("OK: every step within tolerance")]
    assert ok, r.outputs[0][-3000:]
    assert [line.split()[0] for line in lines[ok[-1] - 2:ok[-1]]] == ["1", "2"], r.outputs[0][-3000:]
    assert "tp 2 x dp 2 x pp 2 (8 ranks) against one process" in r.out, r.out[-3000:]
