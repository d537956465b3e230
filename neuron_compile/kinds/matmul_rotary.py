"""Kernel kind ``matmul_rotary``: a q or k projection whose products rotary embeddings read in the same kernel
(``ir.MatMulRotary``: one ``ir.HeadRotary`` per product rotated, q's and k's of a paired projection).

Fusion: made after grouping by passes/rotary_epilogues.py under the rule in kinds/rotary_epilogue_rule.py (a concat
of ``x * cos + rotate(x) * sin`` over the projection's heads, rotate_half's halves or an interleaved rotary's pairs,
which then never reads q or k back from HBM); it takes a second product's rotary, nothing else. Tiling: the
projection's own plan (a plain or a normed matmul, resident form), in the SBUF left beside the rotary's tiles, of N
tiles of whole heads (480 columns of heads of 96: Phi-3's). Codegen: matmul_resident.py.j2; each N tile's epilogue,
after the projection's own stores, rounds the product as the projection stores it and computes every concat part on
the tile's heads: a part's reads of the product are views of that tile ([rows, heads, width] from its column within
the head: rotate_half's other half is the same tile at +-head_dim/2, an interleaved pair's every second column), cos
and sin one [rows, width] DMA each per row block (an interleaved rotary's: one of both columns of each pair), read
through a view repeating them for every head (fp32 ones from a PSUM copy, ``RowOperands``), and the parts' values
are assembled into one tile of whole heads stored by one DMA (or stored part by part when their layout is not the
product's). A per-head norm first (``norm``) is the reduction kind's row body on the tile's heads, read from the
rounded product on chip. The same instructions on the same values as the kernels it replaces.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir, op_table
from neuron_compile.codegen.engine_balance import SCALAR, EngineBalance
from neuron_compile.codegen.expressions import (
    NL_DTYPES,
    PSUM_BANK_FP32,
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
from neuron_compile.kinds.matmul import moving_tile_widths
from neuron_compile.kinds.reduction import reduction_body
from neuron_compile.kinds.rotary_epilogue_rule import (
    HeadAxes,
    head_axes,
    merge_rotary_epilogue,
    norm_axes,
    normed_heads,
    rotary_epilogue_reason,
)
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TilePlan, TilingError


def as_matmul(node: ir.MatMulRotary):
    """The projection alone: its stores, and the products the rotaries read that still go to HBM."""
    stores = node.matmul.stores + tuple(entry.source for entry in node.rotaries if entry.store_source)
    return dataclasses.replace(node.matmul, stores=stores)


def rotated(node: ir.MatMulRotary, entry: ir.HeadRotary) -> ir.Store:
    """The store ``entry``'s rotary reads: the product's, or the per-head norm's normed heads (over the product's
    domain)."""
    return entry.source if entry.norm is None else normed_heads(node.domain, entry.source, entry.norm)


def part_axes(node: ir.MatMulRotary, entry: ir.HeadRotary, part: ir.Pointwise) -> HeadAxes:
    """Where ``part``'s dims lie in the projection's output (the rule checked that they do)."""
    load = next(load for load in loads(part) if load.buffer == rotated(node, entry).buffer.name)
    return head_axes(node.domain, rotated(node, entry), load, entry.head_dim)


def head_pattern(buffer: str, layout: ir.Layout, axes: HeadAxes, width: int, heads: bool = True) -> AccessPattern:
    """The HBM access pattern of a part's [rows, heads, width] values in this N tile (``h0`` its first head), or of
    one head's [rows, width] (``heads`` False: cos and sin, the same for every head)."""
    def stride(dim: int | None) -> int:
        return 0 if dim is None else layout.strides[dim]

    terms = [(f"o{batch}", layout.strides[dim]) for dim, batch in axes.batch] + [("p0", stride(axes.rows))]
    entries = [(stride(axes.rows), "rows")] + ([(stride(axes.heads), "heads")] if heads else [])
    terms += [("h0", stride(axes.heads))] if heads else []
    return AccessPattern(buffer, (*entries, (stride(axes.within), width)), offset_text(layout.offset, terms))


