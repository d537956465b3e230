"""Codegen stage, gathers: an ``ir.Gather`` -> the source text of one indirect-DMA NKI kernel.

Input: the Gather node, the kernel's name, its parameter buffers and the target. Output: ``KernelSource``.
Loop structure: the source's dims before ``dim`` and the index's leading dims are outer loops, the index's last
dim goes on partitions (tiles of up to 128 rows), the source's trailing dims are the free axis of one row tile.
Per tile: DMA the indices into a (P, 1) int32 tile, wrap negatives and redirect out-of-range ones (below), one
indirect DMA ``source.ap(..., vector_offset=offsets, indirect_dim=0)`` gathers the rows, one DMA stores them.
"""

from __future__ import annotations

import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES
from neuron_compile.codegen.render import KernelSource, _output_lines, _render
from neuron_compile.limits import OUT_OF_RANGE_ROW

# An out-of-range index is redirected to OUT_OF_RANGE_ROW: times the dim's stride (>= 1) it lies beyond the
# source's span (checked in lowering/indexing.py), so the DMA's bounds check fails (err_tensor_access_out_of_bound)
# and the region falls back to eager, which raises IndexError as torch does. It is exact in fp32 and int32.


def _offset(base: int, terms: list[tuple[str, int]]) -> str:
    parts = [str(base)] + [f"{var} * {stride}" for var, stride in terms if stride != 0]
    return " + ".join(parts)


def render_gather(node: ir.Gather | ir.Scatter, name: str, parameters: list[str], target) -> KernelSource:
    if isinstance(node, ir.Scatter):
        from neuron_compile.codegen.scatter import render_scatter

        return render_scatter(node, name, parameters, target)
    if node.elements:
        return render_element_gather(node, name, parameters, target)
    (store,) = node.stores
    source, index, dim = node.source, node.index, node.dim
    size = source.layout.shape[dim]
    index_rank = len(index.layout.shape)
    trailing = list(range(dim + 1, len(source.layout.shape)))
    free = math.prod(source.layout.shape[d] for d in trailing)
    rows_total = index.layout.shape[-1]
    tile_rows = min(target.partitions, rows_total)
    out_layout = store.layout
    # Outer loop variables: o<j> for out dims 0 .. dim + index_rank - 2 (source lead dims, then index lead dims).
    outer = list(range(dim + index_rank - 1))
    source_terms = [(f"o{j}", source.layout.strides[j]) for j in range(dim)]
    index_terms = [(f"o{dim + i}", index.layout.strides[i]) for i in range(index_rank - 1)]
    out_terms = [(f"o{j}", out_layout.strides[j]) for j in outer]
    out_row = dim + index_rank - 1
    index_stride = index.layout.strides[-1]
    source_entries = [f"[{source.layout.strides[dim]}, rows]"] + [
        f"[{source.layout.strides[d]}, {source.layout.shape[d]}]" for d in trailing
    ] or ["[1, 1]"]
    if not trailing:
        source_entries.append("[1, 1]")
    out_entries = [f"[{out_layout.strides[out_row]}, rows]"] + [
        f"[{out_layout.strides[j]}, {out_layout.shape[j]}]" for j in range(out_row + 1, len(out_layout.shape))
    ]
    if not trailing:
        out_entries.append("[1, 1]")
    window = "[0:rows, 0:1]"
    body = [
        f"nisa.dma_copy(dst=raw{window}, src={index.buffer}.ap([[{index_stride}, rows], [1, 1]], "
        f"offset={_offset(index.layout.offset, index_terms + [('p0', index_stride)])}))",
        # index.Tensor wraps negative indices like eager: idx + size where idx < 0 (index_select and embedding
        # do not: a negative index is out of range there). A valid index is an integer below size < 2^24
        # (checked), so the fp32 engine math is exact; an invalid one only needs to stay invalid.
        f"nisa.tensor_scalar(dst=shift{window}, data=raw{window}, op0=nl.less, operand0=0.0, op1=nl.multiply, "
        f"operand1={float(size) if node.wrap_negative else 0.0})",
        f"nisa.tensor_tensor(dst=wrapped{window}, data1=raw{window}, data2=shift{window}, op=nl.add)",
        # bad = (wrapped < 0) + (wrapped >= size), 0 or 1; offsets = wrapped * (1 - bad) + bad * OUT_OF_RANGE_ROW
        # (wrapped * 0 is exactly 0, so a bad index lands exactly on OUT_OF_RANGE_ROW, never back in range).
        f"nisa.tensor_scalar(dst=low{window}, data=wrapped{window}, op0=nl.less, operand0=0.0)",
        f"nisa.tensor_scalar(dst=high{window}, data=wrapped{window}, op0=nl.greater_equal, operand0={float(size)})",
        f"nisa.tensor_tensor(dst=bad{window}, data1=low{window}, data2=high{window}, op=nl.add)",
        f"nisa.tensor_scalar(dst=keep{window}, data=bad{window}, op0=nl.multiply, operand0=-1.0, op1=nl.add, "
        "operand1=1.0)",
        f"nisa.tensor_tensor(dst=wrapped{window}, data1=wrapped{window}, data2=keep{window}, op=nl.multiply)",
        f"nisa.tensor_scalar(dst=bad{window}, data=bad{window}, op0=nl.multiply, operand0={float(OUT_OF_RANGE_ROW)})",
        f"nisa.tensor_tensor(dst=offsets{window}, data1=wrapped{window}, data2=bad{window}, op=nl.add)",
        f"nisa.dma_copy(dst=gathered[0:rows, 0:{free}], src={source.buffer}.ap([{', '.join(source_entries)}], "
        f"offset={_offset(source.layout.offset, source_terms)}, vector_offset=offsets{window}, indirect_dim=0))",
        f"nisa.dma_copy(dst={store.buffer.name}.ap([{', '.join(out_entries)}], "
        f"offset={_offset(out_layout.offset, out_terms + [('p0', out_layout.strides[out_row])])}), "
        f"src=gathered[0:rows, 0:{free}])",
    ]
    allocations = [f"raw = nl.ndarray(({tile_rows}, 1), dtype=nl.int32, buffer=nl.sbuf)",
                   f"offsets = nl.ndarray(({tile_rows}, 1), dtype=nl.int32, buffer=nl.sbuf)"]
    allocations += [f"{tile} = nl.ndarray(({tile_rows}, 1), dtype=nl.float32, buffer=nl.sbuf)"
                    for tile in ("shift", "wrapped", "low", "high", "bad", "keep")]
    allocations.append(f"gathered = nl.ndarray(({tile_rows}, {free}), dtype={NL_DTYPES[source.dtype]}, "
                       "buffer=nl.sbuf)")
    return _render_loops(node, name, parameters, allocations, body, [out_layout.shape[j] for j in outer],
                         rows_total, tile_rows)


