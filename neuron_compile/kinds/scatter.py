"""Kernel kind ``scatter``: writes through the indirect DMA (``ir.Scatter``: index_put, scatter, scatter_add,
scatter_reduce, index_reduce, put).

Fusion: none (a scatter takes no epilogue). Tiling: one domain dim (``partition_dim``) on partitions in tiles of
up to 128 elements, every other dim an outer loop in domain order (with ``row_dims``, the trailing dims on the
free axis). Codegen (scatter.py.j2): the kernel first copies self into the output (HBM to HBM DMAs over its last
two dims), then walks the plan's tiles like the element gather (kinds/indirect.py has the address helpers both
use). Per tile:

* the target offset of each element on its partition: ``iota(target layout) + sum(index * stride)``, negatives
  wrapped where the op wraps them, out-of-range ones redirected beyond the output (the write's bounds check
  fails, the call falls back to eager, which raises);
* the same offsets along the free axis of every partition (the indices DMA'd with partition stride 0), and
  ``same[p, j] = offset[j] == offset[p]``: which elements of the tile hit the same place;
* assign: every element writes the value of the LAST element of the tile with its target (a max over
  ``same * j``, then an indirect read of that value), so duplicates write one value whatever order one DMA
  writes in, and tiles run in order: later indices win, as in eager. With ``row_dims``, each partition moves a
  whole row (the trailing dims no index drives) in those two DMAs, like the row gather;
* assign where no two elements of a tile can hit the same place (no index varies along the partition dim, a
  static KV-cache update): kinds/scatter_distinct.py, no collision search, one indirect DMA from the values;
* summing whole rows (``row_dims``, add): kinds/scatter_rows.py, duplicates summed on TensorE;
* combining (add, multiply, maximum, minimum): every element reduces the values of all elements of the tile
  with its target (an exact bitwise select of the value or the op's identity, then a free-axis reduction),
  reads the output at its target, combines and writes back: duplicates write one value, every contribution
  counted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, number
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, register_kind
from neuron_compile.kinds.indirect import indirect_offset, redirect_lines, render_indirect
from neuron_compile.kinds.scatter_distinct import distinct_allocations, distinct_lines, distinct_targets
from neuron_compile.kinds.scatter_rows import (
    collision_lines,
    fill_lines,
    row_entries,
    row_sum_allocations,
    row_sum_lines,
)
from neuron_compile.tiles import TilePlan

COLUMN, SQUARE = "[0:rows, 0:1]", "[0:rows, 0:rows]"  # one value per partition; one row of the tile per partition
SCATTER_TILES = 24  # the address, collision and value tiles of the widest (combining) form

SIGN_BIT = -(2**31)  # 0x80000000 as an int32 operand
IDENTITIES = {"add": -0.0, "multiply": 1.0, "maximum": -math.inf, "minimum": math.inf}  # -0.0 + x is x, even -0.0


def _pattern(entries: list[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"[{stride}, {size}]" for stride, size in entries) + "]"


AP_COUNT_MAX = 65535  # an access pattern's [step, num] holds num in 16 bits


def _copy_dims(out: ir.Layout, base: ir.Layout) -> list[tuple[int, int, int]]:
    """(size, out stride, base stride) of the dims of out = self: the last dim (each DMA's contiguous run) as it
    is, the dims before it without their size-1 ones, each merged into the one inside it where both layouts step
    over them as one (a contiguous cache: one dim of rows) while the count fits an access pattern."""
    dims: list[tuple[int, int, int]] = []
    for size, out_stride, base_stride in list(zip(out.shape, out.strides, base.strides))[:-1]:
        if size == 1:
            continue
        if dims:
            outer, out_outer, base_outer = dims[-1]
            if (out_outer, base_outer) == (out_stride * size, base_stride * size) and outer * size <= AP_COUNT_MAX:
                dims[-1] = (outer * size, out_stride, base_stride)
                continue
        dims.append((size, out_stride, base_stride))
    last = (out.shape[-1], out.strides[-1], base.strides[-1])
    return dims + [last] if dims else [last, (1, 1, 1)]


def _copy_lines(node: ir.Scatter, out: ir.Layout) -> list[str]:
    """out = self: one HBM -> HBM DMA per index of the (merged) dims before the last two (loop variables c0, c1,
    ...)."""
    dims = _copy_dims(out, node.base.layout)
    inner, loops = dims[-2:], dims[:-2]
    lines = ["    " * d + f"for c{d} in range({size}):" for d, (size, _, _) in enumerate(loops)]

    def ap(layout: ir.Layout, buffer: str, side: int) -> str:
        entries = [(dim[side], dim[0]) for dim in inner]
        terms = [(f"c{d}", dim[side]) for d, dim in enumerate(loops)]
        return f"{buffer}.ap({_pattern(entries)}, offset={indirect_offset(layout.offset, terms)})"

    (store,) = node.stores
    lines.append("    " * len(loops) + f"nisa.dma_copy(dst={ap(out, store.buffer.name, 1)}, "
                 f"src={ap(node.base.layout, node.base.buffer, 2)})")
    return lines


def plan_scatter(node: ir.Scatter, target) -> TilePlan:
    rank = len(node.domain)
    part = node.partition_dim % rank
    row = list(range(rank - node.row_dims, rank))  # dims on the free axis (row form), none in the element form
    outer = [d for d in range(rank) if d != part and d not in row]
    free = math.prod(node.domain[d] for d in row)
    rows = node.domain[part]
    return TilePlan("scatter", tuple(LoopDim(node.domain[d], d) for d in outer),
                    LoopDim(rows, part, tile=min(target.partitions, rows)), (LoopDim(free, None, tile=free),),
                    SCATTER_TILES)


def _assign_lines(node: ir.Scatter, plan: TilePlan, offset: Callable) -> list[str]:
    """winner[p] = the last j of the tile with p's target (same[p, p] = 1, so winner >= p >= 0); every element
    writes the winner's value."""
    part, values, free = plan.partition.source, node.values, plan.free[0].size
    lines = [
        f"nisa.tensor_tensor(dst=same{SQUARE}, data1=same{SQUARE}, data2=position{SQUARE}, op=nl.multiply)",
        f"nisa.tensor_reduce(dst=winner{COLUMN}, op=nl.maximum, data=same{SQUARE}, axis=1)",
        f"nisa.tensor_copy(dst=winner_int{COLUMN}, src=winner{COLUMN})",
    ]
    picked = f"picked[0:rows, 0:{free}]"
    if isinstance(values, ir.Load):
        lines.append(f"nisa.dma_copy(dst={picked}, src={values.buffer}.ap([[{values.layout.strides[part]}, rows]"
                     f"{row_entries(node, values.layout)}], offset={offset(values.layout)}, "
                     f"vector_offset=winner_int{COLUMN}, indirect_dim=0))")
    else:
        lines.append(f"nisa.memset(dst={picked}, value={number(values.value)})")
    lines += redirect_lines(COLUMN)
    lines.append(f"nisa.dma_copy(dst={node.stores[0].buffer.name}.ap([[1, rows]{row_entries(node, node.target)}], "
                 f"offset=0, vector_offset=offsets{COLUMN}, indirect_dim=0), src={picked})")
    return lines


def _combine_lines(node: ir.Scatter, plan: TilePlan, offset: Callable) -> list[str]:
    """Every element reduces the values of all elements of the tile with its target, then read-modify-writes."""
    op, values, out = f"nl.{node.reduce}", node.values, node.stores[0].buffer.name
    if isinstance(values, ir.Load):
        lines = [f"nisa.dma_copy(dst=values_row{SQUARE}, src={values.buffer}.ap([[0, rows], "
                 f"[{values.layout.strides[plan.partition.source]}, rows]], offset={offset(values.layout)}))"]
    else:
        lines = [f"nisa.memset(dst=values_row{SQUARE}, value={number(values.value)})"]
    lines += [
        # values_row = same ? values_row : identity, on the fp32 bit patterns (inf and nan pass untouched):
        # identity ^ ((values ^ identity) & mask), mask = 0 - same (all ones where same).
        f"nisa.tensor_copy(dst=mask{SQUARE}, src=same{SQUARE})",
        f"nisa.tensor_tensor(dst=mask{SQUARE}, data1=zero{SQUARE}, data2=mask{SQUARE}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst=bits{SQUARE}, data1=values_row{SQUARE}.view(nl.int32), "
        f"data2=identity{SQUARE}.view(nl.int32), op=nl.bitwise_xor)",
        f"nisa.tensor_tensor(dst=bits{SQUARE}, data1=bits{SQUARE}, data2=mask{SQUARE}, op=nl.bitwise_and)",
        f"nisa.tensor_tensor(dst=values_row{SQUARE}.view(nl.int32), data1=identity{SQUARE}.view(nl.int32), "
        f"data2=bits{SQUARE}, op=nl.bitwise_xor)",
        f"nisa.tensor_reduce(dst=combined{COLUMN}, op={op}, data=values_row{SQUARE}, axis=1)",
    ]
    if node.reduce == "add":
        lines += _negative_zero_sum_lines()
    return lines + redirect_lines(COLUMN) + [
        f"nisa.dma_copy(dst=current{COLUMN}, src={out}.ap([[1, rows], [1, 1]], offset=0, "
        f"vector_offset=offsets{COLUMN}, indirect_dim=0))",
        f"nisa.tensor_tensor(dst=current{COLUMN}, data1=current{COLUMN}, data2=combined{COLUMN}, op={op})",
        f"nisa.dma_copy(dst={out}.ap([[1, rows], [1, 1]], offset=0, vector_offset=offsets{COLUMN}, "
        f"indirect_dim=0), src=current{COLUMN})",
    ]


def _negative_zero_sum_lines() -> list[str]:
    """A sum of zeros is -0.0 only when every term is -0.0, which the reduction does not promise: flags = the bits
    of each selected value other than the sign bit (0 only for -0.0 or an unselected slot); where their OR is 0,
    set combined's sign bit (combined is +-0.0 there)."""
    return [
        f"nisa.tensor_scalar(dst=bits{SQUARE}, data=values_row{SQUARE}.view(nl.int32), op0=nl.bitwise_xor, "
        f"operand0={SIGN_BIT})",
        f"nisa.tensor_tensor(dst=bits{SQUARE}, data1=bits{SQUARE}, data2=mask{SQUARE}, op=nl.bitwise_and)",
        f"nisa.tensor_reduce(dst=flags{COLUMN}, op=nl.bitwise_or, data=bits{SQUARE}, axis=1)",
        f"nisa.tensor_scalar(dst=all_negative_zero{COLUMN}, data=flags{COLUMN}, op0=nl.equal, operand0=0.0)",
        f"nisa.tensor_copy(dst=flags{COLUMN}, src=all_negative_zero{COLUMN})",
        f"nisa.tensor_scalar(dst=flags{COLUMN}, data=flags{COLUMN}, op0=nl.left_shift, operand0=31)",
        f"nisa.tensor_tensor(dst=combined{COLUMN}.view(nl.int32), data1=combined{COLUMN}.view(nl.int32), "
        f"data2=flags{COLUMN}, op=nl.bitwise_or)",
    ]


def _allocations(node: ir.Scatter, plan: TilePlan) -> list[str]:
    """The kernel's SBUF tiles (one value per partition, or one row of the tile per partition), and the lines that
    set the constant ones."""
    tile_rows, free = plan.partition.tile, plan.free[0].size
    sizes = {"column": (tile_rows, 1), "square": (tile_rows, tile_rows)}
    int_tiles = [("raw", "column"), ("base", "column"), ("offsets", "column"), ("raw_row", "square"),
                 ("base_row", "square")]
    float_tiles = [(tile, "column") for tile in ("shift", "wrapped", "low", "high", "bad", "keep", "address")]
    float_tiles += [(tile, "square") for tile in ("shift_row", "wrapped_row", "address_row", "same")]
    setup = []
    if node.reduce == "assign":
        int_tiles += [("winner_int", "column"), ("position_int", "square")]
        float_tiles += [("winner", "column"), ("position", "square")]
        values = node.values
        picked_dtype = NL_DTYPES[values.dtype] if isinstance(values, ir.Load) else "nl.float32"
        setup.insert(0, f"picked = nl.ndarray(({tile_rows}, {free}), dtype={picked_dtype}, buffer=nl.sbuf)")
        setup += [f"nisa.iota(position_int[0:{tile_rows}, 0:{tile_rows}], [[1, {tile_rows}]], offset=0, "
                  "channel_multiplier=0)",
                  "nisa.tensor_copy(dst=position, src=position_int)"]
    elif node.row_dims:  # the accumulating row form (kinds/scatter_rows.py)
        setup += row_sum_allocations(node, plan)
    else:
        int_tiles += [("mask", "square"), ("bits", "square"), ("zero", "square")]
        float_tiles += [("values_row", "square"), ("identity", "square"), ("combined", "column"),
                        ("current", "column")]
        if node.reduce == "add":
            int_tiles.append(("flags", "column"))
            float_tiles.append(("all_negative_zero", "column"))
        setup += ["nisa.memset(dst=zero, value=0)",
                  f"nisa.memset(dst=identity, value={number(IDENTITIES[node.reduce])})"]
    allocations = [f"{tile} = nl.ndarray({sizes[kind]}, dtype=nl.int32, buffer=nl.sbuf)" for tile, kind in int_tiles]
    allocations += [f"{tile} = nl.ndarray({sizes[kind]}, dtype=nl.float32, buffer=nl.sbuf)"
                    for tile, kind in float_tiles]
    return allocations + setup


def render_scatter(node: ir.Scatter, plan: TilePlan, name: str, parameters: list[str]) -> str:
    part = plan.partition.source

    def terms(layout):
        return [(f"o{k}", layout.strides[dim.source]) for k, dim in enumerate(plan.outer)] + [
            ("p0", layout.strides[part])]

    def offset(layout):
        return indirect_offset(layout.offset, terms(layout))

    if distinct_targets(node, plan):  # no collision to resolve (kinds/scatter_distinct.py)
        body, allocations = distinct_lines(node, plan, offset, terms), distinct_allocations(node, plan)
    else:
        body, allocations = collision_lines(node, plan, offset, terms), _allocations(node, plan)
        if node.reduce == "assign":
            body += _assign_lines(node, plan, offset)
        elif node.row_dims:
            body += row_sum_lines(node, plan, offset)
        else:
            body += _combine_lines(node, plan, offset)
    return render_indirect(node, plan, name, parameters, allocations, body, "scatter.py.j2",
                           prelude=tuple(fill_lines(node) if isinstance(node.base, ir.Scalar)
                                         else _copy_lines(node, node.stores[0].layout)))


class ScatterKind(KernelKind):
    node_type = ir.Scatter
    name = "scatter"
    refusal = "a scatter kernel (indirect DMA) takes no epilogue"

    def operand_loads(self, node):
        values = [node.values] if isinstance(node.values, ir.Load) else []
        base = [node.base] if isinstance(node.base, ir.Load) else []
        return base + values + [entry[0] for entry in node.indices]

    def plan(self, node, target):
        return plan_scatter(node, target)

    def render(self, node, plan, name, parameters):
        return render_scatter(node, plan, name, parameters)


register_kind(ScatterKind())
