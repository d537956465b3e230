"""Tile plans: the data the tiling pass produces and codegen consumes, and the budget rules planners share.

Input: nothing (definitions). Each kernel kind's planner (neuron_compile.kinds) builds a ``TilePlan`` — the
kernel's loop nest as ``LoopDim``s — with ``free_tile`` and ``count_tiles`` keeping it inside the SBUF share of
the target, and raises ``TilingError`` (naming the rule and the values) when a shape does not fit.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.dims import LoopDim
from neuron_compile.limits import SBUF_SHARE

FP32_BYTES = 4
MAX_FREE_TILE = 4096  # elements per partition per tile: >= 2 KiB / partition DMA transfers, small enough to unroll
TRANSPOSE_BLOCK = 128  # rows per TensorE transpose (nc_transpose moves at most [128, 128])
# A row shorter than this (bytes) with no outer dim to widen with: each partition takes several rows
# (``rows_per_partition``); a DMA of fewer bytes per partition is overhead-bound (nki-spec §2)
SHORT_ROW_BYTES = 512
GROUPED_ROWS_MAX_ELEMENTS = 1024  # per partition: long enough DMAs, and tiles enough to overlap them


class TilingError(RuntimeError):
    """A kernel's shape does not fit the target's on-chip limits; the message names the rule and the values."""


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Loop nest of one kernel. ``outer`` are per-element loops, ``partition`` the SBUF partition dim,
    ``free`` the per-partition dims of a tile (pointwise: one; reductions: the reduced dims)."""

    kind: str  # pointwise | reduction | column_reduction | row_normalize | scan | matmul | attention | concat | ...
    outer: tuple[LoopDim, ...]
    partition: LoopDim
    free: tuple[LoopDim, ...]
    tiles_per_iteration: int  # SBUF tiles the body keeps live (for the budget)
    k_tile: int = 0  # matmul only
    k_tiles: int = 0
    # matmul only: the moving operand (b^T rows, W stored [N, K]) is transposed and multiplied one K chunk at a
    # time instead of kept whole per N tile (large K: the kept chunks would not fit SBUF); N tiles are 128 wide
    stream_moving: bool = False
    # matmul only: rows of a whose a^T tiles stay resident while b streams past them once (the DMA-transposing
    # form, matmul_resident.py.j2); 0 for the TensorE-transposing form (matmul.py.j2)
    row_group: int = 0
    # matmul only, with row_group: columns of b whose tiles stay resident across the row groups (loaded during the
    # first one), so that b crosses HBM once and a once per column group; 0: b is loaded again for every row group
    column_group: int = 0
    parts: tuple[TilePlan, ...] = ()  # concat only: one pointwise plan per input
    cross_partition: bool = False  # reduction only: the reduced dim is spread over partitions too
    # reduction only: free[0] is not reduced but kept rows, several per partition (``rows_per_partition``), each
    # reduced on its own into a [partitions, free[0]] tile of results
    grouped_rows: bool = False
    # the name of the target the plan was made for, where a renderer weighs its engines against its DMAs (pointwise)
    target: str = ""

    def describe(self) -> str:
        def fmt(dim):
            return f"{dim.size}/{dim.tile}"

        outer = ", ".join(fmt(d) for d in self.outer) or "-"
        free = ", ".join(fmt(d) for d in self.free)
        text = f"{self.kind}: outer [{outer}] partition {fmt(self.partition)} free [{free}]"
        text += f" ({self.free[0].size} rows per partition)" if self.grouped_rows else ""
        if self.kind == "concat":
            return "concat: " + "; ".join(part.describe() for part in self.parts)
        if self.kind == "matmul":
            text += f" K {self.k_tiles}x{self.k_tile}"
            text += " (moving operand streamed per K chunk)" if self.stream_moving else ""
            if self.column_group:
                text += (f", b resident per {self.column_group} columns (loaded once), a^T per {self.row_group} "
                         "rows, loaded once per column group")
            elif self.row_group:
                text += f", a^T resident per {self.row_group} rows, b loaded once per group"
        return text


