"""Kernel kind ``reduction``: sum, mean, max, min, prod, var (and any) of a prologue along some dims (``ir.Reduction``).

Fusion: a pointwise producer over the input domain becomes the prologue; pointwise consumers over the reduced
output are epilogues; a pointwise consumer over the whole input domain that reads the reduced value broadcast
back becomes a row epilogue (``row_stores``: rms norm's ``x * rsqrt(mean(x * x) + eps)``, the row still in SBUF).
Tiling: kept dims on partitions and the row on the free axis (in memory order; chunked when wider than the
budget; rows shorter than ``SHORT_ROW_ELEMENTS`` several to a partition, ``grouped_rows``: one tensor_reduce over
the innermost axis of a [P, k, row] view gives k results, the epilogue runs on [P, k] tiles), or, for a sum
over strided leading dims, the reduced rows on partitions summed on TensorE against a ones vector
(``column_reduction``), or, when nothing is kept, the row spread over partitions and finished across them
(``cross_partition``). Codegen: reduction.py.j2 and column_reduction.py.j2.
"""

from __future__ import annotations

import copy
import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import (
    NL_DTYPES,
    Ref,
    TileAllocator,
    TileScope,
    bind_load,
    emit,
    emit_row_summed,
    fp32_tile,
    number,
    remember_negation,
    stored_tile,
    unwidened,
)
from neuron_compile.codegen.kernel_text import (
    Patterns,
    epilogue_scope,
    kernel_context,
    kernel_names,
    render_template,
    row_scopes,
    store_lines,
)
from neuron_compile.codegen.engine_balance import EngineBalance
from neuron_compile.codegen.grouped_rows import row_values
from neuron_compile.codegen.hoisted_columns import HoistedColumns
from neuron_compile.codegen.row_broadcast import RowBroadcast
from neuron_compile.dims import LoopDim, reduced_dims_in_memory_order
from neuron_compile.kind_registry import loads, register_kind
from neuron_compile.kinds import reduction_siblings
from neuron_compile.kinds.fusion_rules import ProloguedKind, matching_index_reason, stored_exprs
from neuron_compile.kinds.rows import count_row_tiles, partition_dim, row_budget, row_dims, row_layouts
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TilePlan, largest_divisor_at_most, rows_per_partition, rows_that_fit

REDUCE_OPS = {"sum": "nl.add", "mean": "nl.add", "var": "nl.add", "max": "nl.maximum", "min": "nl.minimum",
              "prod": "nl.multiply"}
# reductions that may take several short rows per partition: one tensor_reduce over the rows' innermost axis
GROUPED_OPS = ("sum", "mean", "max", "min", "prod")
# Rows shorter than this go several to a partition. Measured on 1.3M-element sums and RMS statistics (fp32 and
# bf16): grouped rows take 0.3x the estimate at 64 elements, 0.5x at 128, 0.7x at 256, 0.8-1.0x at 512: the
# (P, 1) instructions and the DMAs of each row block cost more than the VectorE tensor_reduce that grouping adds.
SHORT_ROW_ELEMENTS = 512
# With ``group_sums`` (a q / k projection's per-head norms, kinds/matmul_rotary.py), grouped rows at least this long
# are summed on ScalarE as it squares them, one activation each (its reduce overhead, MIN_II cycles, then at most
# half the row's pass), instead of VectorE's tensor_reduce of the squares
SUMMED_GROUP_ELEMENTS = 128
COLUMN_CHUNK = "[0:rows, f0:f0 + cols]"  # a row epilogue's slice of its whole-row tiles, walked in column chunks
# Columns per chunk of a norm epilogue's row epilogue, for rows of two chunks or more: each chunk's multiplies, adds
# and store pipeline across the engines and the DMA queues (Gemma3's down projection with its norm alone: 110.8 ->
# 107.6 us at hidden 2048; 108.7 with chunks of 1024)
COLUMN_CHUNK_WIDTH = 512


