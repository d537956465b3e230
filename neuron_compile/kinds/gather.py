"""Kernel kind ``gather``: rows or elements read through the indirect DMA (``ir.Gather``: index_select,
embedding, gather, index.Tensor).

Fusion: the row form takes elementwise consumers that read its rows with its own index map as an epilogue
(Gemma's ``embedding * sqrt(hidden)``: computed on the gathered tile, the raw rows never stored); the element form
takes none. Tiling: the row form puts the index's last dim on partitions in tiles
of up to 128 and the source's trailing dims on the free axis, every leading dim an outer loop; the element form
puts the domain's last dim on partitions, one element each. Codegen (gather.py.j2): per tile the flat source
offsets (index values wrapped where the op wraps them, out-of-range ones redirected), then one indirect DMA: HBM to
HBM into the output when the row form stores the rows as they are (an embedding), else into SBUF for the stores.
"""

from __future__ import annotations

import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, Ref, TileAllocator, TileScope
from neuron_compile.codegen.kernel_text import Patterns, column_pattern, kernel_names, store_lines
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import register_kind
from neuron_compile.kinds.fusion_rules import MatchingIndexEpilogue
from neuron_compile.kinds.indirect import (
    column_address_lines,
    indirect_offset,
    redirect_lines,
    render_indirect,
    wrap_negative_lines,
)
from neuron_compile.limits import OUT_OF_RANGE_ROW, SBUF_SHARE
from neuron_compile.tiles import FP32_BYTES, TilePlan, TilingError, count_tiles

GATHER_TILES = 9  # the index, offset and flag columns and the gathered rows


def plan_gather(node: ir.Gather, target) -> TilePlan:
    """Row form: outer loops over the out dims before the index's last dim, that dim on partitions, the source's
    trailing dims (one row) on the free axis. Element form: the largest dim (the last of equals) on partitions,
    every other dim an outer loop (cross-entropy picks one element per row of a [rows, 1] domain: the rows go on
    partitions, not 1 element per tile)."""
    if node.elements:
        part = max(range(len(node.domain)), key=lambda dim: (node.domain[dim], dim))
        outer, free = [dim for dim in range(len(node.domain)) if dim != part], 1
    else:
        index_rank = len(node.index.layout.shape)
        outer, part = list(range(node.dim + index_rank - 1)), node.dim + index_rank - 1
        free = math.prod(node.source.layout.shape[node.dim + 1:])
    rows = node.domain[part]
    if not node.elements:
        check_epilogue_fits(node, free, target)
    return TilePlan("gather", tuple(LoopDim(node.domain[d], d) for d in outer),
                    LoopDim(rows, part, tile=min(target.partitions, rows)), (LoopDim(free, None, tile=free),),
                    GATHER_TILES)


def check_epilogue_fits(node: ir.Gather, free: int, target) -> None:
    """``TilingError`` when an epilogue's tiles ([rows, free] each, fp32 at most) beside the gathered rows would
    pass the SBUF share: the fusion pass then keeps the epilogue a kernel of its own (lowering already bounds the
    rows alone, lowering/indexing.py)."""
    epilogue = [store.expr for store in node.stores if not isinstance(store.expr, ir.Result)]
    if not epilogue:
        return
    needed = (1 + count_tiles(epilogue)) * free * FP32_BYTES
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE)
    if needed > budget:
        raise TilingError(f"{node.name}: the gathered rows and their epilogue need {needed} bytes per partition "
                          f"(> {budget}, the SBUF share)")


