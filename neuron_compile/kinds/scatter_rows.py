"""Kernel kind ``scatter``, its row forms' shared lines and the accumulating row form (``ir.Scatter`` with
``reduce="add"`` and ``row_dims``: index_put with accumulate of whole rows, as the embedding gradient is).

Input: the node, its TilePlan (the indexed rows on partitions, each row on the free axis) and the address helpers
of kinds/indirect.py. Output: kernel lines per tile of up to 128 rows:

* ``same[p, j]``: which rows of the tile go to the same target row (``collision_lines``, shared with the element
  forms of kinds/scatter.py);
* the tile's duplicates summed on TensorE: ``sums = same @ values`` (``same`` is symmetric, so it is its own
  stationary operand; 0/1 is exact in bf16), per chunk of 512 columns, one PSUM bank of fp32. A product
  ``0 * inf`` would be nan, so the values enter the matmul with every inf and nan zeroed, and two more 0/1
  matmuls count, per row and column, the group's values that are +inf or nan (``plus_flags``) and -inf or nan
  (``minus_flags``); ``4 * 2**127 * plus - 4 * 2**127 * minus`` is then +-inf, nan (both) or 0 (neither),
  exactly what the group's specials add to the finite sum in IEEE arithmetic, whatever their order;
* every row of the tile then reads its target row (indirect DMA), adds its group's sum and writes it back:
  duplicates write one value. Tiles run in order.

What this form does not reproduce, and so where the lowering does not choose it: a -0.0 in the target before the
scatter (``-0.0 + -0.0`` stays -0.0 in eager; the matmul's sum of zeros is +0.0), so the base must be a constant
fill that is not -0.0 (the embedding gradient's zeros). The fp32 sum of a group is in another order than eager's
one-by-one adds (within rounding, as any reduction).
"""

from __future__ import annotations

from collections.abc import Callable

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, number
from neuron_compile.kinds.indirect import column_address_lines, element_address_lines, indirect_offset, redirect_lines
from neuron_compile.tiles import TilePlan

COLUMN, SQUARE = "[0:rows, 0:1]", "[0:rows, 0:rows]"  # one value per partition; one row of the tile per partition
CHUNK = 512  # columns per matmul: one PSUM bank of fp32
# A count of specials times 2**127 is 2**127 (finite) for one, inf from two on; times 4 it is inf from one on.
SPECIAL_SCALE = 2.0**127


def collision_lines(node: ir.Scatter, plan: TilePlan, offset: Callable, terms: Callable) -> list[str]:
    """Each element's target offset on its partition (``address``, ``bad``), the same offsets along the free axis
    of every partition, and ``same[p, j]``: which elements of the tile hit the same place."""
    part = plan.partition.source
    lines = column_address_lines(node.target, node.indices, terms, part, COLUMN)
    lines += [
        f"nisa.iota(base_row{SQUARE}, [[{node.target.strides[part]}, rows]], offset={offset(node.target)}, "
        "channel_multiplier=0)",
        f"nisa.tensor_copy(dst=address_row{SQUARE}, src=base_row{SQUARE})",
    ]
    lines += element_address_lines(
        node.indices, lambda index: f"{index.buffer}.ap([[0, rows], [{index.layout.strides[part]}, rows]], "
        f"offset={offset(index.layout)})", SQUARE, suffix="_row", check=False)
    lines.append(f"nisa.tensor_scalar(dst=same{SQUARE}, data=address_row{SQUARE}, op0=nl.equal, "
                 f"operand0=address{COLUMN})")
    return lines


def fill_lines(node: ir.Scatter) -> list[str]:
    """out = a constant base (``node.base`` a Scalar): one SBUF tile of the fill stored over the output's last two
    dims, 128 rows a DMA (per index of the dims before them, loop variables c0, c1, ...), instead of an HBM -> HBM
    copy of a filled buffer (its bytes cross HBM twice, and the fill's own kernel writes them once more)."""
    out = node.stores[0].layout
    (rows, row_stride), (width, column_stride) = [(out.shape[d], out.strides[d]) for d in (-2, -1)]
    name = node.stores[0].buffer.name
    lines = [f"fill = nl.ndarray(({min(rows, 128)}, {width}), dtype={NL_DTYPES[node.stores[0].buffer.dtype]}, "
             "buffer=nl.sbuf)", f"nisa.memset(dst=fill, value={number(node.base.value)})"]
    depth = 0
    for d in range(len(out.shape) - 2):
        lines.append("    " * depth + f"for c{d} in range({out.shape[d]}):")
        depth += 1
    terms = [(f"c{d}", out.strides[d]) for d in range(len(out.shape) - 2)] + [("r0", row_stride)]
    pattern = f"[[{row_stride}, min(128, {rows} - r0)], [{column_stride}, {width}]]"
    offset = indirect_offset(out.offset, terms)
    lines += ["    " * depth + f"for r0 in range(0, {rows}, 128):",
              "    " * depth + f"    nisa.dma_copy(dst={name}.ap({pattern}, offset={offset}), "
              f"src=fill[0:min(128, {rows} - r0), 0:{width}])"]
    return lines


def row_entries(node: ir.Scatter, layout: ir.Layout) -> str:
    """The access-pattern entries of one row (the trailing dims no index drives) in ``layout``."""
    rank = len(node.domain)
    return "".join(f", [{layout.strides[d]}, {node.domain[d]}]" for d in range(rank - node.row_dims, rank)) \
        or ", [1, 1]"


