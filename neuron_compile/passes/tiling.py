"""Tiling stage: a ``TilePlan`` per fused kernel, under the target's limits.

Input: one fused IR node and a hardware ``Target``. Output: ``TilePlan`` — the kernel's loop nest as
``LoopDim``s (outer loops, the partition dim in chunks of <= 128, free dims in chunks sized to the SBUF budget;
matmul: M in 128-row stationary tiles, N in 512-column moving tiles, K in 128-deep chunks), plus how each
layout maps onto it. Ragged edges are smaller last tiles: the loops step by the tile size and the kernel
slices ``min(tile, size - start)``. Raises ``TilingError`` when a shape does not fit (e.g. a softmax row wider
than SBUF), naming the rule and the values.

Dims are first collapsed (as TensorIterator does): size-1 dims are dropped and neighbours that are contiguous
with each other in every layout the kernel touches are merged, so most kernels become one 2-D [rows, cols]
space whatever their rank. Two reduction layouts avoid element-strided DMAs: a sum over strided leading dims
puts the reduced rows on partitions and sums them on TensorE ("column_reduction"), and a reduction that keeps
nothing spreads its row over the partitions and finishes across them (``cross_partition``).
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.dims import LoopDim, collapse, reduced_dims_in_memory_order
from neuron_compile.limits import SBUF_SHARE

FP32_BYTES = 4
MAX_FREE_TILE = 4096  # elements per partition per tile: >= 2 KiB / partition DMA transfers, small enough to unroll
TRANSPOSE_BLOCK = 128  # rows per TensorE transpose (nc_transpose moves at most [128, 128])


class TilingError(RuntimeError):
    """A kernel's shape does not fit the target's on-chip limits; the message names the rule and the values."""


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Loop nest of one kernel. ``outer`` are per-element loops, ``partition`` the SBUF partition dim,
    ``free`` the per-partition dims of a tile (pointwise: one; reductions: the reduced dims)."""

    kind: str  # pointwise | reduction | column_reduction | row_normalize | scan | matmul | concat
    outer: tuple[LoopDim, ...]
    partition: LoopDim
    free: tuple[LoopDim, ...]
    tiles_per_iteration: int  # SBUF tiles the body keeps live (for the budget)
    k_tile: int = 0  # matmul only
    k_tiles: int = 0
    # matmul only: the moving operand (b^T rows, W stored [N, K]) is transposed and multiplied one K chunk at a
    # time instead of kept whole per N tile (large K: the kept chunks would not fit SBUF); N tiles are 128 wide
    stream_moving: bool = False
    parts: tuple[TilePlan, ...] = ()  # concat only: one pointwise plan per input
    cross_partition: bool = False  # reduction only: the reduced dim is spread over partitions too

    def describe(self) -> str:
        def fmt(dim):
            return f"{dim.size}/{dim.tile}"

        outer = ", ".join(fmt(d) for d in self.outer) or "-"
        free = ", ".join(fmt(d) for d in self.free)
        text = f"{self.kind}: outer [{outer}] partition {fmt(self.partition)} free [{free}]"
        if self.kind == "concat":
            return "concat: " + "; ".join(part.describe() for part in self.parts)
        if self.kind == "matmul":
            text += f" K {self.k_tiles}x{self.k_tile}"
            text += " (moving operand streamed per K chunk)" if self.stream_moving else ""
        return text


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def _free_tile(size: int, tiles: int, target) -> int:
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE) // (max(tiles, 1) * FP32_BYTES)
    return max(1, min(size, MAX_FREE_TILE, budget))


def count_tiles(exprs: list[ir.Expr]) -> int:
    """SBUF tiles an expression body needs: one per distinct load and per distinct operation, plus staging."""
    seen: set = set()

    def visit(expr):
        if expr in seen or isinstance(expr, (ir.Scalar, ir.Result)):
            return
        seen.add(expr)
        if isinstance(expr, ir.Op):
            for arg in expr.args:
                visit(arg)

    for expr in exprs:
        visit(expr)
    return len(seen) + 2 * len(exprs) + 2


def plan_pointwise(node: ir.Pointwise, target) -> TilePlan:
    layouts = [store.layout for store in node.stores]
    layouts += [layout for store in node.stores for layout in ir.access_layouts(store.expr)]
    dims = collapse(node.domain, list(range(len(node.domain))), layouts)
    if not dims:
        dims = [LoopDim(1, None)]
    if len(dims) == 1:
        # One long dim: split it so that rows fill the partitions (a divisor keeps the split exact).
        only = dims[0]
        rows = _largest_divisor_at_most(only.size, target.partitions)
        cols = only.size // rows
        dims = [LoopDim(rows, only.source, cols * only.multiplier), LoopDim(cols, only.source, only.multiplier)]
    tiles = count_tiles([store.expr for store in node.stores])
    partition = dataclasses.replace(dims[-2], tile=min(dims[-2].size, target.partitions))
    free = dataclasses.replace(dims[-1], tile=_free_tile(dims[-1].size, tiles, target))
    return TilePlan("pointwise", tuple(dims[:-2]), partition, (free,), tiles)