def render_row_gather(node: ir.Gather, plan: TilePlan, name: str, parameters: list[str]) -> str:
    """Index rows on partitions, the source's trailing dims on the free axis: one indirect DMA per row tile, into
    SBUF for the stores to read, or straight into the output when its one store is the rows themselves."""
    source, index, dim = node.source, node.index, node.dim
    index_rank = len(index.layout.shape)
    trailing = list(range(dim + 1, len(source.layout.shape)))
    free = math.prod(source.layout.shape[d] for d in trailing)
    tile_rows = plan.partition.tile
    # Outer loop variables: o<j> for out dims 0 .. dim + index_rank - 2 (source lead dims, then index lead dims).
    source_terms = [(f"o{j}", source.layout.strides[j]) for j in range(dim)]
    index_terms = [(f"o{dim + i}", index.layout.strides[i]) for i in range(index_rank - 1)]
    index_stride = index.layout.strides[-1]
    source_entries = [f"[{source.layout.strides[dim]}, rows]"] + [
        f"[{source.layout.strides[d]}, {source.layout.shape[d]}]" for d in trailing
    ] or ["[1, 1]"]
    if not trailing:
        source_entries.append("[1, 1]")
    window = "[0:rows, 0:1]"
    rows = (f"{source.buffer}.ap([{', '.join(source_entries)}], "
            f"offset={indirect_offset(source.layout.offset, source_terms)}, vector_offset=offsets{window}, "
            "indirect_dim=0)")
    body = [f"nisa.dma_copy(dst=raw{window}, src={index.buffer}.ap([[{index_stride}, rows], [1, 1]], "
            f"offset={indirect_offset(index.layout.offset, index_terms + [('p0', index_stride)])}))"]
    body += row_offset_lines(source.layout.shape[dim], node.wrap_negative, window)
    allocations = [f"raw = nl.ndarray(({tile_rows}, 1), dtype=nl.int32, buffer=nl.sbuf)",
                   f"offsets = nl.ndarray(({tile_rows}, 1), dtype=nl.int32, buffer=nl.sbuf)"]
    allocations += [f"{tile} = nl.ndarray(({tile_rows}, 1), dtype=nl.float32, buffer=nl.sbuf)"
                    for tile in ("wrapped", "distance", "keep", "redirect")[0 if node.wrap_negative else 1:]]
    direct = direct_store(node, plan)
    if direct is not None:
        # HBM to HBM: the rows need no SBUF stop, and the store no transfer of its own
        body.append(f"nisa.dma_copy(dst={direct}, src={rows})")
        return render_indirect(node, plan, name, parameters, allocations, body, "gather.py.j2")
    body.append(f"nisa.dma_copy(dst=gathered[0:rows, 0:{free}], src={rows})")
    allocations.append(f"gathered = nl.ndarray(({tile_rows}, {free}), dtype={NL_DTYPES[source.dtype]}, "
                       "buffer=nl.sbuf)")
    allocator = TileAllocator(tile_rows, reserved=kernel_names(node, parameters))
    body += row_store_lines(node, plan, allocator, free)
    return render_indirect(node, plan, name, parameters, allocations + allocator.lines, body, "gather.py.j2")


def row_offset_lines(size: int, wrap_negative: bool, window: str) -> list[str]:
    """The int32 ``offsets`` of a row tile's indices (``raw``): each index (wrapped to idx + size where idx < 0 when
    the op wraps, as index.Tensor does; index_select and embedding do not), or OUT_OF_RANGE_ROW where it lies outside
    [0, size). A valid index is an integer below size < 2^24 (checked), so the fp32 engine math is exact; an invalid
    one only needs to stay invalid. Four instructions, three deep: the first DMA of the rows waits on them."""
    lines, value = [], f"raw{window}"
    if wrap_negative:
        lines, value = wrap_negative_lines(value, size, window), f"wrapped{window}"
    # |idx - middle| <= middle exactly for 0 <= idx <= size - 1 (middle = (size - 1) / 2, exact); a bad index's
    # product with keep = 0 is exactly 0 (it is finite), so it lands exactly on OUT_OF_RANGE_ROW, never in range
    middle = (size - 1) / 2
    return lines + [
        f"nisa.tensor_scalar(dst=distance{window}, data={value}, op0=nl.subtract, operand0={middle!r}, "
        "op1=nl.abs_max, operand1=0.0)",
        f"nisa.tensor_scalar(dst=keep{window}, data=distance{window}, op0=nl.less_equal, operand0={middle!r})",
        f"nisa.tensor_scalar(dst=redirect{window}, data=distance{window}, op0=nl.greater, operand0={middle!r}, "
        f"op1=nl.multiply, operand1={float(OUT_OF_RANGE_ROW)})",
        f"nisa.scalar_tensor_tensor(dst=offsets{window}, data={value}, op0=nl.multiply, operand0=keep{window}, "
        f"op1=nl.add, operand1=redirect{window})",
    ]