def heads_view(tile: str, row: int, head_dim: int, width: int, column: int, step: int = 1) -> str:
    """A [rows, heads, width] view of ``tile`` (``row`` elements per partition) from ``column`` of each head, every
    ``step``-th column (2: one of an interleaved rotary's pair)."""
    return f"{tile}.ap([[{row}, rows], [{head_dim}, heads], [{step}, {width}]], offset={column})"


@dataclasses.dataclass(frozen=True)
class RowSpan:
    """The columns of a cos or sin row a rotary reads, loaded as one contiguous run per row: ``pattern`` the DMA's
    HBM side, ``width`` its elements per row; a load reads ``step``-th ones of ``count`` from ``column`` of it."""

    pattern: AccessPattern
    width: int
    column: int
    step: int
    count: int


def row_span(node: ir.MatMulRotary, entry: ir.HeadRotary, axes: HeadAxes, load: ir.Load) -> RowSpan:
    """The run of ``load``'s buffer (cos or sin: the same for every head) that every load of it in ``entry``'s
    rotary through the same rows reads, when they read every ``step``-th column (both of an interleaved pair's
    columns): one contiguous DMA per row block instead of one per load, each of single elements, when that run is
    no longer than a head; else ``load``'s own columns (rotate_half's halves: one DMA of both measured slower)."""
    within = axes.within
    count = 1 if within is None else load.layout.shape[within]
    step = 1 if within is None else load.layout.strides[within]

    def rows_key(layout: ir.Layout) -> tuple[int, ...]:
        return tuple(stride for dim, stride in enumerate(layout.strides) if dim != within)

    same = [other.layout for part in entry.rotary.parts for other in loads(part)
            if other.buffer == load.buffer and rows_key(other.layout) == rows_key(load.layout)]
    first = min(layout.offset for layout in same)
    last = max(layout.offset + (count - 1) * (1 if within is None else layout.strides[within]) for layout in same)
    if step <= 1 or last - first + 1 > entry.head_dim:
        return RowSpan(head_pattern(load.buffer, load.layout, axes, count, heads=False), count, 0, 1, count)
    strides = tuple(1 if dim == within else stride for dim, stride in enumerate(load.layout.strides))
    run = ir.Layout(load.layout.shape, strides, first)
    if within is None:  # a part of one column: the run walks the columns as its own dim
        run = ir.Layout((*load.layout.shape, 1), (*load.layout.strides, 1), first)
        axes = dataclasses.replace(axes, within=len(load.layout.shape))
    pattern = head_pattern(load.buffer, run, axes, last - first + 1, heads=False)
    return RowSpan(pattern, last - first + 1, load.layout.offset - first, step, count)


@dataclasses.dataclass
class RowOperands:
    """A rotary's cos and sin (its loads that are the same for every head): one [rows, width] tile per row block
    of the group and run of columns (``RowSpan``), loaded at the group's first N tile (``first``: its f0) and read
    by every N tile after it through a view repeating it for each head, instead of a DMA per N tile. fp32 ones are
    copied on ScalarE into a PSUM bank each N tile and read there (``staged``: each tile's column in it): a VectorE
    product with one PSUM operand streams at full rate where two fp32 SBUF operands halve it (cost.py), and q's
    and k's rotaries share the copy (codegen/expressions.py ``stage_in_psum`` does the same in a concat kernel)."""

    allocator: TileAllocator
    first: str
    tiles: dict[str, str] = dataclasses.field(default_factory=dict)  # HBM pattern -> the list of tiles' name
    group_tiles: list[str] = dataclasses.field(default_factory=list)
    once: list[str] = dataclasses.field(default_factory=list)  # lines before the loops (a per-head norm's weight)
    bank: str | None = None
    balance: EngineBalance | None = None  # the projection's epilogue's: the parts' engines weigh its work too
    staged: dict[str | None, int] = dataclasses.field(default_factory=dict)  # None: the bank's columns taken

    def ref(self, load: ir.Load, span: RowSpan, first_lines: list[str], lines: list[str]) -> Ref:
        """The view ``load`` is read through; the DMA filling its tile appended to ``first_lines`` the first time,
        its copy into PSUM to ``lines`` the first time in an N tile's epilogue."""
        source, width = str(span.pattern), span.width
        if source not in self.tiles:
            name = self.tiles[source] = self.allocator.take_name(f"{load.buffer}_rows")
            self.group_tiles.append(f"{name} = [nl.ndarray(({self.allocator.partitions}, {width}), "
                                    f"dtype={NL_DTYPES[load.dtype]}, buffer=nl.sbuf) for _ in range(blocks)]")
            first_lines.append(f"nisa.dma_copy(dst={name}[block][0:rows, 0:{width}], src={source})")
        tile, row, column = f"{self.tiles[source]}[block]", width, span.column
        used = self.staged[None] if None in self.staged else 0
        if load.dtype == "float32" and (source in self.staged or used + width <= PSUM_BANK_FP32):
            if source not in self.staged:
                self.bank = self.bank or self.allocator.new_psum_bank("cos_sin_psum")
                lines.append(f"nisa.tensor_copy(dst={self.bank}[0:rows, {used}:{used + width}], "
                             f"src={tile}[0:rows, 0:{width}]{SCALAR})")
                self.staged.update({source: used, None: used + width})
            tile, row, column = self.bank, PSUM_BANK_FP32, self.staged[source] + span.column
        view = f"{tile}.ap([[{row}, rows], [0, heads], [{span.step}, {span.count}]], offset={column})"
        return Ref(tile=tile, dtype=load.dtype, view=view)