def rows_per_partition(partition: LoopDim, free: LoopDim, tiles: int, target) -> tuple[LoopDim, tuple[LoopDim, ...]]:
    """(partition dim, free dims): with no outer dim to widen a short row with, the rows split into groups of ``k``
    consecutive rows, one group per partition row (the partition dim ``R / k``, ``k`` the first free dim): q / k
    norms over [tokens x 8 heads, 128] then move k rows per partition per DMA, not 256 bytes (pointwise kernels),
    and reduce k rows per instruction (row reductions). ``k`` divides the rows, keeps at least the target's
    partitions of row groups and fits the SBUF share; at least four partition tiles of rows, so that loads still
    overlap compute."""
    if free.tile < free.size or partition.size < 4 * target.partitions:
        return partition, (free,)
    fits = rows_that_fit(free.size, partition.size // target.partitions, tiles, target)
    per_partition = largest_divisor_at_most(partition.size, min(fits, partition.size // target.partitions))
    if per_partition < 2:
        return partition, (free,)
    groups = partition.size // per_partition
    rows = LoopDim(groups, partition.source, partition.multiplier * per_partition, min(groups, target.partitions))
    return rows, (LoopDim(per_partition, partition.source, partition.multiplier, per_partition), free)


def rows_that_fit(row: int, rows: int, tiles: int, target) -> int:
    """How many rows of ``row`` elements (of ``rows`` to group) one partition may hold when short rows are grouped:
    within the SBUF share of ``tiles`` tiles and ``GROUPED_ROWS_MAX_ELEMENTS``; at least one."""
    return max(1, min(free_tile(rows * row, tiles, target), GROUPED_ROWS_MAX_ELEMENTS) // row)


def largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def free_tile(size: int, tiles: int, target) -> int:
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


def needs_transpose(partition_stride: int, free_stride: int) -> bool:
    """Whether a matmul operand tile is better loaded with its dims swapped (contiguous rows) and transposed on
    TensorE: a DMA whose innermost run is one element costs a burst per element; nc_transpose into PSUM and a copy
    back to SBUF do not."""
    return abs(partition_stride) == 1 and abs(free_stride) != 1


MAX_ATTENTION_HEAD_DIM = 256


def attention_head_chunks(depth: int, partitions: int) -> tuple[int, int]:
    """(chunk, chunks): an attention head dim split into equal chunks of at most ``partitions`` rows (the
    contraction of q @ k^T goes on partitions)."""
    chunks = math.ceil(depth / partitions)
    return depth // chunks, chunks


def flash_attention_reason(depth: int, value_dim: int, scale: float, target) -> str | None:
    """None if the flash-attention kernel takes these head dims and scale on ``target``, else why not."""
    if depth > MAX_ATTENTION_HEAD_DIM or depth % math.ceil(depth / target.partitions):
        return f"head dim {depth}: at most {MAX_ATTENTION_HEAD_DIM}, in equal chunks of <= {target.partitions}"
    if value_dim > target.gemm_moving_fmax:
        return f"value head dim {value_dim} exceeds one PSUM bank of fp32 ({target.gemm_moving_fmax})"
    if not scale > 0:
        return f"scale {scale} (the running max is kept on scaled scores: a positive scale)"
    return None


def attention_backward_bytes(depth: int, value_dim: int, queries: int, keys: int, itemsize: int, grouped: bool,
                             target) -> tuple[int, int]:
    """SBUF bytes per partition of the fused attention backward (kinds/attention_backward.py): (what it always
    keeps, what keeping one query tile's query side resident adds). Always: each query tile's dq accumulator
    (fp32), log-sum-exp and row dot; the group's dk / dv sums (fp32) with grouped-query heads; two key blocks' and
    two query tiles' working tiles (one loads while the other computes). Per query tile kept resident: its q^T, q,
    dO^T and dO."""
    rows = target.partitions
    query_tiles, key_tiles = math.ceil(queries / rows), math.ceil(keys / rows)
    query_side = (2 * rows + depth + value_dim) * itemsize
    # a key block of 512: k, k^T, v^T, P, dS, dS^T (<= 4 bytes each), the mask and logits (fp32); dk, dv out
    block = (4 * depth + 5 * 512) * 4 + 2 * 512 * 4 + (depth + value_dim) * 4
    always = query_tiles * (depth * 4 + 8) + 2 * (block + query_side + value_dim * 4)
    if grouped:
        always += key_tiles * (depth + value_dim) * 4
    return always, query_side


def attention_backward_reason(depth: int, value_dim: int, queries: int, keys: int, itemsize: int, grouped: bool,
                              target) -> str | None:
    """None if the fused attention backward takes these sizes on ``target``, else why not (the backward then
    runs as separate kernels, P and dS through HBM)."""
    if depth > target.partitions or value_dim > target.partitions:
        return f"head dims {depth}, {value_dim}: the fused backward takes at most {target.partitions}"
    always, _ = attention_backward_bytes(depth, value_dim, queries, keys, itemsize, grouped, target)
    budget = target.sbuf_bytes_per_partition * SBUF_SHARE
    if always > budget:
        return f"{always} B per partition of SBUF for {queries} queries, over the budget ({int(budget)} B)"
    return None
