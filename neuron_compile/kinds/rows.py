"""Kernel kinds over rows (reduction, row normalize, scan): the kept dims on partitions, the row on the free axis.

Input: a row node (it has a ``prologue`` and ``stores``), the dims its row runs along and the layouts it reads and
writes through. Output: the kept and row ``LoopDim``s after collapsing, and the SBUF budget of one row; the
load's access pattern puts the row on the free axis whatever its order in memory.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.dims import LoopDim, collapse
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import FP32_BYTES, MAX_FREE_TILE, TilingError, count_tiles

ROW_BUFFER_TILES = 4  # the row kernels' own tiles beside the expressions' (accumulators, partials, scratch)


def row_layouts(node, stores: tuple[ir.Store, ...]) -> list[ir.Layout]:
    """Every layout a row kernel indexes through: its prologue's, its stores' and their expressions'."""
    layouts = ir.access_layouts(node.prologue) + [store.layout for store in stores]
    return layouts + [layout for store in stores for layout in ir.access_layouts(store.expr)]


def row_dims(domain, row_dims_in_order, layouts, causal: bool = False) -> tuple[list[LoopDim], list[LoopDim]]:
    """(kept dims, row dims), collapsed; a synthetic size-1 dim stands in for an empty side."""
    kept_dims = [d for d in range(len(domain)) if d not in row_dims_in_order]
    if causal:
        # The causal mask needs the query index on partitions, so the query dim is never merged away.
        query = kept_dims[-1]
        kept = collapse(domain, kept_dims[:-1], layouts) + [LoopDim(domain[query], query)]
        return kept, collapse(domain, list(row_dims_in_order), layouts) or [LoopDim(1, None)]
    kept = collapse(domain, kept_dims, layouts)
    reduced = collapse(domain, list(row_dims_in_order), layouts)
    return kept or [LoopDim(1, None)], reduced or [LoopDim(1, None)]


@dataclasses.dataclass(frozen=True)
class RowBudget:
    """How one row of a row kernel fits SBUF: its dims, the tiles the body keeps, and the per-partition budget."""

    kept: list[LoopDim]
    reduced: list[LoopDim]
    tiles: int
    row: int  # elements of one row
    budget: int  # elements per partition each tile may hold

    @property
    def whole_row(self) -> bool:
        return self.row <= self.budget

    def too_wide(self, node, what: str, target, measured: int | None = None) -> TilingError:
        """The error for a row that does not fit; ``measured``: the bytes per partition its tiles were found to
        take, when they were counted as the body declares them."""
        if measured is not None:
            return TilingError(
                f"{node.name}: a {what} row of {self.row} elements keeps {measured} B per partition on chip, over the "
                f"SBUF budget of {int(target.sbuf_bytes_per_partition * SBUF_SHARE)} B per partition "
                f"({SBUF_SHARE:.0%} of {target.sbuf_bytes_per_partition} B on {target.name})")
        return TilingError(
            f"{node.name}: a {what} row of {self.row} elements x {self.tiles} tiles x {FP32_BYTES} B "
            f"exceeds the SBUF budget of {self.budget} elements per partition "
            f"({target.sbuf_bytes_per_partition} B per partition on {target.name})"
        )

    def free_dims(self) -> list[LoopDim]:
        """The row dims whole, or (a row wider than the budget, one dim) walked in chunks."""
        if self.whole_row:
            return [dataclasses.replace(dim, tile=dim.size) for dim in self.reduced]
        return [dataclasses.replace(self.reduced[0], tile=min(self.budget, MAX_FREE_TILE))]


def count_row_tiles(exprs: list[ir.Expr], reduce_dims) -> int:
    """Row-wide SBUF tiles a row kernel's expressions need: one per distinct load or op whose value varies along
    the row (a load with a stride in a reduced dim, or an op over one), plus staging as ``count_tiles`` does.
    Values constant along the row (the reduced result, the epilogue's math on it, such as a guarded rsqrt) live
    in (P, 1) tiles of 4 bytes per partition and do not count."""
    varying: dict[ir.Expr, bool] = {}

    def visit(expr) -> bool:
        if expr not in varying:
            if isinstance(expr, ir.Load):
                varying[expr] = any(expr.layout.strides[dim] != 0 for dim in reduce_dims)
            elif isinstance(expr, ir.Op):
                varying[expr] = any([visit(arg) for arg in expr.args])
            else:  # Scalar, Result (per row), Iota
                varying[expr] = isinstance(expr, ir.Iota)
        return varying[expr]

    for expr in exprs:
        visit(expr)
    return sum(varying.values()) + 2 * len(exprs) + 2


def row_budget(node, kept: list[LoopDim], reduced: list[LoopDim], exprs: list[ir.Expr], target,
               tiles: int | None = None) -> RowBudget:
    if len(reduced) > 3:
        raise TilingError(
            f"{node.name}: reduced dims {[d.size for d in reduced]} need {len(reduced)} free access-pattern "
            "entries after merging; the DMA access pattern allows at most 3 with the partition entry"
        )
    tiles = (count_tiles(exprs) if tiles is None else tiles) + ROW_BUFFER_TILES
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE) // (tiles * FP32_BYTES)
    return RowBudget(kept, reduced, tiles, math.prod(dim.size for dim in reduced), budget)


def partition_dim(kept: list[LoopDim], target) -> LoopDim:
    """The innermost kept dim, on partitions in tiles of at most 128."""
    return dataclasses.replace(kept[-1], tile=min(kept[-1].size, target.partitions))