def whole_heads(node: ir.MatMulRotary, entry: ir.HeadRotary) -> dict[str, ir.Layout]:
    """The buffers the parts' stores fill together in whole heads laid out as the product is (each head's
    ``head_dim`` columns contiguous, heads ``head_dim`` apart; a part may fill every second column, an interleaved
    rotary's), by the layout of the head's first column: assembled in one tile, they go to HBM in one contiguous DMA
    per N tile instead of one per part."""
    writes: dict[str, list[tuple[ir.Layout, HeadAxes, int]]] = {}
    for part in entry.rotary.parts:
        axes = dataclasses.replace(part_axes(node, entry, part), column=0)
        width = 1 if axes.within is None else part.domain[axes.within]
        for store in part.stores:
            writes.setdefault(store.buffer.name, []).append((store.layout, axes, width))
    whole = {}
    for buffer, stores in writes.items():
        (layout, axes, _), base = stores[0], min(layout.offset for layout, _, _ in stores)
        same = all(other.strides == layout.strides and other_axes == axes for other, other_axes, _ in stores)
        step = store_step(layout, axes)
        columns = sorted(other.offset - base + step * index for other, _, width in stores for index in range(width))
        heads_apart = axes.heads is None or layout.strides[axes.heads] == entry.head_dim
        if same and heads_apart and columns == list(range(entry.head_dim)):
            whole[buffer] = dataclasses.replace(layout, offset=base)
    return whole


def store_step(layout: ir.Layout, axes: HeadAxes) -> int:
    """The columns of a head one index of the part's ``within`` dim advances in ``layout`` (a part's store)."""
    return 1 if axes.within is None else layout.strides[axes.within]


