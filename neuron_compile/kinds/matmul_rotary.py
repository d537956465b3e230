"""Kernel kind ``matmul_rotary``: a q or k projection whose product the rotary embedding reads in the same kernel
(``ir.MatMulRotary``).

Fusion: made after grouping by passes/rotary_epilogues.py under the rule in kinds/rotary_epilogue_rule.py (a
concat of ``x * cos + rotate_half(x) * sin`` over the projection's heads, which then never reads q or k back from
HBM); it takes no further fusion. Tiling: the projection's own plan (a plain or a normed matmul, resident form),
in the SBUF left beside the rotary's tiles; every N tile holds whole heads (the rule asks ``head_dim`` to divide
each N tile). Codegen: matmul_resident.py.j2; each N tile's epilogue, after the projection's own stores, rounds the
product as the projection stores it and computes every concat part on the tile's heads: a part's reads of the
product are views of that tile ([rows, heads, width] from its column within the head: rotate_half's other half is
the same tile at +-head_dim/2), cos and sin one [rows, width] DMA each per row block, read through a view
repeating them for every head, and the parts' values are assembled into one tile of whole heads stored by one DMA
(or stored part by part when their layout is not the product's). A per-head norm first (``norm``) is the reduction
kind's row body on the tile's heads, read from the rounded product on chip. The same instructions on the same values
as the kernels it replaces.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import (
    NL_DTYPES,
    AccessPattern,
    Ref,
    TileAllocator,
    TileScope,
    bind_load,
    emit,
    emit_store,
    stored_tile,
)
from neuron_compile.codegen.kernel_text import Patterns, kernel_context, kernel_names, offset_text, render_template
from neuron_compile.kind_registry import KernelKind, describe, kind_of, loads, register_kind
from neuron_compile.dims import LoopDim
from neuron_compile.kinds.reduction import reduction_body
from neuron_compile.kinds.rotary_epilogue_rule import HeadAxes, head_axes, norm_axes, normed_heads
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TilePlan, TilingError


def as_matmul(node: ir.MatMulRotary):
    """The projection alone: its stores, and the product the rotary reads when it still goes to HBM."""
    stores = node.matmul.stores + ((node.source,) if node.store_source else ())
    return dataclasses.replace(node.matmul, stores=stores)


def rotated(node: ir.MatMulRotary) -> ir.Store:
    """The store the rotary reads: the product's, or the per-head norm's normed heads (over the product's domain)."""
    return node.source if node.norm is None else normed_heads(node.domain, node.source, node.norm)


def part_axes(node: ir.MatMulRotary, part: ir.Pointwise) -> HeadAxes:
    """Where ``part``'s dims lie in the projection's output (the rule checked that they do)."""
    load = next(load for load in loads(part) if load.buffer == rotated(node).buffer.name)
    return head_axes(node.domain, rotated(node), load, node.head_dim)


def head_pattern(buffer: str, layout: ir.Layout, axes: HeadAxes, width: int, heads: bool = True) -> AccessPattern:
    """The HBM access pattern of a part's [rows, heads, width] values in this N tile (``h0`` its first head), or of
    one head's [rows, width] (``heads`` False: cos and sin, the same for every head)."""
    def stride(dim: int | None) -> int:
        return 0 if dim is None else layout.strides[dim]

    terms = [(f"o{batch}", layout.strides[dim]) for dim, batch in axes.batch] + [("p0", stride(axes.rows))]
    entries = [(stride(axes.rows), "rows")] + ([(stride(axes.heads), "heads")] if heads else [])
    terms += [("h0", stride(axes.heads))] if heads else []
    return AccessPattern(buffer, (*entries, (stride(axes.within), width)), offset_text(layout.offset, terms))


def heads_view(tile: str, row: int, head_dim: int, width: int, column: int) -> str:
    """A [rows, heads, width] view of ``tile`` (``row`` elements per partition) from ``column`` of each head."""
    return f"{tile}.ap([[{row}, rows], [{head_dim}, heads], [1, {width}]], offset={column})"


@dataclasses.dataclass
class RowOperands:
    """A rotary's cos and sin (its loads that are the same for every head): one [rows, width] tile per row block
    of the group, loaded at the group's first N tile (``first``: its f0) and read by every N tile after it through
    a view repeating it for each head, instead of a DMA per N tile."""

    allocator: TileAllocator
    first: str
    tiles: dict[str, str] = dataclasses.field(default_factory=dict)  # HBM pattern -> the list of tiles' name
    group_tiles: list[str] = dataclasses.field(default_factory=list)
    once: list[str] = dataclasses.field(default_factory=list)  # lines before the loops (a per-head norm's weight)

    def ref(self, load: ir.Load, source: AccessPattern, width: int, lines: list[str]) -> Ref:
        """The view ``load`` is read through; the DMA filling its tile appended to ``lines`` the first time."""
        if str(source) not in self.tiles:
            name = self.tiles[str(source)] = self.allocator.take_name(f"{load.buffer}_rows")
            self.group_tiles.append(f"{name} = [nl.ndarray(({self.allocator.partitions}, {width}), "
                                    f"dtype={NL_DTYPES[load.dtype]}, buffer=nl.sbuf) for _ in range(blocks)]")
            lines.append(f"nisa.dma_copy(dst={name}[block][0:rows, 0:{width}], src={source})")
        tile = f"{self.tiles[str(source)]}[block]"
        view = f"{tile}.ap([[{width}, rows], [0, heads], [1, {width}]], offset=0)"
        return Ref(tile=tile, dtype=load.dtype, view=view)


def whole_heads(node: ir.MatMulRotary) -> dict[str, ir.Layout]:
    """The buffers the parts' stores fill together in whole heads laid out as the product is (each head's
    ``head_dim`` columns contiguous, heads ``head_dim`` apart), by the layout of the head's first column: assembled
    in one tile, they go to HBM in one contiguous DMA per N tile instead of one per part."""
    writes: dict[str, list[tuple[ir.Layout, HeadAxes, int]]] = {}
    for part in node.rotary.parts:
        axes = dataclasses.replace(part_axes(node, part), column=0)
        width = 1 if axes.within is None else part.domain[axes.within]
        for store in part.stores:
            writes.setdefault(store.buffer.name, []).append((store.layout, axes, width))
    whole = {}
    for buffer, stores in writes.items():
        (layout, axes, _), base = stores[0], min(layout.offset for layout, _, _ in stores)
        same = all(other.strides == layout.strides and other_axes == axes for other, other_axes, _ in stores)
        contiguous = (axes.within is None or layout.strides[axes.within] == 1) and (
            axes.heads is None or layout.strides[axes.heads] == node.head_dim)
        columns = sorted((other.offset - base, width) for other, _, width in stores)
        ends = [column + width for column, width in columns]
        if same and contiguous and [column for column, _ in columns] == [0, *ends[:-1]] and ends[-1] == node.head_dim:
            whole[buffer] = dataclasses.replace(layout, offset=base)
    return whole


def part_lines(node: ir.MatMulRotary, part: ir.Pointwise, value: str, n_tile: int, operands: RowOperands,
               assembled: dict[str, tuple[str, int]], lines: list[str]) -> None:
    """``part`` computed on the heads of this N tile from ``value`` (the rounded product, [rows, n_tile]): its
    values copied into their columns of the ``assembled`` tiles (by buffer: the tile, the offset of a head's first
    column), or stored by a DMA of their own."""
    axes = part_axes(node, part)
    width = 1 if axes.within is None else part.domain[axes.within]

    def unexpected(load: ir.Load, tile: str):
        raise TilingError(f"{node.name}: {part.name}'s load of {load.buffer} is neither the product nor per head")

    scope = TileScope(operands.allocator, n_tile // node.head_dim * width, f"[0:rows, 0:heads * {width}]",
                      unexpected)
    first_loads: list[str] = []
    for load in loads(part):
        if load.buffer == rotated(node).buffer.name:
            column = head_axes(node.domain, rotated(node), load, node.head_dim).column
            view = heads_view(value, n_tile, node.head_dim, width, column)
            bind_load(scope, load, Ref(tile=value, dtype=load.dtype, view=view))
        else:
            pattern = head_pattern(load.buffer, load.layout, axes, width, heads=False)
            bind_load(scope, load, operands.ref(load, pattern, width, first_loads))
    if first_loads:
        lines += [f"if f0 == {operands.first}:  # cos and sin for every N tile of this row block"]
        lines += ["    " + line for line in first_loads]
    for store in part.stores:
        result = emit(store.expr, scope, lines)
        if store.buffer.name in assembled:
            tile, first_column = assembled[store.buffer.name]
            destination = heads_view(tile, n_tile, node.head_dim, width, store.layout.offset - first_column)
            whole_tile = result.tile is not None and not result.vector  # else a number or a (P, 1) value
            data = scope.ref_text(result) if whole_tile else emit_store(store.buffer.dtype, result, scope, lines)
            lines.append(f"nisa.activation(dst={destination}, op=nl.copy, data={data})")
        else:
            tile = emit_store(store.buffer.dtype, result, scope, lines)
            lines.append(f"nisa.dma_copy(dst={head_pattern(store.buffer.name, store.layout, axes, width)}, "
                         f"src={tile})")


def head_norm_plan(node: ir.MatMulRotary, plan: TilePlan) -> TilePlan:
    """The per-head norm's plan for one N tile of one row block: the projection's loops and row tiles, the tile's
    heads as rows beside each other on a partition (``grouped_rows``), each head's columns the reduced row."""
    heads, axes = plan.free[0].tile // node.head_dim, norm_axes(node.domain, node.source, node.norm)
    batch = {matmul_dim: dim for dim, matmul_dim in axes.batch}
    outer = tuple(LoopDim(dim.size, batch.get(index), 1, 1) for index, dim in enumerate(plan.outer))
    partition = LoopDim(plan.partition.size, axes.rows, 1, plan.partition.tile)
    free = (LoopDim(heads, axes.heads, 1, heads), LoopDim(node.head_dim, axes.within, 1, node.head_dim))
    return TilePlan("reduction", outer, partition, free, 0, grouped_rows=True)


def head_norm_lines(node: ir.MatMulRotary, plan: TilePlan, value: str, operands: RowOperands, lines: list[str],
                    allocator: TileAllocator) -> str:
    """The per-head norm of this N tile's heads (the reduction kind's row body, reading ``value``, the rounded
    product, where the norm kernel loads it), its normed heads computed into a tile, whose name it returns. The
    norm's loads count heads in ``cols``, which the tile's columns get back after it (the rule asks for whole
    tiles of heads)."""
    norm = dataclasses.replace(node.norm, row_stores=())
    on_chip = tuple((load, value) for expr in kind_of(norm).exprs(norm) for load in ir.loads_of(expr)
                    if load.buffer == node.source.buffer.name)
    normed = node.norm.row_stores[0]
    norm_plan = head_norm_plan(node, plan)
    body = reduction_body(norm, norm_plan, allocator, Patterns(norm_plan),
                          operands=((normed.expr, normed.buffer.dtype),), on_chip=tuple(dict.fromkeys(on_chip)))
    operands.once += body.once
    lines += [f"# {node.norm.name}: each head's RMSNorm, the tile's {norm_plan.free[0].size} heads as rows beside "
              "each other on a partition (cols counts heads here)", f"cols = {norm_plan.free[0].size}"]
    for walk, after in body.passes:
        lines += walk + after
    lines.append(f"cols = {plan.free[0].tile}")
    return body.operands[0]


def rotary_epilogue(node: ir.MatMulRotary, plan: TilePlan, operands: RowOperands, scope: TileScope,
                    lines: list[str]) -> None:
    """An N tile's epilogue lines after the projection's other stores: the product rounded as it is stored (and
    stored, when something else reads it), its heads normed (``norm``), then every part of the rotary on the
    tile's heads, each part's values copied (on ScalarE, which only evacuates PSUM here) into the tile of their
    buffer's whole heads."""
    value = stored_tile(node.source.buffer.dtype, emit(node.source.expr, scope, lines), scope, lines)
    free = [(plan.free[0], "cols")]
    if node.store_source:
        destination = Patterns(plan).hbm(node.source.buffer.name, node.source.layout, free, True)
        lines.append(f"nisa.dma_copy(dst={destination}, src={value}{scope.slice_text})")
    if node.norm is not None:
        value = head_norm_lines(node, plan, value, operands, lines, scope.allocator)
    lines += [f"# the rotary on this tile's heads of {node.head_dim}: rotate_half reads the same tile",
              f"h0 = f0 // {node.head_dim}", f"heads = cols // {node.head_dim}"]
    whole = whole_heads(node)
    assembled = {buffer: (scope.tile(stored_dtype(node, buffer), stem=f"{buffer}_heads"), layout.offset)
                 for buffer, layout in whole.items()}
    for part in node.rotary.parts:
        part_lines(node, part, value, plan.free[0].tile, operands, assembled, lines)
    for buffer, layout in whole.items():
        axes = part_axes(node, node.rotary.parts[0])
        rows = 0 if axes.rows is None else layout.strides[axes.rows]
        terms = [(f"o{batch}", layout.strides[dim]) for dim, batch in axes.batch] + [("p0", rows), ("f0", 1)]
        destination = AccessPattern(buffer, ((rows, "rows"), (1, "cols")), offset_text(layout.offset, terms))
        lines.append(f"nisa.dma_copy(dst={destination}, src={assembled[buffer][0]}{scope.slice_text})")


def stored_dtype(node: ir.MatMulRotary, buffer: str) -> str:
    """The dtype of ``buffer``, which the rotary's parts store."""
    return next(store.buffer.dtype for part in node.rotary.parts for store in part.stores
                if store.buffer.name == buffer)


def rotary_bytes(node: ir.MatMulRotary, n_tile: int, partitions: int) -> int:
    """SBUF bytes per partition one N tile's rotary takes: the rounded product, the assembled heads and the parts'
    tiles, emitted into a scratch allocator (cos and sin: a few hundred bytes per row block, not counted)."""
    scratch = TileAllocator(partitions)
    operands = RowOperands(scratch, "0")
    value = "value"
    if node.norm is not None:
        plan = TilePlan("matmul", (), LoopDim(partitions, len(node.domain) - 2, 1, partitions),
                        (LoopDim(n_tile, len(node.domain) - 1, 1, n_tile),), 0)
        value = head_norm_lines(node, plan, value, operands, [], scratch)
    assembled = {buffer: (scratch.new(f"{buffer}_heads", n_tile, stored_dtype(node, buffer)), layout.offset)
                 for buffer, layout in whole_heads(node).items()}
    for part in node.rotary.parts:
        part_lines(node, part, value, n_tile, operands, assembled, [])
    return scratch.sbuf_bytes + n_tile * ir.ITEMSIZE[node.source.buffer.dtype]


def plan_matmul_rotary(node: ir.MatMulRotary, target) -> TilePlan:
    """The projection's plan in the SBUF left beside two N tiles' rotary tiles (this one's and the next one's);
    TilingError if it is not the resident form or an N tile would cut a head."""
    inner = as_matmul(node)
    n_tile = min(node.domain[-1], target.gemm_moving_fmax)
    reserved = 2 * rotary_bytes(node, n_tile, target.partitions)
    beside = dataclasses.replace(target, sbuf_bytes_per_partition=target.sbuf_bytes_per_partition
                                 - math.ceil(reserved / SBUF_SHARE))
    plan = kind_of(inner).plan(inner, beside)
    if not plan.row_group:
        raise TilingError(f"{node.name}: a rotary epilogue needs the resident matmul form, which does not fit "
                          f"beside its tiles ({reserved} B per partition) on {target.name}")
    if plan.free[0].tile % node.head_dim:
        raise TilingError(f"{node.name}: N tiles of {plan.free[0].tile} columns cut heads of {node.head_dim}")
    if node.norm is not None and node.domain[-1] % plan.free[0].tile:
        raise TilingError(f"{node.name}: N={node.domain[-1]} is not a whole number of {plan.free[0].tile}-column "
                          f"tiles, which the per-head norm's rows per partition need")
    return plan


def render_matmul_rotary(node: ir.MatMulRotary, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    operands = RowOperands(allocator, "c0" if plan.column_group else "0")
    inner = node.matmul  # the product the rotary reads is stored by its epilogue
    context = kind_of(inner).epilogue_context(
        inner, plan, allocator, lambda scope, lines: rotary_epilogue(node, plan, operands, scope, lines))
    context.update(group_tiles=context["group_tiles"] + operands.group_tiles, once=context["once"] + operands.once)
    return render_template("matmul_resident.py.j2", **kernel_context(node, plan, name, parameters, **context))


class MatMulRotaryKind(KernelKind):
    node_type = ir.MatMulRotary
    name = "matmul_rotary"
    refusal = "a matmul with a rotary epilogue is made after grouping and takes no fused consumer"

    def stores(self, node):
        return kind_of(node.matmul).stores(as_matmul(node)) + kind_of(node.rotary).stores(node.rotary)

    def exprs(self, node):
        """The rotary's expressions with the product's value where they load it: it is never read from HBM."""
        norm = [] if node.norm is None else kind_of(node.norm).exprs(node.norm)
        rotary = [ir.with_stored_value(expr, node.source) for expr in kind_of(node.rotary).exprs(node.rotary) + norm]
        return kind_of(node.matmul).exprs(node.matmul) + [node.source.expr] + rotary

    def operand_loads(self, node):
        return kind_of(node.matmul).operand_loads(node.matmul)

    def map_exprs(self, node, fn):
        return dataclasses.replace(node, matmul=kind_of(node.matmul).map_exprs(node.matmul, fn),
                                   source=dataclasses.replace(node.source, expr=fn(node.source.expr)),
                                   rotary=kind_of(node.rotary).map_exprs(node.rotary, fn),
                                   norm=None if node.norm is None else kind_of(node.norm).map_exprs(node.norm, fn))

    def describe(self, node):
        matmul = describe(as_matmul(node)).split("\n")
        stored = " (also stored)" if node.store_source else ""
        rotary = ["  " + line for line in describe(node.rotary).split("\n")]
        norm = [] if node.norm is None else ["  each head normed first:"] + [
            "  " + line for line in describe(node.norm).split("\n")]
        return "\n".join([f"{matmul[0]} with a rotary epilogue", *matmul[1:],
                          f"  {node.source.buffer.name} = {node.source.expr} kept on chip{stored}, heads of "
                          f"{node.head_dim}", *norm, "  then rotated:", *rotary])

    def prune(self, node, needed):
        matmul = kind_of(node.matmul).prune(node.matmul, needed)
        store_source = node.store_source and node.source.buffer.name in needed
        rotary = kind_of(node.rotary).prune(node.rotary, needed)
        if rotary is None:
            return as_matmul(dataclasses.replace(node, matmul=matmul, store_source=store_source))
        return dataclasses.replace(node, matmul=matmul, store_source=store_source, rotary=rotary)

    def plan(self, node, target):
        return plan_matmul_rotary(node, target)

    def render(self, node, plan, name, parameters):
        return render_matmul_rotary(node, plan, name, parameters)


register_kind(MatMulRotaryKind())