def plan_reduction(node: ir.Reduction, target) -> TilePlan:
    loads = ir.loads_of(node.prologue)
    in_memory_order = reduced_dims_in_memory_order(node.reduce_dims, loads[0].layout if loads else None)
    layouts = row_layouts(node, node.stores + node.row_stores)
    kept, reduced = row_dims(node.domain, in_memory_order, layouts)
    exprs = [node.prologue] + [store.expr for store in node.stores + node.row_stores]
    budget = row_budget(node, kept, reduced, exprs, target, tiles=count_row_tiles(exprs, node.reduce_dims))
    if not budget.whole_row and (len(reduced) > 1 or node.row_stores):
        # the count said no; the tiles the body declares for the whole row are what decides
        measured = whole_row_bytes(node, kept, reduced, budget.tiles, target)
        if measured > int(target.sbuf_bytes_per_partition * SBUF_SHARE):
            raise budget.too_wide(node, node.op, target, measured)
        budget = dataclasses.replace(budget, budget=budget.row)
    plain = not node.row_stores  # a row epilogue needs the row on the free axis
    if plain and node.op in ("sum", "mean") and _columns_are_contiguous(node, kept, reduced):
        # Kept dims contiguous, reduced dims strided (a sum over the batch): reduced rows go on partitions and
        # TensorE sums them against a ones vector, instead of element-strided DMAs.
        partition = dataclasses.replace(reduced[0], tile=min(reduced[0].size, target.partitions))
        free = (dataclasses.replace(kept[-1], tile=min(kept[-1].size, target.gemm_moving_fmax)),)
        return TilePlan("column_reduction", tuple(kept[:-1]), partition, free, budget.tiles)
    if plain and node.op != "var" and kept[-1].source is None and len(reduced) == 1:
        # Nothing kept (a full reduction): spread the row over partitions, reduce across them at the end.
        rows = largest_divisor_at_most(reduced[0].size, target.partitions)
        if rows > 1:
            cols = reduced[0].size // rows
            spread = [LoopDim(rows, reduced[0].source, cols * reduced[0].multiplier)]
            budget = dataclasses.replace(budget, kept=spread, row=cols,
                                         reduced=[LoopDim(cols, reduced[0].source, reduced[0].multiplier)])
            return TilePlan("reduction", (), partition_dim(spread, target), tuple(budget.free_dims()), budget.tiles,
                            cross_partition=True)
    partition, free = partition_dim(kept, target), tuple(budget.free_dims())
    if _short_rows(node, reduced, budget):
        # several rows per partition (a q / k norm's 128-element heads), each tensor_reduce taking k of them: the
        # rows next to each one in memory where an outer dim holds them (heads of [batch, heads, seq, 64] laid out
        # [batch, seq, heads, 64]), else consecutive rows of the partition dim
        grouped = rows_beside_each_row(kept, reduced[0], layouts, budget.tiles, target)
        if grouped is not None:
            outer, inner = grouped
            return TilePlan("reduction", outer, partition, (inner, free[0]), budget.tiles, grouped_rows=True)
        partition, free = rows_per_partition(partition, free[0], budget.tiles, target)
        return TilePlan("reduction", tuple(kept[:-1]), partition, free, budget.tiles, grouped_rows=len(free) > 1)
    return TilePlan("reduction", tuple(kept[:-1]), partition, free, budget.tiles)


def whole_row_bytes(node: ir.Reduction, kept: list[LoopDim], reduced: list[LoopDim], tiles: int, target) -> int:
    """SBUF bytes per partition of one row block with the whole row on the free axis: the body emitted into a
    scratch allocator, each tile at its dtype and width, and the rows shared by every block (a norm's weight). The
    row budget's count takes every value it might keep as a row of fp32 plus staging (an RMSNorm with a residual
    add at hidden 2048 in bf16: 20 fp32 rows, 160 KiB, where the body declares 40 KiB)."""
    whole = tuple(dataclasses.replace(dim, tile=dim.size) for dim in reduced)
    plan = TilePlan("reduction", tuple(kept[:-1]), partition_dim(kept, target), whole, tiles)
    scratch = TileAllocator(plan.partition.tile)
    body = reduction_body(node, plan, scratch, Patterns(plan))
    return scratch.sbuf_bytes + body.shared_bytes


