"""What a user sees when the command line or the checkpoint does not fit the
run, as ``mpiexec -n 2 hpctrain-train ...`` shows it, run in this session's
ranks (tests/mpi/cli_session.py): one ``hpctrain: error:`` line (a few for a
checkpoint of another model), exit status 2 on every rank, no traceback, no
hang. (Formerly real launches in tests/launch/test_launchers.py,
test_messages.py and test_logger_start.py; what needs a fresh job stays
there.)

The checkpoint cases share one checkpoint directory (the tiny model, global
batch 16, steps 2 and 4) made once for the module."""
import os

import pytest
from cli_session import metrics, train

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def job(world, capfd, monkeypatch, shared_tmp):
    """``job(*overrides)``: hpctrain-train in this session's ranks, run directory in shared_tmp."""
    monkeypatch.chdir(shared_tmp)
    return lambda *args, run_dir=shared_tmp, **kw: train(world, capfd, args, run_dir, **kw)


def _no_traceback(j):
    assert "Traceback" not in j.out, j.out


def test_bad_layout_one_line_every_rank_exits(job, world, shared_tmp):
    j = job("parallel.dp=3")
    assert all(c != 0 for c in j.codes), j.codes
    n = world.Get_size()
    assert j.errors() == [f"tp(1) * cp(1) * ep(1) * dp(3) * pp(1) = 3 != world size {n}; "
                          "launch 3 ranks or set parallel.dp=-1"], j.out
    _no_traceback(j)
    assert not os.path.exists(f"{shared_tmp}/metrics.jsonl")


def test_several_problems_reported_together(job, shared_tmp):
    j = job("trainer.global_batch_size=10", "trainer.micro_batch_size=2", "data=tokens",
            f"data.path={shared_tmp}/nope.bin", quiet=[])
    assert j.codes == [2] * len(j.codes), j.out
    errors = j.errors()
    assert len(errors) == 2, j.out
    assert "not divisible by dp(2) x trainer.micro_batch_size(2)" in errors[0]
    assert "does not exist" in errors[1] and "hpctrain-prepare" in errors[1]
    _no_traceback(j)


def test_unknown_preset_under_mpi_does_not_hang(job):
    j = job("model=gpt5", quiet=[])
    assert j.codes == [2] * len(j.codes), j.out
    lines = j.errors()
    assert len(lines) == 1 and "model=gpt5: there is no preset 'gpt5'" in lines[0] and "tiny" in lines[0], j.out


@pytest.mark.parametrize("override,expected", [
    ("optim.lr=abc", "optim.lr='abc': must be a number (float), e.g. optim.lr=0.003"),
    ("trainer.steps=1.5", "trainer.steps=1.5: must be an integer (int), e.g. trainer.steps=40"),
    ("trainer.stepz=3", "trainer.stepz is not a config key (trainer has no 'stepz'); did you mean trainer.steps?"),
])
def test_a_wrong_type_or_unknown_key_is_one_line_and_status_2_on_every_rank(job, override, expected):
    j = job(override)
    assert j.codes == [2] * len(j.codes), j.out
    assert j.errors() == [expected], j.out
    assert "Traceback" not in j.out and "full_key" not in j.out and "HYDRA_FULL_ERROR" not in j.out, j.out


def test_a_diverged_run_stops_with_one_line_and_status_3(job, shared_tmp):
    """optim.lr=1e6: the gradient norm is NaN at step 2 on every rank; the
    job ends with exit status 3, one error line from rank 0, no traceback,
    and its checkpoints (every step) hold only finite steps."""
    j = job("optim.lr=1e6", "trainer.steps=6", "checkpoint.every=1", f"checkpoint.dir={shared_tmp}/ckpt",
            quiet=["trainer.progress=off"])
    assert j.codes == [3] * len(j.codes), j.out
    errors = j.errors()
    assert len(errors) == 1 and "step 2:" in errors[0] and "not all finite" in errors[0], j.out
    _no_traceback(j)
    assert [m["step"] for m in metrics(shared_tmp)] == [1]
    assert sorted(p for p in os.listdir(f"{shared_tmp}/ckpt") if p.endswith(".h5")) == ["step_00000001.h5"]


def test_an_unwritable_tensorboard_directory_stops_every_rank_before_step_1(job, world, shared_tmp):
    run = os.path.join(shared_tmp, "run")
    if world.Get_rank() == 0:  # (the others see it after the command's barrier)
        os.makedirs(run)
        with open(os.path.join(run, "tensorboard"), "w") as f:
            f.write("a file where the event directory goes")
    j = job("logging.backends=[jsonl,tensorboard]", "trainer.steps=2", run_dir=run)
    assert j.codes == [2] * len(j.codes), j.out
    (line,) = j.errors()
    assert line.startswith("logging.backends: the 'tensorboard' logger could not start: "), j.out
    assert line.endswith("fix it or remove tensorboard from logging.backends"), j.out
    assert "Traceback" not in j.out and "step 1/2" not in j.out, j.out
    assert metrics(run) == []  # opened (jsonl comes first), closed, never written
    assert os.path.exists(os.path.join(run, "metrics.jsonl"))


def test_a_backend_no_plugin_provides_is_refused(job):
    j = job("logging.backends=[jsonl,neptune]")
    assert j.codes == [2] * len(j.codes) and j.errors() == [
        "logging.backends: 'neptune' is not provided by any installed plugin; choose from jsonl, mlflow, "
        "tensorboard, wandb, or install the logger plugin that provides it"], j.out