def direct_store(node: ir.Gather, plan: TilePlan) -> str | None:
    """The HBM access pattern of a row tile of the output when the gather's one store is the gathered rows in the
    source's dtype (no epilogue, no cast): the indirect DMA then writes them there itself. None otherwise."""
    (store, *more) = node.stores
    if more or not isinstance(store.expr, ir.Result) or store.buffer.dtype != node.source.dtype:
        return None
    trailing = [LoopDim(size, dim) for dim, size in enumerate(node.domain) if dim > plan.partition.source]
    free_dims = [(dim, str(dim.size)) for dim in trailing] or [(LoopDim(1, None), "1")]
    return str(Patterns(plan).hbm(store.buffer.name, store.layout, free_dims, False))


def row_store_lines(node: ir.Gather, plan: TilePlan, allocator: TileAllocator, free: int) -> list[str]:
    """The gathered rows' stores: each store's expression (the rows themselves, or an epilogue over them) computed
    on the [rows, free] tile and written through its layout, the trailing dims of the domain on the free axis."""
    trailing = [LoopDim(size, dim) for dim, size in enumerate(node.domain) if dim > plan.partition.source]
    free_dims = [(dim, str(dim.size)) for dim in trailing] or [(LoopDim(1, None), "1")]
    patterns = Patterns(plan)

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:{free}]", patterns.hbm(load.buffer, load.layout, free_dims, False)

    scope = TileScope(allocator, free, f"[0:rows, 0:{free}]", load_pattern,
                      Ref(tile="gathered", dtype=node.source.dtype),
                      vector_pattern=column_pattern(plan, patterns, tuple(trailing)))
    lines: list[str] = []
    store_lines(node.stores, scope, patterns, free_dims, False, lines)
    return lines


def render_element_gather(node: ir.Gather, plan: TilePlan, name: str, parameters: list[str]) -> str:
    """aten.gather / index.Tensor with several indices: the plan's partition dim on partitions, every other dim an
    outer loop; per tile the flat source offset of each element is iota(the source layout restated over the
    domain) + sum(index * stride), gathered one element per partition by an indirect DMA over the flat source."""
    (store,) = node.stores
    source = node.source
    part = plan.partition.source
    tile_rows = plan.partition.tile
    outer = [dim.source for dim in plan.outer]  # loop o<k> walks domain dim outer[k]

    def terms(layout):
        return [(f"o{loop}", layout.strides[dim]) for loop, dim in enumerate(outer)] + [("p0", layout.strides[part])]

    window = "[0:rows, 0:1]"
    body = column_address_lines(source.layout, node.indices, terms, part, window)
    body += redirect_lines(window)
    body += [
        f"nisa.dma_copy(dst=gathered{window}, src={source.buffer}.ap([[1, rows], [1, 1]], offset=0, "
        f"vector_offset=offsets{window}, indirect_dim=0))",
        f"nisa.dma_copy(dst={store.buffer.name}.ap([[{store.layout.strides[part]}, rows], [1, 1]], "
        f"offset={indirect_offset(store.layout.offset, terms(store.layout))}), src=gathered{window})",
    ]
    allocations = [f"{tile} = nl.ndarray(({tile_rows}, 1), dtype=nl.int32, buffer=nl.sbuf)"
                   for tile in ("raw", "base", "offsets")]
    allocations += [f"{tile} = nl.ndarray(({tile_rows}, 1), dtype=nl.float32, buffer=nl.sbuf)"
                    for tile in ("shift", "wrapped", "low", "high", "bad", "keep", "address")]
    allocations.append(f"gathered = nl.ndarray(({tile_rows}, 1), dtype={NL_DTYPES[source.dtype]}, buffer=nl.sbuf)")
    return render_indirect(node, plan, name, parameters, allocations, body, "gather.py.j2")


class GatherKind(MatchingIndexEpilogue):
    node_type = ir.Gather
    name = "gather"

    def epilogue_reason(self, group, consumer, outside):
        if group.elements:
            return "an element gather (one element per partition) takes no epilogue"
        return super().epilogue_reason(group, consumer, outside)

    def operand_loads(self, node):
        return [node.source, node.index] + [entry[0] for entry in node.indices]

    def plan(self, node, target):
        return plan_gather(node, target)

    def render(self, node, plan, name, parameters):
        if node.elements:
            return render_element_gather(node, plan, name, parameters)
        return render_row_gather(node, plan, name, parameters)


register_kind(GatherKind())