def rows_beside_each_row(kept: list[LoopDim], row: LoopDim, layouts: list[ir.Layout], tiles: int,
                         target) -> tuple[tuple[LoopDim, ...], LoopDim] | None:
    """(outer dims, the dim of rows per partition) when an outer kept dim steps from a row to the next one in every
    layout (a contiguous row, then the next): ``k`` of its rows go on each partition, its remaining ``size / k``
    stay an outer loop, so one DMA moves k x row contiguous elements per partition where the partition dim's rows
    lie far apart (a q / k norm after the heads' transpose: 128 bytes per row otherwise). None where no outer dim
    does, or its rows are already the partition dim's neighbours."""
    along_rows = [layout for layout in layouts if row.stride(layout) != 0]  # (not the per-row results' stores)
    if len(kept) < 2 or row.source is None or any(row.stride(layout) != 1 for layout in along_rows):
        return None

    def next_rows(dim: LoopDim) -> bool:  # its step is a row in every layout that moves along it
        steps = {dim.stride(layout) for layout in along_rows} - {0}
        return dim.source is not None and steps == {row.size}

    beside = [dim for dim in kept[:-1] if next_rows(dim)]
    if not beside or next_rows(kept[-1]):
        return None
    per_partition = largest_divisor_at_most(beside[-1].size, rows_that_fit(row.size, beside[-1].size, tiles, target))
    if per_partition < 2:
        return None
    dim = beside[-1]
    rest = [LoopDim(dim.size // per_partition, dim.source, dim.multiplier * per_partition)] * (dim.size > per_partition)
    outer = [kept_dim for other in kept[:-1] for kept_dim in (rest if other is dim else [other])]
    return tuple(outer), LoopDim(per_partition, dim.source, dim.multiplier, per_partition)


def _short_rows(node: ir.Reduction, reduced: list[LoopDim], budget) -> bool:
    """Whether the rows are one whole dim shorter than ``SHORT_ROW_ELEMENTS``, of a reduction that may group them
    (a variance's two passes need its mean per row: not grouped)."""
    return node.op in GROUPED_OPS and len(reduced) == 1 and budget.whole_row and reduced[0].size < SHORT_ROW_ELEMENTS


def _columns_are_contiguous(node: ir.Reduction, kept: list[LoopDim], reduced: list[LoopDim]) -> bool:
    if len(reduced) != 1 or kept[-1].source is None or reduced[0].source is None:
        return False
    loads = ir.loads_of(node.prologue)
    return bool(loads) and all(kept[-1].stride(load.layout) in (0, 1) for load in loads) and any(
        kept[-1].stride(load.layout) == 1 and reduced[0].stride(load.layout) != 1 for load in loads
    )


def _reduce_pass(node, prologue: TileScope, reduce_op: str, accumulator: str, partial: str, chunked: bool,
                 per_partition: int = 1, negated_mean: str | None = None, group_sums: bool = False) -> list[str]:
    """One walk over the row: prologue, reduce, combine chunk partials; ``per_partition`` rows (grouped short
    rows) are reduced into as many results per partition (``group_sums``: summed on ScalarE, one activation per
    row, where it can); with ``negated_mean`` (a (P, 1) slice) the sum is of the squared deviations from the mean
    (a variance's second pass)."""
    lines: list[str] = []
    if chunked:
        prologue.memo = {}  # a second pass re-emits the loads (same tiles): each chunk overwrote the last
    target = partial if chunked else accumulator
    if reduce_op == "nl.add" and negated_mean is None and per_partition == 1:
        summed = emit_row_summed(node.prologue, prologue, lines, f"{target}[0:rows, 0:1]")
        if summed is not None:
            return lines + _combine_partials(reduce_op, accumulator, partial, chunked)
    if group_sums and reduce_op == "nl.add" and per_partition > 1 and not chunked and (
            prologue.free // per_partition >= SUMMED_GROUP_ELEMENTS):
        if emit_row_summed(node.prologue, prologue, lines, target, groups=per_partition) is not None:
            return lines
    value = emit(unwidened(node.prologue), prologue, lines)  # tensor_reduce and activation read bf16 as fp32
    if value.tile is None:  # a reduction of a fill (sum of full(1): a count): reduce a tile holding it
        constant = Ref(tile=prologue.tile(key=("reduced constant", value.value)))
        lines.append(f"nisa.memset(dst={prologue.ref_text(constant)}, value={number(value.value)})")
        value = constant
    if per_partition > 1:
        # the [rows, k x row] tile as [rows, k, row]: its last axis reduced gives k results per partition (the
        # prologue scope loads nothing as a (P, 1) column here, so the value is a whole tile)
        row = prologue.free // per_partition
        rows_view = f"{value.tile}.ap([[{prologue.free}, rows], [{row}, {per_partition}], [1, {row}]], offset=0)"
        lines.append(f"nisa.tensor_reduce(dst={target}[0:rows, 0:{per_partition}], op={reduce_op}, data={rows_view}, "
                     "axis=2)")
        prologue.balance.note("vector")  # a full tile's work, which a row epilogue's engine balance weighs
        return lines
    if negated_mean is not None:
        # (x - mean)^2 summed on ScalarE as it is written: one instruction where VectorE took a subtract, a
        # multiply and a tensor_reduce
        squares = prologue.tile(key=("squared deviations",), stem="squares") + prologue.slice_text
        lines.append(f"nisa.activation(dst={squares}, op=nl.square, data={prologue.ref_text(value)}, "
                     f"bias={negated_mean}, reduce_op=nl.add, reduce_res={target}[0:rows, 0:1])")
        prologue.balance.note("scalar")
        return lines + _combine_partials(reduce_op, accumulator, partial, chunked)
    lines.append(f"nisa.tensor_reduce(dst={target}[0:rows, 0:1], op={reduce_op}, data={prologue.ref_text(value)}, "
                 "axis=1, keepdims=True)")
    # the cost model's tensor_reduce: half a pass over a bf16 tile for add and max
    halved = value.dtype == "bfloat16" and reduce_op in ("nl.add", "nl.maximum")
    prologue.balance.note("vector", 0.5 if halved else 1.0)
    return lines + _combine_partials(reduce_op, accumulator, partial, chunked)


def _combine_partials(reduce_op: str, accumulator: str, partial: str, chunked: bool) -> list[str]:
    """A chunked row: the first chunk's partial starts the accumulator, the others combine into it."""
    if not chunked:
        return []
    return [
        "if f0 == 0:",
        f"    nisa.tensor_copy(dst={accumulator}[0:rows, 0:1], src={partial}[0:rows, 0:1])",
        "else:",
        f"    nisa.tensor_tensor(dst={accumulator}[0:rows, 0:1], data1={accumulator}[0:rows, 0:1], "
        f"data2={partial}[0:rows, 0:1], op={reduce_op})",
    ]


@dataclasses.dataclass
class ReductionBody:
    """The instructions of one row block of a row reduction: per walk over the row, (its lines, the lines after
    it); the lines filling the shared tiles before the loops (``once``); whether the row is walked in chunks and
    the width of a chunk's tiles; and the tiles holding the extra row values asked for (``operands``: a fused
    matmul's left operand, computed like a row store but not stored)."""

    passes: list[tuple[list[str], list[str]]]
    once: list[str]
    chunked: bool
    row_free: int
    operands: tuple[str, ...] = ()  # the tiles holding them
    shared_bytes: int = 0  # SBUF bytes per partition of the tiles ``once`` fills
    # with ``column_chunks``: the per-row values the row epilogue needs, computed once (their tiles declared first),
    # and the row epilogue over one column chunk (``f0``, ``cols``) of the whole-row tiles
    hoisted: list[str] = dataclasses.field(default_factory=list)
    column_loop: list[str] = dataclasses.field(default_factory=list)
    # each engine's work, in the engine balance's passes over the row's tile: for a caller balancing its own
    # instructions beside these (a q / k projection's rotary after its per-head norm)
    engine_loads: dict[str, float] = dataclasses.field(default_factory=dict)


def reduction_body(node: ir.Reduction, plan: TilePlan, allocator: TileAllocator, patterns: Patterns,
                   operands: tuple[tuple[ir.Expr, str], ...] = (),
                   on_chip: tuple[tuple[ir.Load, str], ...] = (), summed: str | None = None,
                   column_chunks: bool = False, group_sums: bool = False) -> ReductionBody:
    """The lines of one row block (``p0``, ``rows``) of ``node`` under ``plan``, its tiles declared by
    ``allocator``; ``operands`` are (row expression, dtype of its tile) pairs, the expressions reading
    ``Result()`` as the reduced value, computed after the row stores on the engines the row epilogue's balance
    plans for both; ``on_chip``: (load, tile) pairs of rows already in SBUF, read there instead of loaded;
    ``summed``: a (P, 1) tile holding each row's sum of the prologue already (a sum or mean: no walk);
    ``column_chunks`` (a whole row, not grouped): the row epilogue's instructions work on one column chunk of the
    whole-row tiles (``column_loop``, inside ``column_loop_lines``' loop over ``f0``), so that each chunk's
    multiplies, adds and store follow each other on the engines while the next chunk starts, instead of each
    waiting for the whole row; ``group_sums``: grouped rows' sums on ScalarE (``_reduce_pass``)."""
    prologue, row_free, free, chunked = row_scopes(node, plan, allocator, patterns, columns=not plan.grouped_rows)
    for load, tile in on_chip:
        bind_load(prologue, load, Ref(tile=tile, dtype=load.dtype))
    shared = RowBroadcast(plan, allocator)
    prologue.shared_row, prologue.shared_value = shared.tile_for, shared.value_for
    count = math.prod(node.domain[d] for d in node.reduce_dims)
    # one result per row: a (P, 1) column, or [P, k] for k grouped rows per partition
    per_partition = plan.free[0].size if plan.grouped_rows else 1
    results = [(plan.free[0], str(per_partition))] if plan.grouped_rows else [(LoopDim(1, None), "1")]
    accumulator = summed or allocator.new("acc", per_partition)
    partial = allocator.new("partial", 1) if chunked else accumulator
    acc = f"{accumulator}[0:rows, 0:{per_partition}]"
    walk = [] if summed else _reduce_pass(node, prologue, REDUCE_OPS[node.op], accumulator, partial, chunked,
                                          per_partition, group_sums=group_sums)
    passes = [(walk, [])]
    more_results: tuple[Ref, ...] = ()
    if node.op == "mean":
        passes[0][1].append(_mean_line(acc, acc, count))
    elif node.op == "var":
        second, more_results = _variance_pass(node, prologue, accumulator, partial, chunked, passes[0][1])
        passes.append(second)
    if plan.cross_partition:
        # Every partition holds a partial of the one result: transpose them into a row and reduce that.
        spread = allocator.new_psum("partials_row", plan.partition.tile)
        passes[-1][1].extend([
            f"nisa.nc_transpose(dst={spread}[0:1, 0:rows], data={acc})",
            f"nisa.tensor_reduce(dst={accumulator}[0:1, 0:1], op={REDUCE_OPS[node.op]}, data={spread}[0:1, 0:rows], "
            "axis=1, keepdims=True)",
            "rows = 1",
        ])
    epilogue = epilogue_scope(allocator, patterns, Ref(tile=accumulator), results, more_results)
    store_lines(node.stores, epilogue, patterns, results, False, passes[-1][1])
    tiles: tuple[str, ...] = ()
    hoisted, column_loop = [], []
    loads = dict(prologue.balance.load)
    if node.row_stores or operands:
        # The row is still in SBUF: the fused consumers read it, with the reduced value as a (P, 1) operand.
        def row_scope(tiles: TileAllocator) -> TileScope:
            scope = _row_scope(tiles, prologue, accumulator, shared, more_results)
            if column_chunks:
                _in_column_chunks(scope, patterns, free)
            return scope

        row = row_scope(allocator)
        row.balance = _planned_row_balance(node, plan, prologue, epilogue, row_scope, patterns, free, operands)
        lines = column_loop if column_chunks else passes[-1][1]
        tiles = _row_epilogue_lines(node, plan, row, epilogue, patterns, free, lines, operands)
        hoisted = row.hoisted.allocations + row.hoisted.lines if column_chunks else []
        loads = {engine: load + row.balance.load[engine] for engine, load in loads.items()}
    return ReductionBody(passes, shared.lines, chunked, row_free, tiles, shared.sbuf_bytes, hoisted, column_loop,
                         loads)


def _in_column_chunks(scope: TileScope, patterns: Patterns, free) -> None:
    """``scope`` (a row epilogue's) with its instructions over the column chunk ``f0:f0 + cols`` of its whole-row
    tiles, its loads and stores over that chunk of the row, and its per-row values computed once, before the
    chunks (``HoistedColumns``)."""
    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}{COLUMN_CHUNK}", patterns.hbm(load.buffer, load.layout, free, True)

    scope.slice_text, scope.load_pattern = COLUMN_CHUNK, load_pattern
    scope.hoisted = HoistedColumns(scope.allocator.partitions, scope.allocator.reserved)


def in_column_chunks(plan: TilePlan, node: ir.Reduction) -> bool:
    """Whether ``node``'s row epilogue may run by column chunks: a whole row (one dim, not grouped, not spread over
    partitions) of two chunks or more. A matmul's norm epilogue takes them (kinds/matmul_norm_epilogue.py: its row
    blocks' epilogues all wait for the last N tile); a norm kernel does not, its row blocks overlapping already
    (Gemma3's final norm 13.9 -> 13.3 us, but Flux's mid size, whose norm kernels are 1024 columns wide, 2988.8 ->
    2991.5 us)."""
    whole = len(plan.free) == 1 and plan.free[0].tile == plan.free[0].size
    return (bool(node.row_stores) and whole and not plan.grouped_rows and not plan.cross_partition
            and plan.free[0].size >= 2 * COLUMN_CHUNK_WIDTH)


def column_loop_lines(body: ReductionBody, row: int) -> list[str]:
    """The row body's per-row values, then its loop over the column chunks of a row of ``row`` elements (nothing
    when the row epilogue is not chunked)."""
    if not body.column_loop:
        return []
    return body.hoisted + [
        "# the rest by column chunks: a chunk's instructions follow each other on the engines while the next starts",
        f"for f0 in range(0, {row}, {COLUMN_CHUNK_WIDTH}):", f"    cols = min({COLUMN_CHUNK_WIDTH}, {row} - f0)",
        *("    " + line for line in body.column_loop)]


def render_reduction(node: ir.Reduction, plan: TilePlan, name: str, parameters: list[str]) -> str:
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    body = reduction_body(node, plan, allocator, patterns)
    chunked = body.chunked
    chunk_allocations, allocations = allocator.split_by_width(body.row_free) if chunked else ([], allocator.lines)
    context = kernel_context(node, plan, name, parameters, allocations=allocations, passes=body.passes,
                             chunked=chunked, chunk_allocations=chunk_allocations, once=body.once)
    return render_template("reduction.py.j2", **context)


def _mean_line(dst: str, sums: str, count: int) -> str:
    return f"nisa.tensor_scalar(dst={dst}, data={sums}, op0=nl.multiply, operand0={1.0 / count!r})"


def _variance_pass(node: ir.Reduction, prologue: TileScope, accumulator: str, partial: str, chunked: bool,
                   after_sums: list[str]) -> tuple[tuple[list[str], list[str]], tuple[Ref, ...]]:
    """A variance's second pass (the sum of squared deviations from the mean, scaled), with the lines after the
    first pass's sums appended to ``after_sums``; and the results beyond the variance: the mean, as the mean
    kernel computes it, when a paired mean's stores read it (``Result(1)``, kinds/reduction_siblings.py)."""
    allocator, acc = prologue.allocator, f"{accumulator}[0:rows, 0:1]"
    count = math.prod(node.domain[d] for d in node.reduce_dims)
    scale = 1.0 / (count - node.correction) if count > node.correction else float("nan")
    negated_mean = allocator.new("negated_mean", 1)
    # Two passes, as the numerically stable definition: mean first, then the mean of squared deviations.
    after_sums.append(f"nisa.tensor_scalar(dst={negated_mean}[0:rows, 0:1], data={acc}, op0=nl.multiply, "
                      f"operand0={-1.0 / count!r})")
    more_results: tuple[Ref, ...] = ()
    if reduction_siblings.reads_mean(node):
        mean = Ref(tile=allocator.new("mean", 1), vector=True)
        after_sums.append(_mean_line(f"{mean.tile}[0:rows, 0:1]", acc, count))
        # -(sums * (1 / count)) is sums * (-1 / count) bit for bit: x - mean adds the negated mean already there
        remember_negation(prologue, mean, Ref(tile=negated_mean, vector=True))
        more_results = (mean,)
    second = _reduce_pass(node, prologue, "nl.add", accumulator, partial, chunked,
                          negated_mean=f"{negated_mean}[0:rows, 0:1]")
    return (second, [f"nisa.tensor_scalar(dst={acc}, data={acc}, op0=nl.multiply, operand0={number(scale)})"]), \
        more_results


def _row_scope(allocator: TileAllocator, prologue: TileScope, accumulator: str, shared: RowBroadcast,
               more_results: tuple[Ref, ...] = ()) -> TileScope:
    """The scope of a row epilogue over the row the prologue loaded: its tiles and values are reused, values
    constant along the row load as (P, 1) columns (as in the prologue), ``Result()`` is the reduced column
    (``Result(1)`` a paired variance's mean)."""
    row = TileScope(allocator, prologue.free, prologue.slice_text, prologue.load_pattern,
                    Ref(tile=accumulator, vector=True), vector_pattern=prologue.vector_pattern,
                    more_results=more_results)
    row.tiles, row.memo = prologue.tiles, dict(prologue.memo)
    row.shared_row, row.shared_value = shared.tile_for, shared.value_for
    row.scaled_products = True
    return row


def _row_epilogue_lines(node: ir.Reduction, plan: TilePlan, row: TileScope, epilogue: TileScope, patterns: Patterns,
                        free, lines: list[str], operands: tuple[tuple[ir.Expr, str], ...] = ()) -> tuple[str, ...]:
    """The row stores' instructions, then the ``operands``' (the tiles holding them, of their dtypes: returned);
    over grouped rows, the values constant along each row first, on the [P, k] results (codegen/grouped_rows.py)."""
    if plan.grouped_rows:
        exprs = [store.expr for store in node.row_stores] + [expr for expr, _ in operands]
        row_values(exprs, node.reduce_dims, row, epilogue, plan.free[0].size, lines)
    store_lines(node.row_stores, row, patterns, free, row.slice_text == COLUMN_CHUNK, lines)
    return tuple(stored_tile(dtype, emit(expr, row, lines), row, lines) for expr, dtype in operands)


def _planned_row_balance(node: ir.Reduction, plan: TilePlan, prologue: TileScope, epilogue: TileScope, row_scope,
                         patterns: Patterns, free, operands: tuple[tuple[ir.Expr, str], ...] = ()) -> EngineBalance:
    """The engines of a row epilogue's instructions, planned longest first on top of the prologue's work (VectorE
    holds the tensor_reduce, ScalarE a square): a trial emission into scratch tiles (``row_scope(allocator)``
    makes its scope) records every choice, as the pointwise body's ``balanced_body`` does; the real emission
    replays the plan. Deciding as they came put a norm's ``x - mean`` and its first product on VectorE before
    the modulation's two tensor_tensors, which only VectorE and GpSimd run, and an RMSNorm's weight product on
    VectorE beside its tensor_reduce while GpSimd idled."""
    scratch = TileAllocator(prologue.allocator.partitions, reserved=prologue.allocator.reserved)
    trial, results = row_scope(scratch), copy.copy(epilogue)
    trial.tiles = dict(prologue.tiles)
    results.allocator, results.memo, results.tiles = scratch, dict(epilogue.memo), dict(epilogue.tiles)
    results.balance = EngineBalance()
    trial.balance = EngineBalance()
    trial.balance.load, trial.balance.fixed = dict(prologue.balance.load), dict(prologue.balance.load)
    _row_epilogue_lines(node, plan, trial, results, patterns, free, [], operands)
    return trial.balance.planned()


def render_column_reduction(node: ir.Reduction, plan: TilePlan, name: str, parameters: list[str]) -> str:
    """Sum over strided leading dims: ones[rows, 1].T @ tile[rows, cols] accumulates column sums in PSUM."""
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    def column_pattern(load: ir.Load, tile: str):
        # a per-row value (an RMSNorm weight gradient's rsqrt): one element per partition, a (P, 1) operand,
        # instead of a broadcast DMA that moves every repeated element
        if plan.free[0].stride(load.layout) != 0:
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    prologue = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern, vector_pattern=column_pattern)
    body: list[str] = []
    value = emit(node.prologue, prologue, body)
    # TensorE needs both operands fp32 or both bf16: the ones take the data's dtype (products by 1 are exact).
    if value.vector or value.dtype not in ("float32", "bfloat16") or value.tile is None:
        staged = allocator.new("moving", plan.free[0].tile)
        source = fp32_tile(value, prologue, body) if value.vector else prologue.ref_text(value)
        body.append(f"nisa.tensor_copy(dst={staged}[0:rows, 0:cols], src={source})")
        value = Ref(tile=staged)
    body.append(f"nisa.nc_matmul(dst=column_sums[0:1, 0:cols], stationary=ones[0:rows, 0:1], "
                f"moving={prologue.ref_text(value)}, accumulate=p0 > 0)")
    row_allocations = len(allocator.lines)  # the body's tiles, fresh per row block so loads overlap the matmuls
    result = allocator.new("sums", plan.free[0].tile)
    count = math.prod(node.domain[d] for d in node.reduce_dims)
    finish = ["rows = 1", f"nisa.tensor_copy(dst={result}[0:1, 0:cols], src=column_sums[0:1, 0:cols])"]
    if node.op == "mean":
        finish.append(f"nisa.tensor_scalar(dst={result}[0:1, 0:cols], data={result}[0:1, 0:cols], op0=nl.multiply, "
                      f"operand0={1.0 / count!r})")
    epilogue = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern, Ref(tile=result))
    store_lines(node.stores, epilogue, patterns, free, True, finish)
    context = kernel_context(node, plan, name, parameters, allocations=allocator.lines[row_allocations:], body=body,
                             row_allocations=allocator.lines[:row_allocations], finish=finish,
                             ones_dtype=NL_DTYPES[value.dtype])
    return render_template("column_reduction.py.j2", **context)