def _row_dims(node, reduce_dims, layouts, target) -> tuple[list[LoopDim], list[LoopDim]]:
    if isinstance(node, ir.Reduction):
        loads = ir.loads_of(node.prologue)
        reduce_dims = reduced_dims_in_memory_order(reduce_dims, loads[0].layout if loads else None)
    kept_dims = [d for d in range(len(node.domain)) if d not in reduce_dims]
    if getattr(node, "causal", False):
        # The causal mask needs the query index on partitions, so the query dim is never merged away.
        query = kept_dims[-1]
        kept = collapse(node.domain, kept_dims[:-1], layouts) + [LoopDim(node.domain[query], query)]
        return kept, collapse(node.domain, list(reduce_dims), layouts) or [LoopDim(1, None)]
    kept = collapse(node.domain, kept_dims, layouts)
    reduced = collapse(node.domain, list(reduce_dims), layouts)
    return kept or [LoopDim(1, None)], reduced or [LoopDim(1, None)]


def plan_reduction(node: ir.Reduction | ir.RowNormalize, target) -> TilePlan:
    reduce_dims = node.reduce_dims if isinstance(node, ir.Reduction) else (node.dim,)
    layouts = ir.access_layouts(node.prologue) + [store.layout for store in node.stores]
    row_stores = getattr(node, "row_stores", ())
    layouts += [layout for store in node.stores for layout in ir.access_layouts(store.expr)]
    layouts += [store.layout for store in row_stores]
    layouts += [layout for store in row_stores for layout in ir.access_layouts(store.expr)]
    kept, reduced = _row_dims(node, reduce_dims, layouts, target)
    if len(reduced) > 3:
        raise TilingError(
            f"{node.name}: reduced dims {[d.size for d in reduced]} need {len(reduced)} free access-pattern "
            "entries after merging; the DMA access pattern allows at most 3 with the partition entry"
        )
    exprs = [node.prologue] + [store.expr for store in node.stores] + [store.expr for store in row_stores]
    tiles = count_tiles(exprs) + 4
    row = math.prod(d.size for d in reduced)
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE) // (tiles * FP32_BYTES)
    whole_row = row <= budget
    kind = "reduction" if isinstance(node, ir.Reduction) else "row_normalize"
    if not whole_row and (kind == "row_normalize" or len(reduced) > 1 or row_stores):
        raise TilingError(
            f"{node.name}: a {getattr(node, 'op', kind)} row of {row} elements x {tiles} tiles x {FP32_BYTES} B "
            f"exceeds the SBUF budget of {budget} elements per partition "
            f"({target.sbuf_bytes_per_partition} B per partition on {target.name})"
        )
    plain = kind == "reduction" and not row_stores  # a row epilogue needs the row on the free axis
    if plain and node.op in ("sum", "mean") and _columns_are_contiguous(node, kept, reduced):
        # Kept dims contiguous, reduced dims strided (a sum over the batch): reduced rows go on partitions and
        # TensorE sums them against a ones vector, instead of element-strided DMAs.
        partition = dataclasses.replace(reduced[0], tile=min(reduced[0].size, target.partitions))
        free = (dataclasses.replace(kept[-1], tile=min(kept[-1].size, target.gemm_moving_fmax)),)
        return TilePlan("column_reduction", tuple(kept[:-1]), partition, free, tiles)
    cross_partition = False
    if plain and node.op != "var" and kept[-1].source is None and len(reduced) == 1:
        # Nothing kept (a full reduction): spread the row over partitions, reduce across them at the end.
        rows = _largest_divisor_at_most(reduced[0].size, target.partitions)
        if rows > 1:
            cols = reduced[0].size // rows
            kept = [LoopDim(rows, reduced[0].source, cols * reduced[0].multiplier)]
            reduced = [LoopDim(cols, reduced[0].source, reduced[0].multiplier)]
            row, whole_row, cross_partition = cols, cols <= budget, True
    free = [dataclasses.replace(d, tile=d.size) for d in reduced]
    if not whole_row:  # one reduced dim, walked in chunks whose partials are combined
        free = [dataclasses.replace(reduced[0], tile=min(budget, MAX_FREE_TILE))]
    partition = dataclasses.replace(kept[-1], tile=min(kept[-1].size, target.partitions))
    return TilePlan(kind, tuple(kept[:-1]), partition, tuple(free), tiles, cross_partition=cross_partition)