def part_lines(node: ir.MatMulRotary, entry: ir.HeadRotary, part: ir.Pointwise, value: str, n_tile: int,
               operands: RowOperands, assembled: dict[str, tuple[str, int]], lines: list[str]) -> None:
    """``part`` computed on the heads of this N tile from ``value`` (the rounded product, [rows, n_tile]): its
    values written into their columns of the ``assembled`` tiles (by buffer: the tile, the offset of a head's first
    column) by the instruction computing them (else copied there on ScalarE), or stored by a DMA of their own."""
    axes, head_dim, source = part_axes(node, entry, part), entry.head_dim, rotated(node, entry)
    width = 1 if axes.within is None else part.domain[axes.within]

    def unexpected(load: ir.Load, tile: str):
        raise TilingError(f"{node.name}: {part.name}'s load of {load.buffer} is neither the product nor per head")

    scope = TileScope(operands.allocator, n_tile // head_dim * width, f"[0:rows, 0:heads * {width}]",
                      unexpected)
    if operands.balance is not None:
        scope.balance = operands.balance
    first_loads: list[str] = []
    staging: list[str] = []
    for load in loads(part):
        if load.buffer == source.buffer.name:
            view = heads_view(value, n_tile, head_dim, width, head_axes(node.domain, source, load, head_dim).column,
                              axes.step)
            bind_load(scope, load, Ref(tile=value, dtype=load.dtype, view=view))
        else:
            bind_load(scope, load, operands.ref(load, row_span(node, entry, axes, load), first_loads, staging))
    if first_loads:
        lines += [f"if f0 == {operands.first}:  # cos and sin for every N tile of this row block"]
        lines += ["    " + line for line in first_loads]
    lines += staging
    for store in part.stores:
        if store.buffer.name in assembled:
            tile, first_column = assembled[store.buffer.name]
            destination = heads_view(tile, n_tile, head_dim, width, store.layout.offset - first_column,
                                     store_step(store.layout, axes))
            # the part's last instruction writes its columns of the assembled heads, when it rounds to their dtype
            written = Ref(tile=tile, dtype=store.buffer.dtype, view=destination)
            scope.destinations[store.expr] = written
            result = emit(store.expr, scope, lines)
            if result == written:
                continue
            whole_tile = result.tile is not None and not result.vector  # else a number or a (P, 1) value
            data = scope.ref_text(result) if whole_tile else emit_store(store.buffer.dtype, result, scope, lines)
            lines.append(f"nisa.activation(dst={destination}, op=nl.copy, data={data})")
        else:
            tile = emit_store(store.buffer.dtype, emit(store.expr, scope, lines), scope, lines)
            lines.append(f"nisa.dma_copy(dst={head_pattern(store.buffer.name, store.layout, axes, width)}, "
                         f"src={tile})")


def head_norm_plan(node: ir.MatMulRotary, entry: ir.HeadRotary, plan: TilePlan) -> TilePlan:
    """The per-head norm's plan for one N tile of one row block: the projection's loops and row tiles, the tile's
    heads as rows beside each other on a partition (``grouped_rows``), each head's columns the reduced row."""
    heads, axes = plan.free[0].tile // entry.head_dim, norm_axes(node.domain, entry.source, entry.norm)
    batch = {matmul_dim: dim for dim, matmul_dim in axes.batch}
    outer = tuple(LoopDim(dim.size, batch.get(index), 1, 1) for index, dim in enumerate(plan.outer))
    partition = LoopDim(plan.partition.size, axes.rows, 1, plan.partition.tile)
    free = (LoopDim(heads, axes.heads, 1, heads), LoopDim(entry.head_dim, axes.within, 1, entry.head_dim))
    return TilePlan("reduction", outer, partition, free, 0, grouped_rows=True)


def head_norm_lines(node: ir.MatMulRotary, entry: ir.HeadRotary, plan: TilePlan, value: str, operands: RowOperands,
                    lines: list[str], allocator: TileAllocator) -> str:
    """The per-head norm of this N tile's heads (the reduction kind's row body, reading ``value``, the rounded
    product, where the norm kernel loads it), its normed heads computed into a tile, whose name it returns. The
    norm's loads count heads in ``cols``, which the tile's columns get back after it (the rule asks for whole
    tiles of heads)."""
    norm = dataclasses.replace(entry.norm, row_stores=())
    on_chip = tuple((load, value) for expr in kind_of(norm).exprs(norm) for load in ir.loads_of(expr)
                    if load.buffer == entry.source.buffer.name)
    normed = entry.norm.row_stores[0]
    norm_plan = head_norm_plan(node, entry, plan)
    # each head's sum of squares on ScalarE as it squares them: VectorE is the epilogue's busiest engine
    body = reduction_body(norm, norm_plan, allocator, Patterns(norm_plan),
                          operands=((normed.expr, normed.buffer.dtype),), on_chip=tuple(dict.fromkeys(on_chip)),
                          group_sums=True)
    operands.once += body.once
    for engine, load in body.engine_loads.items() if operands.balance is not None else ():
        operands.balance.note(engine, load)  # the rotary's engines are then chosen beside the norm's work
    lines += [f"# {entry.norm.name}: each head's RMSNorm, the tile's {norm_plan.free[0].size} heads as rows beside "
              "each other on a partition (cols counts heads here)", f"cols = {norm_plan.free[0].size}"]
    for walk, after in body.passes:
        lines += walk + after
    lines.append(f"cols = {plan.free[0].tile}")
    return body.operands[0]


