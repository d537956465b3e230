"""Codegen stage, scatters: an ``ir.Scatter`` -> the source text of one indirect-DMA NKI kernel.

Input: the Scatter node, the kernel's name, its parameter buffers and the target. Output: ``KernelSource``.
The kernel first copies self into the output (HBM to HBM DMAs over its last two dims), then walks the domain
like the element gather (codegen/gather.py, whose address helpers it shares): one domain dim (``partition_dim``)
on partitions in tiles of up to 128 elements, every other dim an outer loop in domain order. Per tile:

* the target offset of each element on its partition: ``iota(target layout) + sum(index * stride)``, negatives
  wrapped where the op wraps them, out-of-range ones redirected beyond the output (the write's bounds check
  fails, the call falls back to eager, which raises);
* the same offsets along the free axis of every partition (the indices DMA'd with partition stride 0), and
  ``same[p, j] = offset[j] == offset[p]``: which elements of the tile hit the same place;
* assign: every element writes the value of the LAST element of the tile with its target (a max over
  ``same * j``, then an indirect read of that value), so duplicates write one value whatever order one DMA
  writes in, and tiles run in order: later indices win, as in eager. With ``row_dims``, each partition moves a
  whole row (the trailing dims no index drives) in those two DMAs, like the row gather;
* combining (add, multiply, maximum, minimum): every element reduces the values of all elements of the tile
  with its target (an exact bitwise select of the value or the op's identity, then a free-axis reduction),
  reads the output at its target, combines and writes back: duplicates write one value, every contribution
  counted once.
"""

from __future__ import annotations

import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, number
from neuron_compile.codegen.gather import (
    _offset,
    _render_loops,
    column_address_lines,
    element_address_lines,
    redirect_lines,
)
from neuron_compile.codegen.render import KernelSource

SIGN_BIT = -(2**31)  # 0x80000000 as an int32 operand
IDENTITIES = {"add": -0.0, "multiply": 1.0, "maximum": -math.inf, "minimum": math.inf}  # -0.0 + x is x, even -0.0


