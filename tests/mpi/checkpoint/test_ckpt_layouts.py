"""Save on one layout, resume on another; bit-exact resume in new processes.

Runs at exactly 2 ranks (``run`` trains on the whole MPI world, so this job is
the dp2 layout); the 1-process and dp4 sides run as new processes started
from rank 0, concurrently. One module fixture makes every run once:

    A  dp2 here             20 steps, checkpoints at 10 and 20
    C  dp2, new processes   resume A@10 -> 20, checkpoint at 20   bit-exact vs A
    E  1 process            resume A@10 -> 20, checkpoint at 15   dp2 -> 1   vs A
    F  dp4                  resume A@10 -> 20, checkpoint at 15   dp2 -> dp4 vs A
    H  dp2 here             resume E@15 -> 20                     1 -> dp2   vs E
    I  dp2 here             resume F@15 -> 20                     dp4 -> dp2 vs F

Tolerance across layouts: a layout change reorders fp32 sums (the DP
all-reduce averages per-rank gradient sums that one process accumulates in
another order), so each step's update can differ in the last bits (~1e-7
relative); over 10 AdamW steps the losses stay far within 1e-5 relative,
while a wrong slice, optimizer state, LR step or data position moves the
loss by more than 1e-3. With the same layout the arithmetic is identical, so
the resumed losses and weights must be *exactly* equal.
"""
from __future__ import annotations

import os

import pytest
from mpi4py import MPI

from hpctrain.parity import on_rank0

from ckpt_helpers import BASE, assert_same_datasets, finish, launch, run_here

RTOL_LAYOUT = 1e-5
COMMON = ["trainer.steps=20", "checkpoint.keep=0"]


def _ck(d: str, run: str, step: int) -> str:
    return os.path.join(d, run, f"step_{step:08d}.h5")


@pytest.fixture(scope="module")
def runs(module_dir):
    comm, d = MPI.COMM_WORLD, module_dir
    if comm.Get_size() != 2:
        pytest.skip("the layout-pair runs need exactly 2 ranks (this job is the dp2 side)")
    out = {"A": run_here(COMMON + ["checkpoint.every=10", f"checkpoint.dir={d}/A"])}

    def new_processes():
        resume = BASE + COMMON + [f"checkpoint.resume={_ck(d, 'A', 10)}"]
        procs = {"C": launch(2, resume + ["checkpoint.every=10", f"checkpoint.dir={d}/C"], f"{d}/runC"),
                 "E": launch(1, resume + ["checkpoint.every=5", f"checkpoint.dir={d}/E"], f"{d}/runE"),
                 "F": launch(4, resume + ["checkpoint.every=5", f"checkpoint.dir={d}/F"], f"{d}/runF")}
        return {k: finish(p) for k, p in procs.items()}

    out.update(on_rank0(comm, new_processes))
    out["H"] = run_here(COMMON + [f"checkpoint.resume={_ck(d, 'E', 15)}"])
    out["I"] = run_here(COMMON + [f"checkpoint.resume={_ck(d, 'F', 15)}"])
    out["dir"] = d
    return out


def _losses(ms):
    return [m["loss"] for m in ms]


def _continues(resumed, straight, start):
    """``resumed`` covers steps start+1..20 and reads the same samples as ``straight`` did."""
    assert [m["step"] for m in resumed] == list(range(start + 1, 21))
    tail = [m for m in straight if m["step"] > start]
    assert [m["consumed_samples"] for m in resumed] == [m["consumed_samples"] for m in tail]
    return tail


@pytest.mark.mpi(min_size=2)
def test_bit_exact_resume_in_new_processes(runs):
    tail = _continues(runs["C"], runs["A"], 10)
    assert _losses(runs["C"]) == _losses(tail)  # exact: same layout, same arithmetic
    if MPI.COMM_WORLD.Get_rank() == 0:  # weights, optimizer state and RNG at step 20
        assert_same_datasets(_ck(runs["dir"], "A", 20), _ck(runs["dir"], "C", 20))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("resumed,straight,start", [("E", "A", 10), ("F", "A", 10), ("H", "E", 15), ("I", "F", 15)],
                         ids=["dp2->1", "dp2->dp4", "1->dp2", "dp4->dp2"])
def test_resume_on_another_layout_continues_the_same_run(runs, resumed, straight, start):
    tail = _continues(runs[resumed], runs[straight], start)
    got, want = _losses(runs[resumed]), _losses(tail)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"{resumed} vs {straight}: max relative loss difference "
              f"{max(abs(a - b) / abs(b) for a, b in zip(got, want)):.2e}")
    assert got == pytest.approx(want, rel=RTOL_LAYOUT, abs=0)