def rotary_epilogue(node: ir.MatMulRotary, plan: TilePlan, operands: RowOperands, scope: TileScope,
                    lines: list[str]) -> None:
    """An N tile's epilogue lines after the projection's other stores: each rotary's product in turn (q's, then
    k's of a paired projection), rounded as it is stored (and stored, when something else reads it), its heads
    normed (``norm``), then every part of the rotary on the tile's heads, each part's values written into the
    tile of their buffer's whole heads."""
    operands.staged.clear()  # cos and sin are copied into PSUM once per N tile, for every rotary
    operands.balance = scope.balance  # the parts' engines are chosen knowing the projection's own epilogue
    for entry in node.rotaries:
        value = stored_tile(entry.source.buffer.dtype, emit(rounded_source(entry), scope, lines), scope, lines)
        if entry.store_source:
            destination = Patterns(plan).hbm(entry.source.buffer.name, entry.source.layout, [(plan.free[0], "cols")],
                                             True)
            lines.append(f"nisa.dma_copy(dst={destination}, src={value}{scope.slice_text})")
        if entry.norm is not None:
            value = head_norm_lines(node, entry, plan, value, operands, lines, scope.allocator)
        rotated_lines(node, entry, plan, value, operands, scope, lines)


def rounded_source(entry: ir.HeadRotary) -> ir.Expr:
    """The product's value rounded to the dtype it is stored in, as one expression when it is an op's (a bias add):
    that instruction then writes the rounded tile itself, the same bits as an fp32 result and a rounding copy, one
    VectorE pass fewer per product and N tile (Flux's epilogue was VectorE-bound). The product itself (no op) keeps
    its rounding copy, which the balance would otherwise move (Llama's measured slower)."""
    expr, dtype = entry.source.expr, entry.source.buffer.dtype
    if dtype == "float32" or not isinstance(expr, ir.Op) or (expr.op == "cast" and expr.dtype == dtype):
        return expr
    return ir.Op("cast", (expr,), dtype)


def rotated_lines(node: ir.MatMulRotary, entry: ir.HeadRotary, plan: TilePlan, value: str, operands: RowOperands,
                  scope: TileScope, lines: list[str]) -> None:
    """``entry``'s rotary on this N tile's heads of ``value`` (the rounded or normed product), its whole heads
    stored by one DMA per buffer."""
    lines += [f"# {entry.rotary.name} on this tile's heads of {entry.head_dim}: the rotation reads the same tile",
              f"h0 = f0 // {entry.head_dim}", f"heads = cols // {entry.head_dim}"]
    whole = whole_heads(node, entry)
    assembled = {buffer: (scope.tile(stored_dtype(entry, buffer), stem=f"{buffer}_heads"), layout.offset)
                 for buffer, layout in whole.items()}
    for part in entry.rotary.parts:
        part_lines(node, entry, part, value, plan.free[0].tile, operands, assembled, lines)
    for buffer, layout in whole.items():
        axes = part_axes(node, entry, entry.rotary.parts[0])
        rows = 0 if axes.rows is None else layout.strides[axes.rows]
        terms = [(f"o{batch}", layout.strides[dim]) for dim, batch in axes.batch] + [("p0", rows), ("f0", 1)]
        destination = AccessPattern(buffer, ((rows, "rows"), (1, "cols")), offset_text(layout.offset, terms))
        lines.append(f"nisa.dma_copy(dst={destination}, src={assembled[buffer][0]}{scope.slice_text})")


def stored_dtype(entry: ir.HeadRotary, buffer: str) -> str:
    """The dtype of ``buffer``, which the rotary's parts store."""
    return next(store.buffer.dtype for part in entry.rotary.parts for store in part.stores
                if store.buffer.name == buffer)


def rotary_bytes(node: ir.MatMulRotary, n_tile: int, partitions: int) -> int:
    """SBUF bytes per partition one N tile's rotaries take: the rounded products, the assembled heads and the parts'
    tiles, emitted into a scratch allocator (cos and sin: a few hundred bytes per row block, not counted)."""
    scratch = TileAllocator(partitions)
    operands = RowOperands(scratch, "0")
    products = 0
    for entry in node.rotaries:
        value = "value"
        if entry.norm is not None:
            plan = TilePlan("matmul", (), LoopDim(partitions, len(node.domain) - 2, 1, partitions),
                            (LoopDim(n_tile, len(node.domain) - 1, 1, n_tile),), 0)
            value = head_norm_lines(node, entry, plan, value, operands, [], scratch)
        assembled = {buffer: (scratch.new(f"{buffer}_heads", n_tile, stored_dtype(entry, buffer)), layout.offset)
                     for buffer, layout in whole_heads(node, entry).items()}
        for part in entry.rotary.parts:
            part_lines(node, entry, part, value, n_tile, operands, assembled, [])
        products += n_tile * ir.ITEMSIZE[entry.source.buffer.dtype]
    return scratch.sbuf_bytes + products


