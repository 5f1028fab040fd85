"""Eager islands inside compiled regions (``trainer.compile``).

``@eager`` marks a function torch.compile must never trace: called inside a
compiled region, dynamo breaks the graph there and runs it (and everything
it calls) eagerly. For our collectives and their bookkeeping (counters,
the hang watchdog's sequence numbers: integers dynamo would guard on and
recompile for at every call) and for activation recomputation (its call
count and context variables must run at every call, not once at tracing).

Outside compilation the mark costs one flag test: importing dynamo (1-2 s)
to build the disabled versions happens only when a run compiles
(``prepare``, from ``hpctrain.model.compile``).

torch marks its own functions the same way, but imports dynamo at their
first call: every optimizer's constructor and step among them.
``defer_torch_marks`` makes those plain calls in a process that has not
imported dynamo, so a run that compiles nothing never loads torch's
compiler (torch._dynamo and torch._inductor: hundreds of modules each rank
reads from the shared file system at every launch; docs/benchmarks.md).
Except with ``model.recompute``: torch's checkpointing reads a dynamo setting itself.
``prepare`` puts torch's versions back before anything compiles. A plugin
that calls torch.compile itself calls ``prepare()`` first.
"""
from __future__ import annotations

import functools
import gc
import sys
import types
from typing import Any, Callable, Dict, List, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_MARKED: Dict[Callable[..., Any], Callable[..., Any]] = {}
"""Every marked function -> its dynamo-disabled version (itself until ``prepare``)."""


def eager(fn: F) -> F:
    """``fn``, never traced by torch.compile (a graph break where a compiled region calls it)."""
    _MARKED[fn] = fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # dynamo is tracing this call: hand it the disabled version
            return _MARKED[fn](*args, **kwargs)
        return fn(*args, **kwargs)
    return call  # type: ignore[return-value]


def prepare() -> None:
    """Build the disabled versions (imports dynamo) and give torch back its own
    (``defer_torch_marks``); before the first compiled call."""
    for fn, now in list(_MARKED.items()):
        if now is fn:
            _MARKED[fn] = torch.compiler.disable(fn, reason=f"hpctrain.eager: {fn.__qualname__} runs eagerly")
    _SCANNED_AT[0] = -1
    while _DEFERRED_MARKS:
        fn = _DEFERRED_MARKS.pop()
        if fn.__dict__.get(_TORCH_CACHE) is fn:
            delattr(fn, _TORCH_CACHE)
    _restore_steps()


_TORCH_CACHE = "__dynamo_disable"
"""Where ``torch._disable_dynamo``'s wrapper keeps the disabled version of the
function it wraps, built (importing dynamo) at the first call when absent."""

_DEFERRED_MARKS: List[Callable[..., Any]] = []
"""torch functions whose cache holds the function itself (``defer_torch_marks``)."""

_PLAIN_STEPS: Dict[Callable[..., Any], Any] = {}
"""Each plain optimizer step (``defer_torch_marks``) -> torch's own step it replaced."""

_SCANNED_AT: List[int] = [-1]
"""How many modules were loaded at ``defer_torch_marks``' last scan of the heap: torch
makes its wrappers when a module loads, and a long-lived process (a test session, a
sweep) builds many runs, where a scan per run would cost more than the start-up it saves."""


def _probe() -> None:
    """Wrapped by torch's decorators to recognise their wrappers' code."""


def _plain_step(raw: Callable[..., Any]) -> Callable[..., Any]:
    """torch's optimizer step wrapper without its dynamo graph breaks (they matter
    only when the step itself is traced): the grad mode ``differentiable`` asks for."""
    @functools.wraps(raw)
    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with torch.set_grad_enabled(bool(self.defaults["differentiable"])):
            return raw(self, *args, **kwargs)
    return step


def _optimizer_classes() -> List[type]:
    found: List[type] = []
    todo: List[type] = [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def defer_torch_marks() -> int:
    """Make torch's dynamo-disabled functions and optimizer steps plain calls while
    dynamo is not loaded (they behave the same outside compilation), so that the
    process never imports it unless something compiles (``prepare`` undoes this).
    Returns how many it changed: 0 once dynamo is loaded, or when a torch release
    changes these wrappers (a run is then only slower to start, not different)."""
    if "torch._dynamo" in sys.modules:
        return 0
    mark_code = getattr(torch._disable_dynamo(_probe), "__code__", None)
    if _SCANNED_AT[0] != len(sys.modules):
        _SCANNED_AT[0] = len(sys.modules)
        for obj in gc.get_objects():
            if type(obj) is types.FunctionType and obj.__code__ is mark_code:
                fn = getattr(obj, "__wrapped__", None)
                if isinstance(fn, types.FunctionType) and _TORCH_CACHE not in fn.__dict__:
                    setattr(fn, _TORCH_CACHE, fn)
                    _DEFERRED_MARKS.append(fn)
    use_grad = getattr(sys.modules.get("torch.optim.optimizer"), "_use_grad_for_differentiable", None)
    step_code = getattr(use_grad(_probe), "__code__", None) if use_grad is not None else None
    for cls in _optimizer_classes() if step_code is not None else []:
        step = vars(cls).get("step")
        raw = getattr(step, "__wrapped__", None)
        if getattr(step, "__code__", None) is step_code and raw is not None:
            plain = _plain_step(raw)
            _PLAIN_STEPS[plain] = step
            cls.step = plain  # type: ignore[attr-defined]
    return len(_DEFERRED_MARKS) + len(_PLAIN_STEPS)


def _restore_steps() -> None:
    """torch's steps back on every optimizer class holding a plain one, as torch would
    have left them: the first optimizer built of a class wraps the class's step in
    torch's hook wrapper (step hooks, profiler label), on the class itself or on the
    subclass it built (AdamW, which inherits Adam's step). Built ones keep their hooks."""
    for cls in _optimizer_classes():
        step = vars(cls).get("step")
        plain = step if step in _PLAIN_STEPS else getattr(step, "__wrapped__", None)
        if plain not in _PLAIN_STEPS:
            continue
        torch_step = _PLAIN_STEPS[plain]
        if step is plain:
            cls.step = torch_step  # type: ignore[attr-defined]
        else:
            hooked = torch.optim.Optimizer.profile_hook_step(torch_step)
            hooked.hooked = True  # type: ignore[attr-defined]
            cls.step = hooked  # type: ignore[attr-defined]
    _PLAIN_STEPS.clear()