def _pattern(entries: list[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"[{stride}, {size}]" for stride, size in entries) + "]"


def _copy_lines(node: ir.Scatter, out: ir.Layout) -> list[str]:
    """out = self: one HBM -> HBM DMA per index of the dims before the last two (loop variables c0, c1, ...)."""
    base = node.base.layout
    rank = len(out.shape)
    inner = list(range(max(rank - 2, 0), rank))
    lines, depth = [], 0
    for d in range(rank - len(inner)):
        lines.append("    " * depth + f"for c{d} in range({out.shape[d]}):")
        depth += 1

    def ap(layout: ir.Layout, buffer: str) -> str:
        entries = [(layout.strides[d], layout.shape[d]) for d in inner] + ([(1, 1)] if len(inner) < 2 else [])
        terms = [(f"c{d}", layout.strides[d]) for d in range(rank - len(inner))]
        return f"{buffer}.ap({_pattern(entries)}, offset={_offset(layout.offset, terms)})"

    (store,) = node.stores
    lines.append("    " * depth + f"nisa.dma_copy(dst={ap(out, store.buffer.name)}, src={ap(base, node.base.buffer)})")
    return lines


def render_scatter(node: ir.Scatter, name: str, parameters: list[str], target) -> KernelSource:
    (store,) = node.stores
    rank = len(node.domain)
    part = node.partition_dim % rank
    rows_total = node.domain[part]
    tile_rows = min(target.partitions, rows_total)
    row = list(range(rank - node.row_dims, rank))  # dims on the free axis (row form), none in the element form
    outer = [d for d in range(rank) if d != part and d not in row]
    free = math.prod(node.domain[d] for d in row)
    row_entries = "".join(f", [{node.target.strides[d]}, {node.domain[d]}]" for d in row) or ", [1, 1]"
    out = store.buffer.name

    def terms(layout):
        return [(f"o{k}", layout.strides[j]) for k, j in enumerate(outer)] + [("p0", layout.strides[part])]

    def offset(layout):
        return _offset(layout.offset, terms(layout))

    column, square = "[0:rows, 0:1]", "[0:rows, 0:rows]"
    body = column_address_lines(node.target, node.indices, terms, part, column)  # target offsets, one per partition
    body += [
        # The same offsets along the free axis of every partition: which elements of the tile collide.
        f"nisa.iota(base_row{square}, [[{node.target.strides[part]}, rows]], offset={offset(node.target)}, "
        "channel_multiplier=0)",
        f"nisa.tensor_copy(dst=address_row{square}, src=base_row{square})",
    ]
    body += element_address_lines(
        node.indices, lambda index: f"{index.buffer}.ap([[0, rows], [{index.layout.strides[part]}, rows]], "
        f"offset={offset(index.layout)})", square, suffix="_row", check=False)
    body.append(f"nisa.tensor_scalar(dst=same{square}, data=address_row{square}, op0=nl.equal, "
                f"operand0=address{column})")
    values = node.values
    if isinstance(values, ir.Load):
        value_stride = values.layout.strides[part]
    if node.reduce == "assign":
        # winner[p] = the last j of the tile with p's target (same[p, p] = 1, so winner >= p >= 0).
        body += [
            f"nisa.tensor_tensor(dst=same{square}, data1=same{square}, data2=position{square}, op=nl.multiply)",
            f"nisa.tensor_reduce(dst=winner{column}, op=nl.maximum, data=same{square}, axis=1)",
            f"nisa.tensor_copy(dst=winner_int{column}, src=winner{column})",
        ]
        picked = f"picked[0:rows, 0:{free}]"
        if isinstance(values, ir.Load):
            value_entries = "".join(f", [{values.layout.strides[d]}, {node.domain[d]}]" for d in row) or ", [1, 1]"
            body.append(f"nisa.dma_copy(dst={picked}, src={values.buffer}.ap([[{value_stride}, rows]{value_entries}], "
                        f"offset={offset(values.layout)}, vector_offset=winner_int{column}, indirect_dim=0))")
        else:
            body.append(f"nisa.memset(dst={picked}, value={number(values.value)})")
        body += redirect_lines(column)
        body.append(f"nisa.dma_copy(dst={out}.ap([[1, rows]{row_entries}], offset=0, vector_offset=offsets{column}, "
                    f"indirect_dim=0), src={picked})")
    else:
        op = f"nl.{node.reduce}"
        if isinstance(values, ir.Load):
            body.append(f"nisa.dma_copy(dst=values_row{square}, src={values.buffer}.ap([[0, rows], "
                        f"[{value_stride}, rows]], offset={offset(values.layout)}))")
        else:
            body.append(f"nisa.memset(dst=values_row{square}, value={number(values.value)})")
        body += [
            # values_row = same ? values_row : identity, on the fp32 bit patterns (inf and nan pass untouched):
            # identity ^ ((values ^ identity) & mask), mask = 0 - same (all ones where same).
            f"nisa.tensor_copy(dst=mask{square}, src=same{square})",
            f"nisa.tensor_tensor(dst=mask{square}, data1=zero{square}, data2=mask{square}, op=nl.subtract)",
            f"nisa.tensor_tensor(dst=bits{square}, data1=values_row{square}.view(nl.int32), "
            f"data2=identity{square}.view(nl.int32), op=nl.bitwise_xor)",
            f"nisa.tensor_tensor(dst=bits{square}, data1=bits{square}, data2=mask{square}, op=nl.bitwise_and)",
            f"nisa.tensor_tensor(dst=values_row{square}.view(nl.int32), data1=identity{square}.view(nl.int32), "
            f"data2=bits{square}, op=nl.bitwise_xor)",
            f"nisa.tensor_reduce(dst=combined{column}, op={op}, data=values_row{square}, axis=1)",
        ]
        if node.reduce == "add":
            # A sum of zeros is -0.0 only when every term is -0.0, which the reduction does not promise: flags =
            # the bits of each selected value other than the sign bit (0 only for -0.0 or an unselected slot);
            # where their OR is 0, set combined's sign bit (combined is +-0.0 there).
            body += [
                f"nisa.tensor_scalar(dst=bits{square}, data=values_row{square}.view(nl.int32), op0=nl.bitwise_xor, "
                f"operand0={SIGN_BIT})",
                f"nisa.tensor_tensor(dst=bits{square}, data1=bits{square}, data2=mask{square}, op=nl.bitwise_and)",
                f"nisa.tensor_reduce(dst=flags{column}, op=nl.bitwise_or, data=bits{square}, axis=1)",
                f"nisa.tensor_scalar(dst=all_negative_zero{column}, data=flags{column}, op0=nl.equal, operand0=0.0)",
                f"nisa.tensor_copy(dst=flags{column}, src=all_negative_zero{column})",
                f"nisa.tensor_scalar(dst=flags{column}, data=flags{column}, op0=nl.left_shift, operand0=31)",
                f"nisa.tensor_tensor(dst=combined{column}.view(nl.int32), data1=combined{column}.view(nl.int32), "
                f"data2=flags{column}, op=nl.bitwise_or)",
            ]
        body += redirect_lines(column)
        body += [
            f"nisa.dma_copy(dst=current{column}, src={out}.ap([[1, rows], [1, 1]], offset=0, "
            f"vector_offset=offsets{column}, indirect_dim=0))",
            f"nisa.tensor_tensor(dst=current{column}, data1=current{column}, data2=combined{column}, op={op})",
            f"nisa.dma_copy(dst={out}.ap([[1, rows], [1, 1]], offset=0, vector_offset=offsets{column}, "
            f"indirect_dim=0), src=current{column})",
        ]
    sizes = {"column": (tile_rows, 1), "square": (tile_rows, tile_rows)}
    int_tiles = [("raw", "column"), ("base", "column"), ("offsets", "column"), ("raw_row", "square"),
                 ("base_row", "square")]
    float_tiles = [(tile, "column") for tile in ("shift", "wrapped", "low", "high", "bad", "keep", "address")]
    float_tiles += [(tile, "square") for tile in ("shift_row", "wrapped_row", "address_row", "same")]
    setup = []
    if node.reduce == "assign":
        int_tiles += [("winner_int", "column"), ("position_int", "square")]
        float_tiles += [("winner", "column"), ("position", "square")]
        picked_dtype = NL_DTYPES[values.dtype] if isinstance(values, ir.Load) else "nl.float32"
        setup.insert(0, f"picked = nl.ndarray(({tile_rows}, {free}), dtype={picked_dtype}, buffer=nl.sbuf)")
        setup += [f"nisa.iota(position_int[0:{tile_rows}, 0:{tile_rows}], [[1, {tile_rows}]], offset=0, "
                  "channel_multiplier=0)",
                  "nisa.tensor_copy(dst=position, src=position_int)"]
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
    allocations += setup
    return _render_loops(node, name, parameters, allocations, body, [node.domain[j] for j in outer], rows_total,
                         tile_rows, template="scatter.py.j2", prelude=tuple(_copy_lines(node, store.layout)))