def plan_matmul_rotary(node: ir.MatMulRotary, target) -> TilePlan:
    """The projection's plan in the SBUF left beside two N tiles' rotary tiles (this one's and the next one's),
    its N tiles whole heads (480 columns of heads of 96, where 512 would cut one); TilingError if it is not the
    resident form or an N tile would cut a head."""
    inner = as_matmul(node)
    heads = math.lcm(*(entry.head_dim for entry in node.rotaries))
    widths = moving_tile_widths(node.domain[-1], target, heads)
    if not widths:
        raise TilingError(f"{node.name}: no N tile of at most {target.gemm_moving_fmax} columns holds a whole head "
                          f"of {heads}")
    reserved = 2 * rotary_bytes(node, widths[0], target.partitions)
    beside = dataclasses.replace(target, sbuf_bytes_per_partition=target.sbuf_bytes_per_partition
                                 - math.ceil(reserved / SBUF_SHARE))
    plan = kind_of(inner).plan_whole_columns(inner, beside, heads)
    if not plan.row_group:
        raise TilingError(f"{node.name}: a rotary epilogue needs the resident matmul form, which does not fit "
                          f"beside its tiles ({reserved} B per partition) on {target.name}")
    for entry in node.rotaries:
        if plan.free[0].tile % entry.head_dim:
            raise TilingError(f"{node.name}: N tiles of {plan.free[0].tile} columns cut heads of {entry.head_dim}")
        if entry.norm is not None and node.domain[-1] % plan.free[0].tile:
            raise TilingError(f"{node.name}: N={node.domain[-1]} is not a whole number of {plan.free[0].tile}-column "
                              f"tiles, which the per-head norm's rows per partition need")
    return plan


def reads_results_once(node: ir.MatMulRotary) -> bool:
    """Whether the epilogue may read the products straight from their PSUM accumulators: the projection stores
    nothing of its own and each product is read once, by its rotary's source, a two-operand ALU instruction whose
    other operand is a load (Flux's bias add). That instruction then streams its PSUM operand at full rate on
    VectorE, and neither ScalarE's copy out of PSUM nor a half-rate add of two SBUF operands is left. A plain
    matmul only (a normed one's products are normed before its epilogue reads them)."""
    if kind_of(node.matmul).name != "matmul" or as_matmul(node).stores:
        return False
    results = []
    for entry in node.rotaries:
        expr = entry.source.expr
        if not (isinstance(expr, ir.Op) and op_table.spec(expr.op).form == "binary" and len(expr.args) == 2):
            return False
        read = [arg for arg in expr.args if isinstance(arg, ir.Result)]
        if len(read) != 1 or not any(isinstance(arg, ir.Load) for arg in expr.args):
            return False
        results += read
    return len(set(results)) == len(results)


