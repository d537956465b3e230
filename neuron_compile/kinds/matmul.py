"""Kernel kind ``matmul``: ``a @ b`` over (*batch, M, N) with an epilogue on the product (``ir.MatMul``).

Fusion: pointwise consumers over the output domain (bias, activation, residual) are epilogues applied on the PSUM
to SBUF copy. Tiling: M in 128-row stationary tiles, N in 512-column moving tiles (one PSUM bank of fp32), K in
128-deep chunks accumulated in PSUM; operands whose innermost run would be one element are loaded with contiguous
rows and transposed on TensorE; for large K the moving operand is streamed per K chunk. Codegen: matmul.py.j2.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, Ref, TileAllocator, TileScope
from neuron_compile.codegen.kernel_text import (
    Patterns,
    column_pattern,
    entries_text,
    kernel_context,
    kernel_names,
    offset_text,
    render_template,
    store_lines,
)
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import loads, register_kind
from neuron_compile.kinds import matmul_row_norm, norm_epilogue_rule, rotary_epilogue_rule
from neuron_compile.kinds.fusion_rules import MatchingIndexEpilogue, matching_index_reason
from neuron_compile.kinds.matmul_columns import ColumnOperands
from neuron_compile.kinds.matmul_row_stores import beside_row_buffers, row_store_entries, stores_rows
from neuron_compile.kinds.matmul_windows import TermColumns, Window, moving_windows
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TRANSPOSE_BLOCK, TilePlan, TilingError, count_tiles, needs_transpose

# Bytes per partition of one DMA filling a kept b tile: past the 4 KiB at which a transfer saturates the DMA
# engines (nki-spec §2), and a fraction of the tile, so that its first K chunks arrive early
KEPT_MOVING_LOAD_BYTES = 8192


def plan_matmul(node: ir.MatMul, target, unit: int = 1) -> TilePlan:
    """The DMA-transposing form where the target has it and a^T of one row block fits beside b's tiles, else
    the TensorE-transposing form (which a paired matmul does not have: sibling fusion pairs only where the
    resident form fits). ``unit``: the resident form's N tiles hold whole runs of that many columns
    (``moving_tile_widths``)."""
    resident = plan_resident(node, target, unit)
    if resident is None and node.shifts:
        raise TilingError(f"{node.name}: an implicit GEMM of {len(node.shifts)} terms keeps a^T of one 128-row block "
                          f"for every term ({len(node.shifts)} x K={node.k}) and each window of b beside it, which "
                          f"does not fit {target.name}'s SBUF budget ({target.sbuf_bytes_per_partition} B per "
                          f"partition) or needs a DMA transpose {target.name} does not have")
    if resident is None and node.b2 is not None:
        raise TilingError(f"{node.name}: a paired matmul needs the resident form (DMA transpose, a^T of one row "
                          f"block beside both operands' tiles), which {target.name} cannot hold")
    return resident or plan_transposing(node, target)


def plan_resident(node: ir.MatMul, target, unit: int = 1) -> TilePlan | None:
    """The DMA-transposing form: a^T resident per row group with b loaded again for every group
    (``plan_streamed_moving``), or b's tiles kept across the row groups (``plan_kept_moving``) when that moves
    fewer HBM bytes (a long K: a^T of every row does not fit, so b would be read once per row group). None when
    the target has no DMA transpose or not even one row block fits."""
    streamed = plan_streamed_moving(node, target, unit=unit)
    if streamed is None:
        return None
    if stores_rows(node):  # kept b tiles, a's row blocks stored whole (kinds/matmul_row_stores.py) at no more traffic
        kept = plan_kept_moving(node, beside_row_buffers(node, target, blocks_per_moving_tile(node, target)), unit)
        return kept if kept is not None and operand_traffic(node, kept) <= operand_traffic(node, streamed) else streamed
    kept = plan_kept_moving(node, target, unit)
    if kept is not None and operand_traffic(node, kept) < operand_traffic(node, streamed):
        return kept
    return streamed


def plan_streamed_moving(node: ir.MatMul, target, quickest: bool = False, unit: int = 1) -> TilePlan | None:
    """a^T resident for as many 128-row blocks as fit (``row_group``), b streamed once per group, N tiles of
    512 (256, 128 if K is large). SBUF per partition: the group's a^T chunks, two N tiles' b chunks (this one's
    and the next one's, loaded while this one multiplies) and two sets of epilogue tiles. A paired matmul keeps
    two of each b and PSUM tile. ``quickest``: of the N tiles holding one block, the one whose plan is quickest at
    its roofline (TensorE's work, or a and b's traffic with b once per row group), the widest of those; for the
    kernels that keep a norm's rows beside a^T, where a narrower N tile leaves room for a second block (b streamed
    once, not twice) that matters when the DMAs outlast TensorE. Else the widest N tile holding one block. N tiles
    of whole runs of ``unit`` columns (``moving_tile_widths``)."""
    if not target.dma_transpose and (not node.shifts or transposes_an_operand(node)):
        return None
    *batch, m, n = node.domain
    itemsize = operand_itemsize(node)
    operands = 1 if node.b2 is None else 2
    k_tile = min(node.k, target.partitions)
    k_tiles = math.ceil(node.k / k_tile)
    tiles = count_tiles([store.expr for store in node.stores])
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE)
    block_bytes = max(1, len(node.shifts)) * k_tiles * target.gemm_stationary_fmax * itemsize
    plans: list[TilePlan] = []
    for n_tile in moving_tile_widths(n, target, unit):
        windows, _ = moving_layout(node, n_tile)
        window_columns = len(windows) * (n_tile + max(window.span for window in windows))
        room = budget - 2 * operands * k_tiles * window_columns * itemsize - 2 * tiles * n_tile * 4
        blocks = min(math.ceil(m / target.gemm_stationary_fmax), room // block_bytes)
        if blocks >= 1:
            plans.append(resident_plan(node, target, k_tile, n_tile, tiles, blocks * target.gemm_stationary_fmax))
            if not quickest:
                break
    tensor_s = tensor_seconds(node, target)
    return min(plans, default=None,  # widest first: min keeps the first of equals
               key=lambda plan: max(tensor_s, operand_traffic(node, plan) / target.dma_bytes_per_s))


def plan_kept_moving(node: ir.MatMul, target, unit: int = 1) -> TilePlan | None:
    """b's tiles for ``column_group`` columns resident (all of N when they fit), a^T streamed past them in row
    groups, so b crosses HBM once and a once per column group; N tiles of 512 (256, 128 if K is large). A row
    group has as many 128-row blocks as keep TensorE busier than the DMA engines while b's tiles arrive during the
    first group (``blocks_per_moving_tile``), fewer if they do not fit. SBUF per partition: the kept b chunks, two
    row groups' a^T chunks (the next group's loaded while this one multiplies) and two sets of epilogue tiles.
    Plain matmuls only (no implicit GEMM, no paired matmul). N tiles of whole runs of ``unit`` columns."""
    if node.shifts or node.b2 is not None:
        return None
    n = node.domain[-1]
    itemsize = operand_itemsize(node)
    k_tile = min(node.k, target.partitions)
    k_tiles = math.ceil(node.k / k_tile)
    tiles = count_tiles([store.expr for store in node.stores])
    block_bytes = k_tiles * target.gemm_stationary_fmax * itemsize
    row_blocks = math.ceil(node.domain[-2] / target.gemm_stationary_fmax)
    for n_tile in moving_tile_widths(n, target, unit):
        budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE) - 2 * tiles * n_tile * 4
        for blocks in range(min(row_blocks, blocks_per_moving_tile(node, target)), 0, -1):
            column_tiles = (budget - 2 * blocks * block_bytes) // (k_tiles * n_tile * itemsize)
            if column_tiles >= 1:
                plan = resident_plan(node, target, k_tile, n_tile, tiles, blocks * target.gemm_stationary_fmax)
                return dataclasses.replace(plan, column_group=min(n, column_tiles * n_tile))
    return None


def moving_tile_widths(n: int, target, unit: int = 1) -> list[int]:
    """The N tiles a resident matmul tries, widest first: one PSUM bank of fp32 (512 columns), 256 and 128 (or all
    of N), each narrowed to a whole number of ``unit`` columns, none narrower than one. A rotary epilogue asks for
    whole heads (kinds/matmul_rotary.py): heads of 96 take 480, 192 or 96 columns; a unit dividing 128 changes
    nothing."""
    return sorted({min(n, size // unit * unit) for size in (target.gemm_moving_fmax, 256, 128) if size >= unit},
                  reverse=True)


def blocks_per_moving_tile(node: ir.MatMul, target) -> int:
    """128-row blocks whose matmuls with one N tile of b take TensorE at least as long as the DMA engines take to
    load that tile (K x N tile operand elements against K / 128 matmuls of N tile columns, 4x as long in fp32)."""
    itemsize = operand_itemsize(node)
    load_s = target.partitions * itemsize / target.dma_bytes_per_s
    multiply_s = (4 if itemsize == 4 else 1) / (target.tensor_ghz * 1e9)
    return max(1, math.ceil(load_s / multiply_s))


def operand_traffic(node: ir.MatMul, plan: TilePlan, loads_a: bool = True) -> int:
    """HBM bytes of a and b a plan loads: each once, b again for every row group when it is not kept (for every
    row block in the TensorE-transposing form), a again for every column group when b is. ``loads_a`` False: a
    is computed on chip (a normed matmul's operand), only b counts."""
    *batch, m, n = node.domain
    a_bytes = math.prod(batch) * m * node.k * operand_itemsize(node) if loads_a else 0
    b_bytes = math.prod(batch) * node.k * n * operand_itemsize(node) * (1 if node.b2 is None else 2)
    if plan.column_group:
        return b_bytes + math.ceil(n / plan.column_group) * a_bytes
    return a_bytes + math.ceil(m / (plan.row_group or plan.partition.tile)) * b_bytes


def tensor_seconds(node: ir.MatMul, target) -> float:
    """2 x M x N x K per batch index for each product (a paired matmul has two), at TensorE's peak for the
    operands' dtype."""
    flops = 2 * math.prod(node.domain) * node.k * (1 if node.b2 is None else 2)
    peak = target.tensor_bf16_tflops if operand_itemsize(node) == 2 else target.tensor_fp32_tflops
    return flops / (peak * 1e12)


def resident_plan(node: ir.MatMul, target, k_tile: int, n_tile: int, tiles: int, row_group: int) -> TilePlan:
    *batch, m, n = node.domain
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    partition = LoopDim(m, len(batch), 1, min(m, target.gemm_stationary_fmax))
    free = (LoopDim(n, len(batch) + 1, 1, n_tile),)
    return TilePlan("matmul", outer, partition, free, tiles, k_tile, math.ceil(node.k / k_tile), row_group=row_group)


def operand_itemsize(node: ir.MatMul) -> int:
    return 2 if node.a.dtype == "bfloat16" else 4


def moving_layout(node: ir.MatMul, n_tile: int) -> tuple[tuple[Window, ...], tuple[TermColumns, ...]]:
    """The windows b is loaded in per N tile of ``n_tile`` columns and each term's place in them (one window of
    exactly the tile for a plain matmul)."""
    if not node.shifts:
        return (Window(0, 0),), (TermColumns(0, 0),)
    column_stride = node.b.layout.strides[len(node.domain) - 1]
    return moving_windows(tuple(shift for _, shift in node.shifts), column_stride, n_tile)


def transposes_an_operand(node: ir.MatMul) -> bool:
    rank = len(node.domain) - 2
    a, b = node.a.layout.strides, node.b.layout.strides
    return needs_transpose(a[rank + 1], a[rank]) or needs_transpose(b[rank], b[rank + 1])


def plan_transposing(node: ir.MatMul, target) -> TilePlan:
    *batch, m, n = node.domain
    itemsize = operand_itemsize(node)
    k_tile = min(node.k, target.partitions)
    k_tiles = math.ceil(node.k / k_tile)
    rank = len(batch)
    transpose_a = needs_transpose(node.a.layout.strides[rank + 1], node.a.layout.strides[rank])
    transpose_b = needs_transpose(node.b.layout.strides[rank], node.b.layout.strides[rank + 1])
    # Resident per partition: the a^T chunks of one row block (kept across the N loop), a's whole rows when they
    # are transposed on chip, b's tile(s) of one N block and b^T's whole rows when transposed.
    stationary = k_tiles * target.gemm_stationary_fmax * itemsize + (node.k * itemsize if transpose_a else 0)

    def resident(n_tile: int, stream: bool) -> int:
        kept_moving = k_tiles if transpose_b and not stream else 1
        return stationary + kept_moving * n_tile * itemsize + (node.k * itemsize if transpose_b else 0)

    budget = target.sbuf_bytes_per_partition * SBUF_SHARE / 2
    n_tile, stream = min(n, target.gemm_moving_fmax), False
    if resident(n_tile, stream) > budget and transpose_b:
        n_tile, stream = min(n, TRANSPOSE_BLOCK), True
    if resident(n_tile, stream) > budget:
        raise TilingError(
            f"{node.name}: K={node.k} needs {resident(n_tile, stream)} B per partition of resident operand tiles, "
            f"over half the SBUF budget ({target.sbuf_bytes_per_partition} B per partition on {target.name})"
        )
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    partition = LoopDim(m, len(batch), 1, min(m, target.gemm_stationary_fmax))
    free = (LoopDim(n, len(batch) + 1, 1, n_tile),)
    tiles = count_tiles([store.expr for store in node.stores])
    return TilePlan("matmul", outer, partition, free, tiles, k_tile, k_tiles, stream_moving=stream)


def render_matmul(node: ir.MatMul, plan: TilePlan, name: str, parameters: list[str]) -> str:
    if plan.row_group:
        return render_resident(node, plan, name, parameters)
    return render_transposing(node, plan, name, parameters)


@dataclasses.dataclass(frozen=True)
class OperandTile:
    """How one operand fills its SBUF tile [k_tile, K chunks, free]: its tile's name, the free extent loaded (text),
    the loop over its terms or windows (an implicit GEMM) with the first chunk each fills, and the strides."""

    load: ir.Load
    tile: str
    free: str
    k_stride: int
    other_stride: int
    loop_var: str  # p0 or f0: where the tile starts along its free dim
    loop: str | None = None  # "for term, shift in ...:" (the loop binds ``shift``, an element offset)
    first_chunk: str = "0"
    chunks_per_load: int = 0  # K chunks per DMA (a loop binding kg, kn); 0: all of them in one


def operand_tiles(node: ir.MatMul, k_tiles: int, n_tile: int, kept_moving: bool = False) -> list[OperandTile]:
    """a^T into ``stationary[block]``, b into ``moving`` (and b2 into ``second_moving``); b into
    ``moving[column]`` when its tiles are kept (``kept_moving``), in DMAs of about ``KEPT_MOVING_LOAD_BYTES`` per
    partition, so that the first matmuls wait for a few K chunks rather than the whole tile. An implicit GEMM loads
    a^T once per term and b once per window (matmul_windows.py), each into its own K chunks."""
    batch = len(node.domain) - 2
    a, b = node.a.layout.strides, node.b.layout.strides
    if not node.shifts:
        per_load = max(1, KEPT_MOVING_LOAD_BYTES // (n_tile * operand_itemsize(node))) if kept_moving else 0
        moving = OperandTile(node.b, "moving[column]" if kept_moving else "moving", "cols", b[batch], b[batch + 1],
                             "f0", chunks_per_load=per_load)
        tiles = [OperandTile(node.a, "stationary[block]", "rows", a[batch + 1], a[batch], "p0"), moving]
        if node.b2 is not None:
            second = node.b2.layout.strides
            tiles.append(OperandTile(node.b2, "second_moving", "cols", second[batch], second[batch + 1], "f0"))
        return tiles
    windows, _ = moving_layout(node, n_tile)
    a_shifts = tuple(shift for shift, _ in node.shifts)
    window_list = tuple((window.shift, window.span) for window in windows)
    return [OperandTile(node.a, "stationary[block]", "rows", a[batch + 1], a[batch], "p0",
                        f"for term, shift in enumerate({a_shifts}):", f"term * {k_tiles}"),
            OperandTile(node.b, "moving", "cols + span", b[batch], b[batch + 1], "f0",
                        f"for window, (shift, span) in enumerate({window_list}):", f"window * {k_tiles}")]


def operand_loads(node: ir.MatMul, k_tile: int, n_tile: int, kept_moving: bool = False) -> tuple[list[str], ...]:
    """The lines that bring a^T [K, rows] into ``stationary[block]`` and b [K, cols] into ``moving``, both
    [k_tile, K chunks, 128 or cols] (element (p, kt, j) is K index kt * k_tile + p): one DMA per operand tile (a
    kept b tile: one per group of ``chunks_per_load`` chunks, in a loop), a DMA transpose when the operand's K is
    its contiguous dim. With ragged K chunks (K not a multiple of k_tile) one instruction per chunk ``kt`` of ``kk``
    rows, in a loop; an implicit GEMM's in a loop over its terms (a^T) or windows (b)."""
    batch = len(node.domain) - 2
    k_tiles = math.ceil(node.k / k_tile)
    whole = node.k % k_tile == 0
    loads = []
    for operand in operand_tiles(node, k_tiles, n_tile, kept_moving):
        strides = operand.load.layout.strides
        grouped = whole and 0 < operand.chunks_per_load < k_tiles
        terms = [(f"o{i}", strides[i]) for i in range(batch)] + [(operand.loop_var, operand.other_stride)]
        terms += [] if whole else [("k0", operand.k_stride)]
        terms += [("kg", operand.k_stride * k_tile)] if grouped else []
        terms += [("shift", 1)] if operand.loop else []
        offset = offset_text(operand.load.layout.offset, terms)
        first = operand.first_chunk
        if grouped:
            dst = f"{operand.tile}[0:{k_tile}, kg:kg + kn, 0:{operand.free}]"
            k_entries = [[operand.k_stride, k_tile], [operand.k_stride * k_tile, "kn"]]
        elif whole:
            chunks = f"0:{k_tiles}" if first == "0" else f"{first}:{first} + {k_tiles}"
            dst = f"{operand.tile}[0:{k_tile}, {chunks}, 0:{operand.free}]"
            k_entries = [[operand.k_stride, k_tile], [operand.k_stride * k_tile, k_tiles]]
        else:
            dst = f"{operand.tile}[0:kk, {'kt' if first == '0' else first + ' + kt'}, 0:{operand.free}]"
            k_entries = [[operand.k_stride, "kk"]]
        if needs_transpose(operand.k_stride, operand.other_stride):
            # the source as [free, (K chunks,) K within a chunk], reversed into the tile's order on the way in
            entries = [[operand.other_stride, operand.free], *reversed(k_entries)]
            axes = "(2, 1, 0)" if whole else "(1, 0)"
            line = (f"nisa.dma_transpose(dst={dst}, src={operand.load.buffer}.ap({entries_text(entries)}, "
                    f"offset={offset}), axes={axes})")
        else:
            entries = [*k_entries, [operand.other_stride, operand.free]]
            line = f"nisa.dma_copy(dst={dst}, src={operand.load.buffer}.ap({entries_text(entries)}, offset={offset}))"
        if grouped:
            line = (f"for kg in range(0, {k_tiles}, {operand.chunks_per_load}):\n"
                    f"    kn = min({operand.chunks_per_load}, {k_tiles} - kg)\n    {line}")
        loads.append(in_loops(line.split("\n"), node.k, k_tile, operand.loop))
    return tuple(loads)


def in_loops(lines: list[str], k: int, k_tile: int, loop: str | None) -> list[str]:
    """``lines`` inside a loop over the K chunks when K is ragged (binding kt, k0, kk), inside ``loop`` if any."""
    if k % k_tile:
        header = [f"for kt in range({math.ceil(k / k_tile)}):", f"    k0 = kt * {k_tile}",
                  f"    kk = min({k_tile}, {k} - k0)"]
        lines = header + ["    " + line for line in lines]
    return [loop] + ["    " + line for line in lines] if loop else lines


def evacuated_dtype(node: ir.MatMul) -> str:
    """The dtype the product leaves PSUM in: a bf16 / fp16 store's own when every store is the product as it is
    (a backward's weight gradient): the PSUM -> SBUF copy then rounds it once, as the store's cast did after an
    exact fp32 copy (the same bits), and the cast's pass over the tile is gone; else fp32, for the epilogue's math."""
    dtypes = {store.buffer.dtype for store in node.stores}
    if node.b2 is not None or len(dtypes) != 1 or not dtypes <= {"bfloat16", "float16"}:
        return "float32"
    dtype = next(iter(dtypes))
    plain = (ir.Result(), ir.Op("cast", (ir.Result(),), dtype))
    return dtype if all(store.expr in plain for store in node.stores) else "float32"


def render_resident(node: ir.MatMul, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    entries = resident_context(node, plan, allocator, product_dtype=evacuated_dtype(node))
    if plan.column_group and stores_rows(node):  # planned with room for the row buffers (plan_resident)
        entries.update(row_store_entries(node, plan, Patterns(plan)))
    return render_template("matmul_resident.py.j2", **kernel_context(node, plan, name, parameters, **entries))


def resident_context(node: ir.MatMul, plan: TilePlan, allocator: TileAllocator, loads_a: bool = True,
                     more_epilogue=None, product_dtype: str = "float32", results_in_psum: bool = False) -> dict:
    """The resident form's template entries beside ``kernel_context``'s; the tiles are declared by ``allocator``
    (those it declared before belong to the caller). ``loads_a`` False: a^T is not loaded (the caller's
    ``row_prologue`` fills ``stationary[block]`` for each row block, kernels/matmul_row_norm.py).
    ``more_epilogue(scope, lines)`` appends the caller's lines after the stores' in each tile's epilogue scope
    (kinds/matmul_norm_epilogue.py keeps a value of it on chip for its ``row_epilogue``). ``product_dtype``: the
    dtype the product leaves PSUM in (``evacuated_dtype``; the normed kinds keep fp32). ``results_in_psum``: the
    epilogue reads the products from their PSUM accumulators, not evacuated (the caller checked that each is read
    once, by an instruction with its other operand in SBUF: kinds/matmul_rotary.py)."""
    patterns = Patterns(plan)
    first_allocation = len(allocator.lines)
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    if results_in_psum:
        product, second_product = "accumulator", "second_accumulator" if node.b2 is not None else None
        allocator.psum_tiles.update(tile for tile in (product, second_product) if tile)  # kept off GpSimd
    else:
        product = allocator.new("product", plan.free[0].tile, product_dtype)
        second_product = allocator.new("second_product", plan.free[0].tile) if node.b2 is not None else None
    more_results = () if second_product is None else (Ref(tile=second_product),)
    scope = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern,
                      Ref(tile=product, dtype=product_dtype),
                      vector_pattern=column_pattern(plan, patterns), more_results=more_results)
    columns = ColumnOperands(plan, allocator)
    scope.shared_row = columns.tile_for
    epilogue: list[str] = []
    store_lines(node.stores, scope, patterns, free, True, epilogue)
    if more_epilogue is not None:
        more_epilogue(scope, epilogue)
    load_stationary, load_moving, *load_second_moving = operand_loads(node, plan.k_tile, plan.free[0].tile,
                                                                      kept_moving=bool(plan.column_group))
    windows, term_columns = moving_layout(node, plan.free[0].tile)
    # PSUM -> SBUF on ScalarE: VectorE has the epilogue's work
    evacuate = [f"nisa.activation(dst={tile}[0:rows, 0:cols], op=nl.copy, data={psum}[0:rows, 0:cols])"
                for tile, psum in ((product, "accumulator"), (second_product, "second_accumulator"))
                if tile and not results_in_psum]
    return dict(
        allocations=allocator.lines[first_allocation:], epilogue=epilogue, evacuate=evacuate,
        column_loads=columns.lines, load_stationary=load_stationary if loads_a else [], load_moving=load_moving,
        operand_dtype=NL_DTYPES[node.a.dtype], moving_tile="moving[column]" if plan.column_group else "moving",
        load_second_moving=load_second_moving[0] if load_second_moving else None,
        k=node.k, k_tile=plan.k_tile, k_tiles=plan.k_tiles,
        stationary_chunks=max(1, len(node.shifts)) * plan.k_tiles, moving_chunks=len(windows) * plan.k_tiles,
        span=max(window.span for window in windows),
        term_columns=tuple((place.window, place.column) for place in term_columns) if node.shifts else None,
        row_prologue=[], once=[], group_tiles=[], row_epilogue=[],
        group_note="each block's rows of the product's epilogue value, filled one N tile at a time, normed after "
                   "the last",
        row_note="every N tile has passed: each block's whole rows are on chip, normed here (the docstring's norm) "
                 "and stored",
    )


def render_transposing(node: ir.MatMul, plan: TilePlan, name: str, parameters: list[str]) -> str:
    if node.b2 is not None:
        raise TilingError(f"{node.name}: a paired matmul has no TensorE-transposing form")
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    dtype = node.a.dtype
    a, b = node.a.layout, node.b.layout
    # a is (batch, M, K): the stationary tile is a^T [K chunk on partitions, M tile free].
    batch = len(node.domain) - 2
    a_batch = [(f"o{i}", a.strides[i]) for i in range(batch)]
    b_batch = [(f"o{i}", b.strides[i]) for i in range(batch)]
    a_m, a_k, b_k, b_n = a.strides[batch], a.strides[batch + 1], b.strides[batch], b.strides[batch + 1]
    stationary_offset = offset_text(a.offset, a_batch + [("p0", a_m), ("k0", a_k)])
    transpose_stationary = needs_transpose(a_k, a_m)
    if transpose_stationary:  # a's rows [M tile, all of K] are contiguous
        stationary_offset = offset_text(a.offset, a_batch + [("p0", a_m)])
        entries = f"[[{a_m}, rows], [{a_k}, {node.k}]]"
    else:
        entries = f"[[{a_k}, kk], [{a_m}, rows]]"
    stationary_src = f"{node.a.buffer}.ap({entries}, offset={stationary_offset})"
    # b is (batch, K, N): the moving tile is [K chunk on partitions, N tile free].
    transpose_moving = needs_transpose(b_k, b_n)
    if transpose_moving and plan.stream_moving:  # the whole N tile (128 rows of b^T) in one DMA
        offset = offset_text(b.offset, b_batch + [("f0", b_n)])
        moving_src = f"{node.b.buffer}.ap([[{b_n}, cols], [{b_k}, {node.k}]], offset={offset})"
    elif transpose_moving:  # b^T's rows [N block of 128, K chunk] are contiguous (x @ W.T with W stored [N, K])
        offset = offset_text(b.offset, b_batch + [("f0", b_n), ("n1", b_n)])
        moving_src = f"{node.b.buffer}.ap([[{b_n}, nn], [{b_k}, {node.k}]], offset={offset})"
    else:
        offset = offset_text(b.offset, b_batch + [("k0", b_k), ("f0", b_n)])
        moving_src = f"{node.b.buffer}.ap([[{b_k}, kk], [{b_n}, cols]], offset={offset})"
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    product_dtype = evacuated_dtype(node)
    product = allocator.new("product", plan.free[0].tile, product_dtype)
    scope = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern,
                      Ref(tile=product, dtype=product_dtype), vector_pattern=column_pattern(plan, patterns))
    epilogue: list[str] = []
    store_lines(node.stores, scope, patterns, free, True, epilogue)
    context = kernel_context(
        node, plan, name, parameters, allocations=allocator.lines, epilogue=epilogue, product=product,
        stationary_src=stationary_src, moving_src=moving_src, operand_dtype=NL_DTYPES[dtype],
        k=node.k, k_tile=plan.k_tile, k_tiles=plan.k_tiles, transpose_stationary=transpose_stationary,
        transpose_moving=transpose_moving, transpose_block=min(plan.free[0].tile, TRANSPOSE_BLOCK),
        stream_moving=plan.stream_moving,
    )
    return render_template("matmul.py.j2", **context)


def reads_output_of(second: ir.MatMul, first: ir.MatMul) -> bool:
    """Whether ``second`` reads a buffer ``first`` writes."""
    written = {store.buffer.name for store in first.stores}
    return any(load.buffer in written for load in loads(second))


def sibling_reason(kind, first: ir.MatMul, second: ir.MatMul, outside: set[str]) -> str | None:
    """None if ``first`` and ``second`` multiply the same ``a`` over the same domain, so that ``second`` can compute
    both products in one pass over ``a``: ``first``'s output is then either read only by ``second``'s epilogue with
    its own index map (a gated MLP: up and gate; it never reaches HBM) or stored as it is (attention's k and v)."""
    if not isinstance(first, ir.MatMul) or not isinstance(second, ir.MatMul):
        return "sibling fusion pairs two matmuls"
    if first.b2 is not None or second.b2 is not None:
        return "one of the matmuls is already paired"
    if first.shifts or second.shifts:
        return "an implicit GEMM (a convolution) is not paired"
    if (first.a, first.domain, first.k, first.b.dtype) != (second.a, second.domain, second.k, second.b.dtype):
        return "the matmuls do not share their left operand, domain and K"
    written = {store.buffer.name for store in first.stores}
    if any(load.buffer in written for load in kind.operand_loads(second)):
        return f"{second.name} multiplies {first.name}'s output"
    if not reads_output_of(second, first):
        return None  # independent: both stored
    if len(first.stores) != 1 or outside:
        return f"{first.name}'s outputs are needed outside {second.name}"
    return matching_index_reason(kind, first, second)


def merge_sibling(first: ir.MatMul, second: ir.MatMul) -> ir.MatMul:
    """``second`` multiplying by ``first.b`` too: ``first``'s stores over ``Result(1)`` join ``second``'s when
    something else reads them, else ``second``'s reads of ``first``'s output become ``first``'s epilogue."""
    def as_second_product(expr: ir.Expr) -> ir.Expr:
        return ir.map_leaves(expr, lambda leaf: ir.Result(1) if isinstance(leaf, ir.Result) else leaf)

    written = {store.buffer.name: as_second_product(store.expr) for store in first.stores}
    if not reads_output_of(second, first):
        stores = second.stores + tuple(dataclasses.replace(s, expr=written[s.buffer.name]) for s in first.stores)
        return dataclasses.replace(second, b2=first.b, stores=stores)

    def inline(leaf):
        return written[leaf.buffer] if isinstance(leaf, ir.Load) and leaf.buffer in written else leaf

    stores = tuple(dataclasses.replace(s, expr=ir.map_leaves(s.expr, inline)) for s in second.stores)
    return dataclasses.replace(second, b2=first.b, stores=stores)


class MatMulKind(MatchingIndexEpilogue):
    node_type = ir.MatMul
    name = "matmul"
    takes_norm_epilogue = True
    takes_rotary_epilogue = True

    def operand_loads(self, node):
        return [node.a, node.b] + ([node.b2] if node.b2 is not None else [])

    def operand_bytes(self, node, plan):
        return operand_traffic(node, plan)

    def tensor_seconds(self, node, target):
        return tensor_seconds(node, target)

    def describe_head(self, node):
        second = f"\n  b2: {node.b2} (result1)" if node.b2 is not None else ""
        shifts = f"\n  shifts (a, b): {list(node.shifts)}" if node.shifts else ""
        return f" K={node.k}\n  a: {node.a}\n  b: {node.b}{second}{shifts}"

    def restate(self, layout, group):
        if len(layout.shape) == 2 and group.domain[0] == 1:  # mm's domain has a size-1 batch dim
            layout = ir.Layout((1, *layout.shape), (0, *layout.strides), layout.offset)
        return super().restate(layout, group)

    def row_operand_reason(self, producer, consumer):
        return matmul_row_norm.row_operand_reason(producer, consumer)

    def merge_row_operand(self, producer, consumer, kept):
        return matmul_row_norm.merge_row_operand(producer, consumer, kept)

    def norm_epilogue_reason(self, producer, consumer):
        return norm_epilogue_rule.norm_epilogue_reason(producer, consumer)

    def merge_norm_epilogue(self, producer, consumer, store_rows):
        return norm_epilogue_rule.merge_norm_epilogue(producer, consumer, store_rows)

    def rotary_epilogue_reason(self, producer, consumer, norm=None):
        return rotary_epilogue_rule.rotary_epilogue_reason(producer, consumer, norm)

    def merge_rotary_epilogue(self, producer, consumer, store_source, norm=None):
        return rotary_epilogue_rule.merge_rotary_epilogue(producer, consumer, store_source, norm)

    def epilogue_context(self, node, plan, allocator, more_epilogue, results_in_psum=False):
        """The resident form's template entries with ``more_epilogue`` in each tile's epilogue
        (kinds/matmul_rotary.py), the products read from PSUM when ``results_in_psum``."""
        if not plan.row_group:
            raise TilingError(f"{node.name}: an added epilogue needs the resident form")
        return resident_context(node, plan, allocator, more_epilogue=more_epilogue, results_in_psum=results_in_psum)

    def sibling_reason(self, first, second, outside):
        return sibling_reason(self, first, second, outside)

    def merge_sibling(self, first, second, outside):
        return merge_sibling(first, second)

    def plan(self, node, target):
        return plan_matmul(node, target)

    def plan_whole_columns(self, node, target, unit):
        """The plan whose N tiles hold whole runs of ``unit`` columns (a rotary epilogue's heads)."""
        return plan_matmul(node, target, unit)

    def render(self, node, plan, name, parameters):
        return render_matmul(node, plan, name, parameters)


register_kind(MatMulKind())
