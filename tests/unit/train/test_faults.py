"""Fault injection's step rule: a slowed rank stays slow from its step on, also
in a run resumed after that step; the one-off faults fire at their step only."""
from types import SimpleNamespace

import torch

from hpctrain.train.faults import FaultInjector


def _debug(kind, step=3, rank=0):
    return SimpleNamespace(fault=kind, fault_step=step, fault_at="step", slow_s=0.0, fault_rank=rank)


def _hooks(module):
    return len(module._forward_pre_hooks)


def test_slow_starts_at_its_step_and_in_a_run_resumed_past_it():
    fresh, module = FaultInjector(_debug("slow"), world_rank=0), torch.nn.Linear(2, 2)
    for step in (1, 2):
        fresh.before_step(step, [module])
    assert _hooks(module) == 0
    for step in (3, 4):
        fresh.before_step(step, [module])
    assert _hooks(module) == 1  # once, not once per step

    resumed, module = FaultInjector(_debug("slow"), world_rank=0), torch.nn.Linear(2, 2)
    resumed.before_step(7, [module])  # the first step of a run resumed after step 6
    assert _hooks(module) == 1


def test_slow_on_another_rank_does_nothing_here():
    injector, module = FaultInjector(_debug("slow", rank=1), world_rank=0), torch.nn.Linear(2, 2)
    injector.before_step(5, [module])
    assert _hooks(module) == 0


def test_a_one_off_fault_fires_at_its_step_only():
    injector = FaultInjector(_debug("oom"), world_rank=0)
    injector.before_step(4, [])  # a run resumed after the fault's step: no fault
    try:
        injector.before_step(3, [])
    except torch.cuda.OutOfMemoryError:
        return
    raise AssertionError("the oom fault did not fire at its step")
