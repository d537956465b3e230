"""Kernel kind ``pointwise``: elementwise math over one domain (``ir.Pointwise``), and the epilogue rule.

Fusion: a pointwise consumer joins its producer's group when it reads the producer with its own index map over
the same domain (a chain). Tiling: the output as [rows, cols] (rows on partitions in chunks of 128, cols in free
chunks sized to the SBUF share, by the tiles a trial emission of the body allocates where there are several:
``measured_plan``); a long last dim is split by a divisor so rows fill the partitions. A short last dim (a 64-wide
attention head, each head an outer loop) takes the innermost outer dim into the free axis as well (``widen_free``):
a tile then holds [rows, heads x 64], its DMAs move a few KiB per partition instead of 128 B, and there are
heads-times fewer of them (each DMA has a fixed cost). With no outer dim, rows shorter than 512 bytes
go several to a partition (tiles.py ``rows_per_partition``). Codegen: per tile one DMA per input through
its access pattern (two free entries, flattened into the tile's columns, when widened), the expression body, one
DMA per store (pointwise.py.j2). Row-vector work the same in every column tile (a scalar input, its reciprocal)
is computed once per row tile, before the column loop (codegen/hoisted_columns.py). A stored sum is added by the
DMA engines on its way out where a compute engine bounds the tile (codegen/dma_sums.py).
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.dma_sums import DmaSums, read_on_chip, summed_operands, tile_time_ns
from neuron_compile.codegen.engine_balance import EngineBalance
from neuron_compile.codegen.expressions import (
    SPLIT_MIN_COLUMNS,
    BroadcastLoad,
    RepeatedColumnsLoad,
    TileAllocator,
    TileScope,
)
from neuron_compile.codegen.hoisted_columns import HoistedColumns
from neuron_compile.codegen.psum_operands import psum_operands
from neuron_compile.codegen.kernel_text import Patterns, kernel_context, kernel_names, render_template, store_lines
from neuron_compile.codegen.strided_rows import (
    SpanLoads,
    emit_span_load,
    interleaved_store_lines,
    stepped_broadcast,
)
from neuron_compile.dims import LoopDim, collapse
from neuron_compile.hardware import get_target
from neuron_compile.kind_registry import loads, register_kind
from neuron_compile.kinds.fusion_rules import MatchingIndexEpilogue, matching_index_reason, merge_as_epilogue
from neuron_compile.tiles import (
    FP32_BYTES,
    SHORT_ROW_BYTES,
    TilePlan,
    count_tiles,
    free_tile,
    largest_divisor_at_most,
    rows_per_partition,
)

# A tile's free axis shorter than this (elements per partition) takes an outer dim in too: DMAs of >= 1 KiB.
WIDE_FREE_MIN = 512
# Column tiles in flight in a kernel of several (``pipeline_stages``): the tile plan budgets SBUF for them all.
PIPELINED_TILES = 2


def plan_pointwise(node: ir.Pointwise, target, tiles: int | None = None) -> TilePlan:
    """The node's tile plan; ``tiles``: how many tiles of this size share SBUF (default: the node's own)."""
    layouts = [store.layout for store in node.stores]
    layouts += [layout for store in node.stores for layout in ir.access_layouts(store.expr)]
    dims = collapse(node.domain, list(range(len(node.domain))), layouts)
    if not dims:
        dims = [LoopDim(1, None)]
    if len(dims) == 1 or dims[-2].size < target.partitions <= dims[-1].size:
        # One long dim, or a short one before a long one (8 heads before 128 x 128 scores): split the long one
        # so that rows fill the partitions (a divisor keeps the split exact); the short dim becomes a loop.
        last = dims[-1]
        rows = largest_divisor_at_most(last.size, target.partitions)
        cols = last.size // rows
        # (Not when the whole dim would go on partitions with one column: every DMA would move one element per
        # partition; the widest outer dim takes the partitions instead, below.)
        if len(dims) == 1 or (rows > dims[-2].size and cols > 1):
            split = [LoopDim(rows, last.source, cols * last.multiplier), LoopDim(cols, last.source, last.multiplier)]
            dims = [*dims[:-1], *split]
    dims = widest_rows_on_partitions(dims, target.partitions)
    tiles = tiles or count_tiles([store.expr for store in node.stores])
    partition = dataclasses.replace(dims[-2], tile=min(dims[-2].size, target.partitions))
    free = dataclasses.replace(dims[-1], tile=free_tile(dims[-1].size, tiles, target))
    if free.tile < free.size:  # several column tiles: the software pipeline keeps two of them in SBUF at once
        tiles *= PIPELINED_TILES
        free = dataclasses.replace(free, tile=free_tile(free.size, tiles, target))
    outer, free_dims = widen_free(dims[:-2], free, tiles, target)
    row_bytes = free.size * max(ir.ITEMSIZE.get(store.buffer.dtype, 4) for store in node.stores) if node.stores else 0
    if not outer and len(free_dims) == 1 and row_bytes < SHORT_ROW_BYTES:
        partition, free_dims = rows_per_partition(partition, free, tiles, target)
    return TilePlan("pointwise", tuple(outer), partition, free_dims, tiles)


def measured_plan(node: ir.Pointwise, plan: TilePlan, target) -> TilePlan:
    """``plan`` with wider column tiles where the tiles its body allocates take less SBUF than ``count_tiles``
    budgeted (one fp32 tile per load and op: bf16 tiles take half, values computed into PSUM none, and the DMA
    engines' sums no tile), so that each DMA moves more bytes per fixed cost: the tiles are counted in a trial
    emission of the body. A tile computing values into PSUM stays within one bank (``psum_operands``)."""
    free = plan.free[0]
    if len(plan.free) != 1 or free.tile >= free.size:
        return plan
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, ()))
    balanced_body(node.stores, plan, allocator, hoisted=HoistedColumns(plan.partition.tile, allocator.reserved))
    # one tile more per store: a sum the DMA engines add at this width may need its tile at a wider one
    fp32_tiles = math.ceil(allocator.sbuf_bytes / free.tile / FP32_BYTES) + len(node.stores)
    wider = plan_pointwise(node, target, fp32_tiles)
    columns = wider.free[0].tile if len(wider.free) == 1 else 0
    if allocator.psum_tiles:
        columns = min(columns, target.psum_bank_bytes // FP32_BYTES)
    if columns <= free.tile:
        return plan
    return dataclasses.replace(plan, free=(dataclasses.replace(free, tile=columns),),
                               tiles_per_iteration=wider.tiles_per_iteration)


def widest_rows_on_partitions(dims: list[LoopDim], partitions: int) -> list[LoopDim]:
    """``dims`` with the largest outer dim moved next to the last when the dim there is shorter than the partitions
    and the outer one longer: a channel dim of 256 before 16 x 2 x 16 x 2 pixels fills the partitions instead of
    16 of them, over 16 times fewer, larger tiles (the dim it displaces joins the loops or the free axis)."""
    if len(dims) < 3 or dims[-2].size >= partitions:
        return dims
    widest = max(dims[:-2], key=lambda dim: dim.size)
    if widest.size <= dims[-2].size:
        return dims
    rest = [dim for dim in dims[:-1] if dim is not widest]
    return [*rest, widest, dims[-1]]


def widen_free(outer: list[LoopDim], free: LoopDim, tiles: int, target) -> tuple[list[LoopDim], tuple[LoopDim, ...]]:
    """(outer dims, free dims): a free dim shorter than ``WIDE_FREE_MIN`` and taken whole is joined by the
    innermost outer dim, walked in chunks as the first free entry (as many as the SBUF share holds)."""
    if not outer or free.tile < free.size or free.size >= WIDE_FREE_MIN:
        return outer, (free,)
    chunks = max(1, free_tile(outer[-1].size * free.size, tiles, target) // free.size)
    return outer[:-1], (dataclasses.replace(outer[-1], tile=min(outer[-1].size, chunks)), free)


def pointwise_body(stores: tuple[ir.Store, ...], plan: TilePlan, allocator: TileAllocator,
                   interleaved: tuple[tuple[ir.Store, ...], ...] = ()) -> list[str]:
    """The lines of one [rows, cols] tile (cols x the inner free dim's size when widened): loads, the expressions,
    the stores. Concat parts reuse it: parts with one loop nest pass their stores together, so a load two parts
    share (rotate_half reads both halves in each) is one DMA; ``interleaved`` are groups of stores that interleave
    (``strided_rows.interleaving``), each stored as one contiguous DMA. Loads with a small innermost step read a
    contiguous span (codegen/strided_rows.py)."""
    return balanced_body(stores, plan, allocator, interleaved)[0]


def balanced_body(stores: tuple[ir.Store, ...], plan: TilePlan, allocator: TileAllocator,
                  interleaved: tuple[tuple[ir.Store, ...], ...] = (),
                  hoisted: HoistedColumns | None = None) -> tuple[list[str], int]:
    """``pointwise_body``'s lines, and the line after which half of the tile's engine work is issued. The body
    is emitted twice: first into a scratch allocator, to learn every instruction the engines could share, then
    for real with those instructions assigned longest first (codegen/engine_balance.py). ``hoisted``: where the
    row-vector work that is the same in every column tile goes (codegen/hoisted_columns.py), or None (kept in
    the body)."""
    balance, in_psum, dma_sums = _planned_balance(stores, plan, allocator, interleaved, hoisted is not None)
    body = _tile_lines(stores, plan, allocator, interleaved, balance, hoisted, in_psum, dma_sums)
    return body, balance.halfway_line


def _planned_balance(stores: tuple[ir.Store, ...], plan: TilePlan, allocator: TileAllocator,
                     interleaved: tuple[tuple[ir.Store, ...], ...],
                     hoisting: bool) -> tuple[EngineBalance, frozenset, DmaSums | None]:
    """The engine plan of a tile from a trial emission, the values it computes into PSUM and the stored sums the
    DMA engines add (None: none). Each PSUM value is tried on top of those kept before it, with and without the
    sums, and kept when the better of the two makes the tile shorter (its busiest engine or DMA, then its busiest
    engine: codegen/psum_operands.py, codegen/dma_sums.py); a value a sum would read (the DMA cannot read PSUM)
    competes with the sum that way."""

    def trial(in_psum: frozenset, dma_sums: DmaSums | None) -> EngineBalance:
        balance = EngineBalance()
        scratch = TileAllocator(allocator.partitions, reserved=allocator.reserved)
        trial_hoisted = HoistedColumns(allocator.partitions, allocator.reserved) if hoisting else None
        _tile_lines(stores, plan, scratch, interleaved, balance, trial_hoisted, in_psum, dma_sums)
        return balance.planned()

    if not plan.target or interleaved:
        return trial(frozenset(), None), frozenset(), None
    target, columns = get_target(plan.target), plan.free[0].tile * math.prod(dim.size for dim in plan.free[1:])
    summing = any(summed_operands(store) for store in stores)

    def timed(in_psum: frozenset) -> tuple[tuple[float, float], EngineBalance, DmaSums | None]:
        """((tile ns, busiest engine's load), plan, sums) of the better of the trials without and with the sums."""
        def rank(balance: EngineBalance, summed_bytes: dict[str, int]) -> tuple[float, float]:
            transfers = _transfer_bytes(stores, plan, summed_bytes)
            return (tile_time_ns(balance.expected, transfers, plan.partition.tile, columns, target),
                    max(balance.expected.values()))

        plain = trial(in_psum, None)
        best = (rank(plain, {}), plain, None)
        if summing:
            summing_trial = DmaSums(read_on_chip(stores))
            summed = trial(in_psum, summing_trial)
            summed_rank = rank(summed, summing_trial.read_bytes) if summing_trial.read_bytes else None
            if summed_rank is not None and summed_rank < best[0]:
                # a fresh DmaSums for the real emission (the trial's has recorded its own)
                best = (summed_rank, summed, DmaSums(read_on_chip(stores)))
        return best

    best, in_psum = timed(frozenset()), frozenset()
    for value in _psum_candidates(stores, plan, target):  # one at a time: each moves its readers to VectorE
        if len(in_psum) == _psum_budget(target):
            break
        with_value = timed(in_psum | {value})
        if with_value[0] < best[0]:
            best, in_psum = with_value, in_psum | {value}
    return best[1], in_psum, best[2]


def _psum_candidates(stores: tuple[ir.Store, ...], plan: TilePlan, target) -> tuple:
    """The values a tile could compute into PSUM (codegen/psum_operands.py), all of them: the caller keeps at most
    ``_psum_budget`` (a candidate the trials reject takes no bank); none in a widened tile (its broadcast operands
    take PSUM banks)."""
    if len(plan.free) != 1:
        return ()
    return psum_operands(stores, plan.free[0].tile, target.psum_bank_bytes // 4, math.inf)


def _psum_budget(target) -> int:
    """PSUM values a tile may keep: one bank each per column tile in flight, one bank per tile left over."""
    return target.psum_banks // PIPELINED_TILES - 1


def _transfer_bytes(stores: tuple[ir.Store, ...], plan: TilePlan, summed_bytes: dict[str, int]) -> list[int]:
    """Bytes per element of each DMA of a tile: its loads that vary along the free dims, and its stores (a store
    the DMA engines sum moves its operands' ``summed_bytes``, or its own where more). The loads are the expressions'
    Load leaves, not ``ir.loads_of``'s, which adds a dropout mask's seed: one int32 per tile, read through a layout
    of its own, not the domain's."""
    loads = dict.fromkeys(node for store in stores for node in ir.nodes_of(store.expr) if isinstance(node, ir.Load))
    varying = [load for load in loads if any(dim.stride(load.layout) != 0 for dim in plan.free)]
    stored = [max(summed_bytes.get(store.buffer.name, 0), ir.ITEMSIZE[store.buffer.dtype]) for store in stores]
    return [ir.ITEMSIZE.get(load.dtype, 4) for load in varying] + stored


def narrowest_column_tile(free: LoopDim) -> int:
    """The columns of a kernel's narrowest column tile (its ragged last one, if any)."""
    return free.size % free.tile or free.tile


def _tile_lines(stores: tuple[ir.Store, ...], plan: TilePlan, allocator: TileAllocator,
                interleaved: tuple[tuple[ir.Store, ...], ...], balance: EngineBalance,
                hoisted: HoistedColumns | None = None, in_psum: frozenset = frozenset(),
                dma_sums: DmaSums | None = None) -> list[str]:
    """``pointwise_body``'s lines with the engines ``balance`` gives, the values ``in_psum`` in PSUM and the stored
    sums ``dma_sums`` adds."""
    patterns = Patterns(plan)
    free = [(plan.free[0], "cols")] + [(dim, str(dim.size)) for dim in plan.free[1:]]
    inner = math.prod(dim.size for dim in plan.free[1:])
    columns = "[0:rows, 0:cols]" if inner == 1 else f"[0:rows, 0:cols * {inner}]"

    def load_pattern(load: ir.Load, tile: str):
        # a DMA fills the tile row-major: two free entries land flattened in the tile's columns
        return f"{tile}{columns}", patterns.hbm(load.buffer, load.layout, free, True)

    def vector_pattern(load: ir.Load, tile: str):
        if any(dim.stride(load.layout) != 0 for dim in plan.free):
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    def broadcast_pattern(load: ir.Load) -> BroadcastLoad | RepeatedColumnsLoad | None:
        if inner == 1 or load.dtype == "bool":
            return None
        if plan.free[0].stride(load.layout) == 0:
            # constant along the widened dim (the heads) but not along the inner one: load the inner row once
            return stepped_broadcast(inner, "cols", patterns.hbm(load.buffer, load.layout, free[1:], False),
                                     load.dtype)
        if all(dim.stride(load.layout) == 0 for dim in plan.free[1:]):
            # one value per row of several rows per partition: load the values once, repeat them in the view
            return RepeatedColumnsLoad(plan.free[0].tile, inner, patterns.hbm(load.buffer, load.layout, free[:1], True))
        return None

    scope = TileScope(allocator, plan.free[0].tile * inner, columns, load_pattern, vector_pattern=vector_pattern,
                      broadcast_pattern=broadcast_pattern)
    scope.balance = balance
    scope.hoisted = hoisted
    scope.psum_operands = in_psum
    scope.split_columns = inner == 1 and narrowest_column_tile(plan.free[0]) >= SPLIT_MIN_COLUMNS

    def hbm(buffer: str, layout: ir.Layout):
        return patterns.hbm(buffer, layout, free, True)

    every = (*stores, *(store for group in interleaved for store in group))
    spans = SpanLoads([store.expr for store in every], hbm, len(every[0].layout.shape))

    def span_load(load: ir.Load, lines: list[str]):
        span = spans(load)
        return emit_span_load(load, span, scope, lines) if span is not None else None

    scope.span_load = span_load
    body: list[str] = []
    balance.lines = body  # where each instruction it charges lands
    store_lines(stores, scope, patterns, free, True, body, dma_sums)
    for group in interleaved:
        interleaved_store_lines(group, scope, hbm, body)
    return body


class PointwiseKind(MatchingIndexEpilogue):
    node_type = ir.Pointwise
    name = "pointwise"
    elementwise = True
    holds_random = True

    def sibling_reason(self, first, second, outside):
        """A pointwise kernel whose outputs a later one over the same domain reads with their own index map (AdamW's
        new second moment, read by the parameter update) is computed inside it: its values reach the reader on
        chip instead of through HBM, and the reader's loads of the shared inputs happen once."""
        if not {store.buffer.name for store in first.stores} & {load.buffer for load in loads(second)}:
            return "pointwise kernels pair only with a kernel that reads them"
        return matching_index_reason(self, first, second)

    def merge_sibling(self, first, second, outside):
        """``second`` with ``first``'s values inlined where it reads them; ``first``'s stores kept only where
        something else reads them (``outside``: a region output, another kernel)."""
        merged = merge_as_epilogue(self, first, second)
        kept = tuple(store for store in merged.stores[:len(first.stores)] if store.buffer.name in outside)
        return dataclasses.replace(merged, name=second.name, stores=kept + merged.stores[len(first.stores):])

    def plan(self, node, target):
        return measured_plan(node, dataclasses.replace(plan_pointwise(node, target), target=target.name), target)

    def render(self, node, plan, name, parameters):
        allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
        hoisted = HoistedColumns(plan.partition.tile, allocator.reserved)
        body, halfway = balanced_body(node.stores, plan, allocator, hoisted=hoisted)
        stages = pipeline_stages(plan, body, halfway)
        context = kernel_context(node, plan, name, parameters, allocations=allocator.lines, body=body,
                                 stages=stages, tiles=", ".join(allocator.names),
                                 row_tile_work=hoisted.allocations + hoisted.lines)
        return render_template("pointwise.py.j2", **context)


def pipeline_stages(plan: TilePlan, body: list[str], halfway: int) -> tuple[list[str], list[str]] | None:
    """The body split in two stages for a software pipeline over the column tiles (the template issues tile i's
    first stage before tile i - 1's second, so that each engine's queue holds two tiles' work and a long chain of
    dependent instructions across engines, such as AdamW's rsqrt -> reciprocal -> scalings -> reciprocal, does not
    leave engines waiting), split where half of the engine work is issued; None for a kernel of one column tile, a
    widened free axis, or a body that is not one instruction per line."""
    free = plan.free[0]
    if len(plan.free) != 1 or free.tile >= free.size or not 0 < halfway < len(body):
        return None
    if not all(line.startswith("nisa.") for line in body):
        return None
    return body[:halfway], body[halfway:]


register_kind(PointwiseKind())
