"""ShardSpec: how a logical (global) tensor is laid out over the mesh.

Every parameter carries one (``param.hpctrain_spec``), set when the model is
built and updated by each plugin that splits it. A tensor dimension may be
split over one mesh axis (or several, outermost first); every axis not named
is replicated. Checkpointing writes the hyperslab ``local_slices(coords)`` of
the logical dataset; the gradient-norm reduction reads ``split_axes``.

``logical_name`` is the parameter's name in the one-process model, which
stays stable when plugins rename modules (pipeline stages, wrappers), so
initialisation and checkpoints are keyed by it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple

import torch

SPEC_ATTR = "hpctrain_spec"


@dataclass(frozen=True)
class DimSplit:
    """Tensor dim ``dim`` is split evenly into contiguous chunks along ``axes``
    (outermost axis first: chunk index = sum(coord[a] * inner sizes))."""

    dim: int
    axes: Tuple[str, ...]


@dataclass(frozen=True)
class ShardSpec:
    logical_name: str
    global_shape: Tuple[int, ...]
    splits: Tuple[DimSplit, ...] = ()
    init: str = "normal"
    """How the logical tensor is initialised: normal, normal_scaled (residual
    output projections), ones, zeros."""

    @property
    def split_axes(self) -> Tuple[str, ...]:
        return tuple(a for s in self.splits for a in s.axes)

    def is_replicated(self, axis: str) -> bool:
        return axis not in self.split_axes

    def with_split(self, dim: int, *axes: str) -> "ShardSpec":
        if any(s.dim == dim for s in self.splits):
            raise ValueError(f"{self.logical_name}: dim {dim} is already split")
        return replace(self, splits=self.splits + (DimSplit(dim, tuple(axes)),))

    def _chunk(self, split: DimSplit, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[int, int]:
        n, idx = 1, 0
        for a in split.axes:
            idx = idx * sizes[a] + coords[a]
            n *= sizes[a]
        length = self.global_shape[split.dim]
        if length % n:
            raise ValueError(
                f"{self.logical_name}: dim {split.dim} of size {length} is not divisible by "
                f"{'*'.join(split.axes)}={n}"
            )
        step = length // n
        return idx * step, step

    def local_slices(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[slice, ...]:
        """The hyperslab of the logical tensor held by the rank at ``coords``."""
        sl = [slice(0, n) for n in self.global_shape]
        for s in self.splits:
            start, step = self._chunk(s, coords, sizes)
            sl[s.dim] = slice(start, start + step)
        return tuple(sl)

    def local_shape(self, coords: Mapping[str, int], sizes: Mapping[str, int]) -> Tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.local_slices(coords, sizes))


def set_spec(param: torch.Tensor, spec: ShardSpec) -> ShardSpec:
    setattr(param, SPEC_ATTR, spec)
    return spec


def get_spec(param: torch.Tensor) -> ShardSpec:
    spec: Optional[ShardSpec] = getattr(param, SPEC_ATTR, None)
    if spec is None:
        raise AttributeError("parameter has no ShardSpec; every parameter must get one when the model is built")
    return spec


def replicated_spec(name: str, shape: Tuple[int, ...], init: str = "normal") -> ShardSpec:
    return ShardSpec(logical_name=name, global_shape=tuple(shape), init=init)