def render_matmul_rotary(node: ir.MatMulRotary, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    operands = RowOperands(allocator, "c0" if plan.column_group else "0")
    inner = node.matmul  # the products the rotaries read are stored by their epilogue
    in_psum = dict(results_in_psum=True) if reads_results_once(node) else {}  # a plain matmul's option only
    context = kind_of(inner).epilogue_context(
        inner, plan, allocator, lambda scope, lines: rotary_epilogue(node, plan, operands, scope, lines), **in_psum)
    context.update(group_tiles=context["group_tiles"] + operands.group_tiles, once=context["once"] + operands.once)
    return render_template("matmul_resident.py.j2", **kernel_context(node, plan, name, parameters, **context))


def entry_exprs(entry: ir.HeadRotary) -> list:
    """``entry``'s rotary and norm expressions with the product's value where they load it: never read from HBM."""
    norm = [] if entry.norm is None else kind_of(entry.norm).exprs(entry.norm)
    return [entry.source.expr] + [ir.with_stored_value(expr, entry.source)
                                  for expr in kind_of(entry.rotary).exprs(entry.rotary) + norm]


def mapped_entry(entry: ir.HeadRotary, fn) -> ir.HeadRotary:
    """``entry`` with ``fn`` applied to every expression it holds."""
    return dataclasses.replace(entry, source=dataclasses.replace(entry.source, expr=fn(entry.source.expr)),
                               rotary=kind_of(entry.rotary).map_exprs(entry.rotary, fn),
                               norm=None if entry.norm is None else kind_of(entry.norm).map_exprs(entry.norm, fn))


def described_entry(entry: ir.HeadRotary) -> list[str]:
    """The lines ``describe`` gives one rotary epilogue."""
    stored = " (also stored)" if entry.store_source else ""
    rotary = ["  " + line for line in describe(entry.rotary).split("\n")]
    norm = [] if entry.norm is None else ["  each head normed first:"] + [
        "  " + line for line in describe(entry.norm).split("\n")]
    return [f"  {entry.source.buffer.name} = {entry.source.expr} kept on chip{stored}, heads of {entry.head_dim}",
            *norm, "  then rotated:", *rotary]


def pruned(node: ir.MatMulRotary, needed: set[str]):
    """``node`` keeping what ``needed`` (the buffers read later) and the region read: a rotary whose outputs nobody
    reads leaves its product as a plain store of the projection (when it is needed)."""
    inner = kind_of(node.matmul).prune(node.matmul, needed) or dataclasses.replace(node.matmul, stores=())
    kept, stores = [], inner.stores
    for entry in node.rotaries:
        store_source = entry.store_source and entry.source.buffer.name in needed
        rotary = kind_of(entry.rotary).prune(entry.rotary, needed)
        if rotary is None:
            stores += (entry.source,) if store_source else ()
        else:
            kept.append(dataclasses.replace(entry, store_source=store_source, rotary=rotary))
    inner = dataclasses.replace(inner, stores=stores)
    return dataclasses.replace(node, matmul=inner, rotaries=tuple(kept)) if kept else inner


class MatMulRotaryKind(KernelKind):
    node_type = ir.MatMulRotary
    name = "matmul_rotary"
    refusal = "a matmul with a rotary epilogue is made after grouping and takes no fused consumer"

    def stores(self, node):
        return kind_of(node.matmul).stores(as_matmul(node)) + tuple(
            store for entry in node.rotaries for store in kind_of(entry.rotary).stores(entry.rotary))

    def exprs(self, node):
        """The rotaries' expressions with the products' values where they load them: never read from HBM."""
        rotaries = [expr for entry in node.rotaries for expr in entry_exprs(entry)]
        return kind_of(node.matmul).exprs(node.matmul) + rotaries

    def operand_loads(self, node):
        return kind_of(node.matmul).operand_loads(node.matmul)

    def map_exprs(self, node, fn):
        return dataclasses.replace(node, matmul=kind_of(node.matmul).map_exprs(node.matmul, fn),
                                   rotaries=tuple(mapped_entry(entry, fn) for entry in node.rotaries))

    def describe(self, node):
        matmul = describe(as_matmul(node)).split("\n")
        epilogues = "a rotary epilogue" if len(node.rotaries) == 1 else f"{len(node.rotaries)} rotary epilogues"
        return "\n".join([f"{matmul[0]} with {epilogues}", *matmul[1:],
                          *(line for entry in node.rotaries for line in described_entry(entry))])

    def prune(self, node, needed):
        return pruned(node, needed)

    takes_rotary_epilogue = True  # a paired projection's second product (k's after q's)

    def rotary_epilogue_reason(self, producer, consumer, norm=None):
        return rotary_epilogue_reason(producer, consumer, norm)

    def merge_rotary_epilogue(self, producer, consumer, store_source, norm=None):
        return merge_rotary_epilogue(producer, consumer, store_source, norm)

    def plan(self, node, target):
        return plan_matmul_rotary(node, target)

    def render(self, node, plan, name, parameters):
        return render_matmul_rotary(node, plan, name, parameters)


register_kind(MatMulRotaryKind())