def row_sum_lines(node: ir.Scatter, plan: TilePlan, offset: Callable) -> list[str]:
    """The tile's rows summed per target on TensorE, then added to the target rows (read-modify-write)."""
    part, values, out = plan.partition.source, node.values, node.stores[0].buffer.name
    width = plan.free[0].size
    lines = [
        f"nisa.tensor_copy(dst=selection{SQUARE}, src=same{SQUARE})",
        f"nisa.tensor_scalar(dst=special_selection{SQUARE}, data=same{SQUARE}, op0=nl.multiply, "
        f"operand0={SPECIAL_SCALE!r})",
        f"nisa.dma_copy(dst=values[0:rows, 0:{width}], src={values.buffer}.ap([[{values.layout.strides[part]}, rows]"
        f"{row_entries(node, values.layout)}], offset={offset(values.layout)}))",
    ]
    lines += redirect_lines(COLUMN)
    target = f"{out}.ap([[1, rows]{row_entries(node, node.target)}], offset=0, vector_offset=offsets{COLUMN}, " \
             "indirect_dim=0)"
    lines.append(f"nisa.dma_copy(dst=current[0:rows, 0:{width}], src={target})")
    lines.append(f"for c0 in range(0, {width}, {CHUNK}):")
    lines += ["    " + line for line in _chunk_lines(width)]
    lines.append(f"nisa.dma_copy(dst={target}, src=current[0:rows, 0:{width}])")
    return lines


def _chunk_lines(width: int) -> list[str]:
    """One chunk of columns: the finite values and the special counts through TensorE, the sums added. The flags
    and the final add (SBUF only) go to GpSimd, the scaling of one count to ScalarE, what reads PSUM with two
    operands stays on VectorE: no engine does most of the chunk's work."""
    chunk, part = "[0:rows, 0:cols]", "[0:rows, c0:c0 + cols]"
    return [
        f"cols = min({CHUNK}, {width} - c0)",
        f"nisa.tensor_scalar(dst=finite{chunk}, data=values{part}, op0=nl.multiply, operand0=0.0, op1=nl.equal, "
        "operand1=0.0, engine=nisa.engine.gpsimd)",
        f"nisa.select_reduce(dst=finite_values{chunk}, predicate=finite{chunk}, on_true=values{part}, "
        "on_false=0.0)",
        f"nisa.tensor_scalar(dst=plus_flags{chunk}, data=values{part}, op0=nl.less, operand0=float('inf'), "
        "op1=nl.subtract, operand1=1.0, reverse1=True, engine=nisa.engine.gpsimd)",
        f"nisa.tensor_scalar(dst=minus_flags{chunk}, data=values{part}, op0=nl.greater, operand0=float('-inf'), "
        "op1=nl.subtract, operand1=1.0, reverse1=True, engine=nisa.engine.gpsimd)",
        f"nisa.nc_matmul(dst=sums{chunk}, stationary=selection{SQUARE}, moving=finite_values{chunk})",
        f"nisa.nc_matmul(dst=plus_counts{chunk}, stationary=special_selection{SQUARE}, moving=plus_flags{chunk})",
        f"nisa.nc_matmul(dst=minus_counts{chunk}, stationary=special_selection{SQUARE}, moving=minus_flags{chunk})",
        f"nisa.activation(dst=minus_infinities{chunk}, op=nl.copy, data=minus_counts{chunk}, scale=4.0)",
        f"nisa.scalar_tensor_tensor(dst=specials{chunk}, data=plus_counts{chunk}, op0=nl.multiply, operand0=4.0, "
        f"op1=nl.subtract, operand1=minus_infinities{chunk})",
        f"nisa.tensor_tensor(dst=specials{chunk}, data1=sums{chunk}, data2=specials{chunk}, op=nl.add)",
        f"nisa.tensor_tensor(dst=current{part}, data1=current{part}, data2=specials{chunk}, op=nl.add, "
        "engine=nisa.engine.gpsimd)",
    ]


def row_sum_allocations(node: ir.Scatter, plan: TilePlan) -> list[str]:
    """The row-sum form's own tiles: the sums' matmul operands in the values' dtype (bf16 stays bf16: 0/1 and the
    values are exact in it) or fp32; the special counts' in bf16 whatever the values' (0, 1 and 2**127 are exact
    in it: a quarter of fp32's TensorE time); one PSUM bank each for the sums and the two counts."""
    tile, width = plan.partition.tile, plan.free[0].size
    operand = "nl.bfloat16" if node.values.dtype == "bfloat16" else "nl.float32"
    tiles = [
        ("selection", (tile, tile), operand), ("special_selection", (tile, tile), "nl.bfloat16"),
        ("values", (tile, width), NL_DTYPES[node.values.dtype]), ("current", (tile, width), "nl.float32"),
        ("finite", (tile, CHUNK), "nl.uint8"), ("finite_values", (tile, CHUNK), operand),
        ("plus_flags", (tile, CHUNK), "nl.bfloat16"), ("minus_flags", (tile, CHUNK), "nl.bfloat16"),
        ("minus_infinities", (tile, CHUNK), "nl.float32"), ("specials", (tile, CHUNK), "nl.float32"),
    ]
    lines = [f"{name} = nl.ndarray({shape}, dtype={dtype}, buffer=nl.sbuf)" for name, shape, dtype in tiles]
    return lines + [f"{name} = nl.ndarray(({tile}, {CHUNK}), dtype=nl.float32, buffer=nl.psum)"
                    for name in ("sums", "plus_counts", "minus_counts")]