def render_element_gather(node: ir.Gather, name: str, parameters: list[str], target) -> KernelSource:
    """aten.gather / index.Tensor with several indices: the domain's last dim on partitions, every other dim an
    outer loop; per tile the flat source offset of each element is iota(the source layout restated over the
    domain) + sum(index * stride), gathered one element per partition by an indirect DMA over the flat source."""
    (store,) = node.stores
    source = node.source
    rank = len(node.domain)
    part = rank - 1
    rows_total = node.domain[part]
    tile_rows = min(target.partitions, rows_total)
    outer = list(range(rank - 1))

    def terms(layout):
        return [(f"o{j}", layout.strides[j]) for j in outer] + [("p0", layout.strides[part])]

    window = "[0:rows, 0:1]"
    body = column_address_lines(source.layout, node.indices, terms, part, window)
    body += redirect_lines(window)
    body += [
        f"nisa.dma_copy(dst=gathered{window}, src={source.buffer}.ap([[1, rows], [1, 1]], offset=0, "
        f"vector_offset=offsets{window}, indirect_dim=0))",
        f"nisa.dma_copy(dst={store.buffer.name}.ap([[{store.layout.strides[part]}, rows], [1, 1]], "
        f"offset={_offset(store.layout.offset, terms(store.layout))}), src=gathered{window})",
    ]
    allocations = [f"{tile} = nl.ndarray(({tile_rows}, 1), dtype=nl.int32, buffer=nl.sbuf)"
                   for tile in ("raw", "base", "offsets")]
    allocations += [f"{tile} = nl.ndarray(({tile_rows}, 1), dtype=nl.float32, buffer=nl.sbuf)"
                    for tile in ("shift", "wrapped", "low", "high", "bad", "keep", "address")]
    allocations.append(f"gathered = nl.ndarray(({tile_rows}, 1), dtype={NL_DTYPES[source.dtype]}, buffer=nl.sbuf)")
    return _render_loops(node, name, parameters, allocations, body, [node.domain[j] for j in outer],
                         rows_total, tile_rows)


def column_address_lines(base: ir.Layout, indices, terms, part: int, window: str) -> list[str]:
    """The flat offset of each element of a tile on its partition, in the fp32 tile ``address``, with ``bad``
    flags: an iota of ``base`` (the addressed layout restated over the domain, stride 0 on index-driven dims) plus
    each index's contribution. ``terms(layout)`` names the loop variables' part of a layout's offset."""
    lines = [
        # The output coordinates' part of the offset: exact int32 iota on GpSimd (stride 0 on index-driven dims).
        f"nisa.iota(base{window}, [[0, 1]], offset={_offset(base.offset, terms(base))}, "
        f"channel_multiplier={base.strides[part]})",
        f"nisa.memset(dst=bad{window}, value=0.0)",
        f"nisa.tensor_copy(dst=address{window}, src=base{window})",
    ]
    return lines + element_address_lines(
        indices, lambda index: f"{index.buffer}.ap([[{index.layout.strides[part]}, rows], [1, 1]], "
        f"offset={_offset(index.layout.offset, terms(index.layout))})", window)


