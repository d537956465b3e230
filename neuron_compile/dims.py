"""Iteration dims over layouts: a kernel's loop dims, and collapsing a domain's dims as TensorIterator does.

Input: an IR domain (sizes), the dims to walk in loop order and the layouts the kernel reads and writes through.
Output: ``LoopDim``s with size-1 dims dropped and neighbours merged where every layout is contiguous across them.
Shared by lowering's shape checks (will a reduction row fit?) and the tiling pass, which plans tiles over them.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir


@dataclasses.dataclass(frozen=True)
class LoopDim:
    """One dim of the kernel's loop nest: ``size`` elements walked in steps of ``tile``.

    ``source`` is the IR domain dim whose stride it uses (times ``multiplier``); None for a synthetic
    size-1 dim (stride 0).
    """

    size: int
    source: int | None
    multiplier: int = 1
    tile: int = 1

    def stride(self, layout: ir.Layout) -> int:
        return 0 if self.source is None else layout.strides[self.source] * self.multiplier

    @property
    def count(self) -> int:
        return math.ceil(self.size / self.tile)


def _mergeable(layouts, outer: int, inner: int, sizes) -> bool:
    return all(layout.strides[outer] == layout.strides[inner] * sizes[inner] for layout in layouts)


def collapse(domain: tuple[int, ...], dims: list[int], layouts: list[ir.Layout]) -> list[LoopDim]:
    """Domain ``dims`` (in loop order) as LoopDims: size-1 dims dropped, contiguous neighbours merged."""
    kept = [dim for dim in dims if domain[dim] != 1]
    merged: list[LoopDim] = []
    for dim in kept:
        if merged and _mergeable(layouts, merged[-1].source, dim, domain) and merged[-1].multiplier == 1:
            merged[-1] = LoopDim(merged[-1].size * domain[dim], dim)
        else:
            merged.append(LoopDim(domain[dim], dim))
    return merged


def reduced_dims_in_memory_order(reduce_dims, layout: ir.Layout | None) -> list[int]:
    """Reduced dims outermost-stride first: the reduction is commutative, so walking them in memory order lets
    a transposed input merge back into one contiguous run."""
    if layout is None:
        return list(reduce_dims)
    return sorted(reduce_dims, key=lambda dim: -abs(layout.strides[dim]))