def _columns_are_contiguous(node: ir.Reduction, kept: list[LoopDim], reduced: list[LoopDim]) -> bool:
    if len(reduced) != 1 or kept[-1].source is None or reduced[0].source is None:
        return False
    loads = ir.loads_of(node.prologue)
    return bool(loads) and all(kept[-1].stride(load.layout) in (0, 1) for load in loads) and any(
        kept[-1].stride(load.layout) == 1 and reduced[0].stride(load.layout) != 1 for load in loads
    )


SCAN_TILES = 8  # running values and errors (each with a carry column), constants, the compensation's scratch


def plan_scan(node: ir.Scan, target) -> TilePlan:
    """The scanned dim on the free axis, walked in chunks that each carry their last column into the next; the
    other dims on partitions and outer loops, whatever their order in memory."""
    layouts = [layout for expr in (node.prologue, *(store.expr for store in node.stores))
               for layout in ir.access_layouts(expr)] + [store.layout for store in node.stores]
    kept, scanned = _row_dims(node, (node.dim,), layouts, target)
    tiles = count_tiles([node.prologue] + [store.expr for store in node.stores]) + SCAN_TILES
    free = dataclasses.replace(scanned[0], tile=_free_tile(scanned[0].size, tiles, target))
    partition = dataclasses.replace(kept[-1], tile=min(kept[-1].size, target.partitions))
    return TilePlan("scan", tuple(kept[:-1]), partition, (free,), tiles)


def needs_transpose(partition_stride: int, free_stride: int) -> bool:
    """Whether a matmul operand tile is better loaded with its dims swapped (contiguous rows) and transposed on
    TensorE: a DMA whose innermost run is one element costs a burst per element; nc_transpose into PSUM and a copy
    back to SBUF do not."""
    return abs(partition_stride) == 1 and abs(free_stride) != 1


def plan_matmul(node: ir.MatMul, target) -> TilePlan:
    *batch, m, n = node.domain
    itemsize = 2 if node.a.dtype == "bfloat16" else 4
    k_tile = min(node.k, target.partitions)
    k_tiles = math.ceil(node.k / k_tile)
    rank = len(batch)
    transpose_a = needs_transpose(node.a.layout.strides[rank + 1], node.a.layout.strides[rank])
    transpose_b = needs_transpose(node.b.layout.strides[rank], node.b.layout.strides[rank + 1])
    # Resident per partition: the a^T chunks of one row block (kept across the N loop), a's whole rows when they
    # are transposed on chip, b's tile(s) of one N block and b^T's whole rows when transposed.
    stationary = k_tiles * target.gemm_stationary_fmax * itemsize + (node.k * itemsize if transpose_a else 0)

    def resident(n_tile: int, stream: bool) -> int:
        kept_moving = k_tiles if transpose_b and not stream else 1
        return stationary + kept_moving * n_tile * itemsize + (node.k * itemsize if transpose_b else 0)

    budget = target.sbuf_bytes_per_partition * SBUF_SHARE / 2
    n_tile, stream = min(n, target.gemm_moving_fmax), False
    if resident(n_tile, stream) > budget and transpose_b:
        n_tile, stream = min(n, TRANSPOSE_BLOCK), True
    if resident(n_tile, stream) > budget:
        raise TilingError(
            f"{node.name}: K={node.k} needs {resident(n_tile, stream)} B per partition of resident operand tiles, "
            f"over half the SBUF budget ({target.sbuf_bytes_per_partition} B per partition on {target.name})"
        )
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    partition = LoopDim(m, len(batch), 1, min(m, target.gemm_stationary_fmax))
    free = (LoopDim(n, len(batch) + 1, 1, n_tile),)
    tiles = count_tiles([store.expr for store in node.stores])
    return TilePlan("matmul", outer, partition, free, tiles, k_tile, k_tiles, stream_moving=stream)


def plan_kernel(node: ir.Node, target) -> TilePlan:
    if isinstance(node, ir.Pointwise):
        return plan_pointwise(node, target)
    if isinstance(node, (ir.Reduction, ir.RowNormalize)):
        return plan_reduction(node, target)
    if isinstance(node, ir.MatMul):
        return plan_matmul(node, target)
    if isinstance(node, ir.Scan):
        return plan_scan(node, target)
    if isinstance(node, ir.Concat):
        parts = tuple(plan_pointwise(part, target) for part in node.parts)
        synthetic = LoopDim(1, None)
        return TilePlan("concat", (), synthetic, (synthetic,), max(p.tiles_per_iteration for p in parts), parts=parts)
    raise TilingError(f"no tiling for {type(node).__name__}")
