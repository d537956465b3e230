"""Tiling stage: a ``TilePlan`` per fused kernel, under the target's limits.

Input: one fused IR node and a hardware ``Target``. Output: ``TilePlan`` (neuron_compile/tiles.py) — the
kernel's loop nest as ``LoopDim``s (outer loops, the partition dim in chunks of <= 128, free dims in chunks sized
to the SBUF budget; matmul: M in 128-row stationary tiles, N in 512-column moving tiles, K in 128-deep chunks).
Ragged edges are smaller last tiles: the loops step by the tile size and the kernel slices
``min(tile, size - start)``. Raises ``TilingError`` when a shape does not fit (e.g. a softmax row wider than
SBUF), naming the rule and the values.

Each kernel kind plans its own nodes (neuron_compile/kinds/*.py). Dims are first collapsed (as TensorIterator
does, neuron_compile/dims.py): size-1 dims are dropped and neighbours that are contiguous with each other in
every layout the kernel touches are merged, so most kernels become one 2-D [rows, cols] space whatever their rank.
"""

from __future__ import annotations

from neuron_compile import ir, kinds
from neuron_compile.tiles import TilePlan, TilingError

__all__ = ["TilePlan", "TilingError", "plan_kernel"]


def plan_kernel(node: ir.Node, target) -> TilePlan:
    return kinds.kind_of(node).plan(node, target)