def element_address_lines(indices, index_pattern, window: str, suffix: str = "", check: bool = True) -> list[str]:
    """Add each index's contribution to the fp32 tile ``address{suffix}`` (initialised by the caller).

    ``indices`` holds (Load, stride, size, wrap) entries; ``index_pattern(load)`` is the HBM access pattern that
    DMAs the load into ``raw{suffix}{window}``. index.Tensor / index_put wrap idx < 0 to idx + size (gather and
    scatter do not); with ``check``, ``bad`` becomes 1 where an index lies outside [0, size). For valid indices
    every partial sum is an integer below the span < 2^24 (checked by the lowerings): exact fp32.
    """
    raw, shift, wrapped, address = (f"{tile}{suffix}{window}" for tile in ("raw", "shift", "wrapped", "address"))
    lines = []
    for index, stride, size, wrap in indices:
        lines += [
            f"nisa.dma_copy(dst={raw}, src={index_pattern(index)})",
            f"nisa.tensor_scalar(dst={shift}, data={raw}, op0=nl.less, operand0=0.0, op1=nl.multiply, "
            f"operand1={float(size) if wrap else 0.0})",
            f"nisa.tensor_tensor(dst={wrapped}, data1={raw}, data2={shift}, op=nl.add)",
        ]
        if check:
            lines += [
                f"nisa.tensor_scalar(dst=low{window}, data={wrapped}, op0=nl.less, operand0=0.0)",
                f"nisa.tensor_scalar(dst=high{window}, data={wrapped}, op0=nl.greater_equal, "
                f"operand0={float(size)})",
                f"nisa.tensor_tensor(dst=bad{window}, data1=bad{window}, data2=low{window}, op=nl.maximum)",
                f"nisa.tensor_tensor(dst=bad{window}, data1=bad{window}, data2=high{window}, op=nl.maximum)",
            ]
        lines += [
            f"nisa.tensor_scalar(dst={wrapped}, data={wrapped}, op0=nl.multiply, operand0={float(stride)})",
            f"nisa.tensor_tensor(dst={address}, data1={address}, data2={wrapped}, op=nl.add)",
        ]
    return lines


def redirect_lines(window: str) -> list[str]:
    """``offsets`` (int32) = ``address``, or OUT_OF_RANGE_ROW where ``bad``: a bad element's address (finite:
    |idx| < 2^31, stride < 2^24) is zeroed by keep = 0 and redirected beyond the buffer, so the DMA's bounds
    check fails, never an access of another element."""
    return [
        f"nisa.tensor_scalar(dst=keep{window}, data=bad{window}, op0=nl.multiply, operand0=-1.0, op1=nl.add, "
        "operand1=1.0)",
        f"nisa.tensor_tensor(dst=address{window}, data1=address{window}, data2=keep{window}, op=nl.multiply)",
        f"nisa.tensor_scalar(dst=bad{window}, data=bad{window}, op0=nl.multiply, operand0={float(OUT_OF_RANGE_ROW)})",
        f"nisa.tensor_tensor(dst=offsets{window}, data1=address{window}, data2=bad{window}, op=nl.add)",
    ]


def _render_loops(node, name: str, parameters: list[str], allocations: list[str], body: list[str],
                  outer_sizes: list[int], rows_total: int, tile_rows: int, template: str = "gather.py.j2",
                  prelude: tuple[str, ...] = ()) -> KernelSource:
    """Gathers and scatters: ``prelude`` (lines at kernel level), one loop per outer dim (``o0``, ``o1``, ...),
    then row tiles of ``tile_rows``."""
    loops, depth = ["    " + line for line in prelude], 1
    for j, size in enumerate(outer_sizes):
        loops.append("    " * depth + f"for o{j} in range({size}):")
        depth += 1
    loops.append("    " * depth + f"for p0 in range(0, {rows_total}, {tile_rows}):")
    loops.append("    " * (depth + 1) + f"rows = min({tile_rows}, {rows_total} - p0)")
    (store,) = node.stores
    text = _render(
        template, name=name, parameters=parameters, docstring=ir.format_node(node),
        outputs=_output_lines(node.stores), allocations=allocations, loops=loops, body=body, depth=depth + 1,
        returns=store.buffer.name,
    )
    return KernelSource(name, text, tuple(parameters), (store.buffer,))