def _ops_of(expr: ir.Expr) -> set[str]:
    return {node.op for node in ir.nodes_of(expr) if isinstance(node, ir.Op)}


def _reduced_output_reason(group: ir.Reduction, consumer) -> str:
    reduced = [size for dim, size in enumerate(group.domain) if dim not in group.reduce_dims]
    return (f"domain {list(consumer.domain)} is not the reduction's output {reduced}: the result is "
            "broadcast back over the reduced dims, which needs the whole row first")


def _row_fusion_reason(group: ir.Reduction, consumer: ir.Pointwise) -> str | None:
    """None if ``consumer`` (over the reduction's whole domain) may become a row epilogue of ``group``. Whether the
    row's tiles fit SBUF is the fusion driver's check (the planner sizes the body's declared tiles); whether a
    matmul then computes the norm, or norms the rows it writes, is weighed by bytes (passes/fold_traffic.py)."""
    stores = stored_exprs(group.stores + group.row_stores)
    varying = False
    for load in loads(consumer):
        if load.buffer in stores:
            if not ir.same_index_map(load.layout, stores[load.buffer].layout):
                return f"{load.buffer} is read through a view that changes the index map"
            varying |= any(store is stores[load.buffer] for store in group.row_stores)
        else:
            varying |= any(load.layout.strides[dim] != 0 for dim in group.reduce_dims)
    if not varying:
        return "the consumer is constant along the row (a broadcast of the reduced value)"
    if "where" in set().union(*(_ops_of(store.expr) for store in consumer.stores)):
        return "where in a row epilogue"
    return None


