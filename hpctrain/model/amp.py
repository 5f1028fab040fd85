"""Autocast by device type, the meta device included (the dry run's).

``trainer.precision=bf16|fp16`` runs the step under ``torch.autocast``.
torch has no autocast for the meta device, where ``hpctrain-train --dry-run``
runs a rank's step without memory, so every caller goes through ``autocast``
and ``autocast_state`` here: on a device torch autocasts they are torch's own,
and on the meta device an emulation of CUDA's autocast (the target of a
dry run is a GPU job) with the same state rules (a stack of (enabled, dtype);
a nested ``enabled=False`` turns it off inside; parameters cast once per
outermost enabled region, as torch's weight cache does).

The emulation (``_MetaAutocastMode``, a ``TorchFunctionMode`` entered with
the outermost meta region) casts meta tensors at the entry of the functions
the models call, by CUDA autocast's op lists: matrix products, linear and
attention to the autocast dtype; the functions CUDA autocast runs in float32
(softmax, log-softmax, the losses, layer norm, pow, rsqrt, exp, log,
logsumexp, cumulative sums) to float32. Other functions run on what they are
given (type promotion as in eager mode). Tensors on other devices are left
alone, as torch's autocast leaves tensors of other device types.

Activation recomputation replays a forward in backward under the autocast
state of the original (``hpctrain.model.recompute`` captures ``meta_state``
and re-enters it with ``meta_restored``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

META = "meta"

_LOWER: Tuple[Callable[..., Any], ...] = (
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm,
    torch.addmm, torch.Tensor.addmm, torch.einsum, F.scaled_dot_product_attention,
)
"""Functions CUDA autocast runs in the autocast dtype."""
_FLOAT32: Tuple[Callable[..., Any], ...] = (
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
    F.cross_entropy, F.nll_loss, F.mse_loss, F.binary_cross_entropy_with_logits, F.layer_norm,
    torch.pow, torch.Tensor.pow, torch.rsqrt, torch.Tensor.rsqrt, torch.exp, torch.Tensor.exp,
    torch.log, torch.Tensor.log, torch.logsumexp, torch.Tensor.logsumexp, torch.cumsum, torch.Tensor.cumsum,
)
"""Functions CUDA autocast runs in float32."""
_CASTS: Dict[Any, Optional[torch.dtype]] = {**{f: None for f in _LOWER}, **{f: torch.float32 for f in _FLOAT32}}
"""Function -> the dtype it runs in (None: the autocast dtype)."""

_state: List[Tuple[bool, torch.dtype]] = [(False, torch.bfloat16)]
"""The meta device's autocast state, innermost last (the bottom: off)."""
_weights: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
"""id(parameter) -> (parameter, its cast copy): the weight cache of the outermost enabled region."""
_copies: Set[int] = set()
"""The storages of the cast copies in ``_weights`` (``is_weight_copy``)."""
_mode_depth = [0]


def _cast(t: Any, dtype: torch.dtype) -> Any:
    if not (isinstance(t, torch.Tensor) and t.is_meta and t.is_floating_point()) or t.dtype in (dtype, torch.float64):
        return t
    if t.is_leaf and t.requires_grad:  # a weight: cast once per region, as torch's autocast caches it
        hit = _weights.get(id(t))
        if hit is not None and hit[0] is t and hit[1].dtype == dtype:
            return hit[1]
        copy = t.to(dtype)
        _weights[id(t)] = (t, copy)
        _copies.add(copy.untyped_storage()._cdata)
        return copy
    return t.to(dtype)


class _MetaAutocastMode(TorchFunctionMode):
    """Casts meta tensors at the entry of the functions of ``_CASTS`` while the meta state is on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        enabled, dtype = _state[-1]
        if enabled:
            target = _CASTS.get(func, False)
            if target is not False:
                to = dtype if target is None else target
                args, kwargs = tree_map(lambda t: _cast(t, to), (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _meta_autocast(enabled: bool, dtype: torch.dtype) -> Iterator[None]:
    outermost = _mode_depth[0] == 0
    _state.append((enabled, dtype))
    _mode_depth[0] += 1
    mode = _MetaAutocastMode() if outermost else None
    try:
        if mode is not None:
            with mode:
                yield
        else:
            yield
    finally:
        _mode_depth[0] -= 1
        _state.pop()
        if not any(on for on, _ in _state):
            _weights.clear()
            _copies.clear()


def autocast(device_type: str, dtype: Optional[torch.dtype] = None, enabled: bool = True) -> Any:
    """``torch.autocast(device_type, dtype, enabled)``; on the meta device the emulation (module docstring)."""
    if device_type == META:
        return _meta_autocast(enabled, dtype if dtype is not None else _state[-1][1])
    if dtype is None:
        return torch.autocast(device_type=device_type, enabled=enabled)
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled)


def autocast_state(device_type: str) -> Tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast on ``device_type`` now (what a custom backward re-enters)."""
    if device_type == META:
        return _state[-1]
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def is_weight_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a parameter's cast copy the meta emulation made in the current region."""
    return t.is_meta and t.untyped_storage()._cdata in _copies


def meta_state() -> Tuple[bool, torch.dtype]:
    """The meta device's autocast state now (a recomputation replays its forward under it)."""
    return _state[-1]


def meta_restored(state: Tuple[bool, torch.dtype]) -> Any:
    """Re-enter ``state`` (``meta_state``'s) on the meta device; nothing when it is off."""
    enabled, dtype = state
    return _meta_autocast(True, dtype) if enabled else contextlib.nullcontext()
