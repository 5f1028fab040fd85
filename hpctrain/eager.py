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
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, TypeVar

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
    """Build the disabled versions (imports dynamo); before the first compiled call."""
    for fn, now in list(_MARKED.items()):
        if now is fn:
            _MARKED[fn] = torch.compiler.disable(fn, reason=f"hpctrain.eager: {fn.__qualname__} runs eagerly")