class ReductionKind(ProloguedKind):
    node_type = ir.Reduction
    name = "reduction"

    def stores(self, node):
        return tuple(node.stores) + tuple(node.row_stores)

    def exprs(self, node):
        return super().exprs(node) + [store.expr for store in node.row_stores]

    def map_exprs(self, node, fn):
        node = super().map_exprs(node, fn)
        return dataclasses.replace(
            node, row_stores=tuple(dataclasses.replace(store, expr=fn(store.expr)) for store in node.row_stores))

    def result_floors(self, node, floor_of):
        """A sum, mean or variance of non-negative values is non-negative (fp32 rounding keeps that); a max or
        min is one of the prologue's values."""
        floor = floor_of(node.prologue)
        non_negative = floor is not None and floor >= 0
        if node.op == "var":  # Result(1): the mean of a paired variance (kinds/reduction_siblings.py)
            return (0.0, 0.0 if non_negative else None)
        if node.op in ("sum", "mean") and non_negative:
            return (0.0,)
        return (floor,) if node.op in ("max", "min") else (None,)

    def describe(self, node):
        lines = [super().describe(node)]
        lines += [f"  {store.buffer.name} (over the row) = {store.expr}" for store in node.row_stores]
        return "\n".join(lines)

    def describe_head(self, node):
        return f" {node.op} over {list(node.reduce_dims)}\n  prologue: {node.prologue}"

    def restate(self, layout, group):
        """Consumers over the reduced output (kept dims, with or without size-1 reduced dims) in input coordinates:
        stride 0 along the reduced dims."""
        domain = group.domain
        out_shape = tuple(size for dim, size in enumerate(domain) if dim not in group.reduce_dims)
        keep_shape = tuple(1 if dim in group.reduce_dims else size for dim, size in enumerate(domain))
        if layout.shape == keep_shape:
            strides = tuple(0 if dim in group.reduce_dims else s for dim, s in enumerate(layout.strides))
            return ir.Layout(domain, strides, layout.offset)
        if layout.shape == out_shape:
            kept = iter(layout.strides)
            strides = tuple(0 if dim in group.reduce_dims else next(kept) for dim in range(len(domain)))
            return ir.Layout(domain, strides, layout.offset)
        return None

    def _is_row_epilogue(self, group, consumer) -> bool:
        return any(self.restate(store.layout, group) is None for store in consumer.stores)

    def epilogue_reason(self, group, consumer, outside):
        if self._is_row_epilogue(group, consumer):
            if consumer.domain == group.domain:
                return _row_fusion_reason(group, consumer)
            return _reduced_output_reason(group, consumer)
        if group.row_stores:
            return "the reduction already has a row epilogue; its reduced outputs take no other epilogue"
        return matching_index_reason(self, group, consumer)

    def merge_epilogue(self, group, consumer):
        if not (consumer.domain == group.domain and self._is_row_epilogue(group, consumer)):
            return super().merge_epilogue(group, consumer)
        stores = stored_exprs(self.stores(group))

        def inline(leaf):
            return stores[leaf.buffer].expr if isinstance(leaf, ir.Load) and leaf.buffer in stores else leaf

        inlined = tuple(ir.Store(store.buffer, ir.map_leaves(store.expr, inline), store.layout)
                        for store in consumer.stores)
        return dataclasses.replace(group, row_stores=group.row_stores + inlined)

    def sibling_reason(self, first, second, outside):
        return reduction_siblings.sibling_reason(first, second, outside)

    def merge_sibling(self, first, second, outside):
        return reduction_siblings.merge_sibling(first, second, outside)

    def prune(self, node, needed):
        return dataclasses.replace(
            node, stores=tuple(store for store in node.stores if store.buffer.name in needed),
            row_stores=tuple(store for store in node.row_stores if store.buffer.name in needed))

    def plan(self, node, target):
        return plan_reduction(node, target)

    def render(self, node, plan, name, parameters):
        if plan.kind == "column_reduction":
            return render_column_reduction(node, plan, name, parameters)
        return render_reduction(node, plan, name, parameters)


register_kind(ReductionKind())
