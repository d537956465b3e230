"""Kernel kind ``matmul_norm_epilogue``: a matmul whose output rows a row norm reduces in the same kernel
(``ir.MatMulNormEpilogue``).

Fusion: made after grouping by passes/norm_epilogues.py under the rule in kinds/norm_epilogue_rule.py (an RMSNorm of
whole rows of the matmul's output: a decoder's final norm of ``h + down(...)``, which then never crosses HBM but
once, normed); it takes no further fusion. Tiling: the matmul's resident form with b streamed past a row group
(``plan_streamed_moving``: a group's N tiles all pass before the next group starts), planned in the SBUF left beside
the group's kept rows and the norm's tiles, with the N tile quickest at its roofline; a row too wide for that
raises ``TilingError`` and the kernels stay apart. Codegen: matmul_resident.py.j2; each N tile's epilogue copies the
rows' value into its block's row tile ([rows, N]) and adds the sum of its squares into the block's row sums (one
ScalarE activation per tile, as the reduction kind takes a row too wide for one walk); after the N loop
(``row_epilogue``) the reduction kind's row body runs on each block from those sums, reading the kept tile where the
unfused norm loads the row from HBM. The same instructions on the same values but for the fp32 sum of squares, added
by N tile (the goal point's 1-layer Llama: 387.0 us, 388.7 with one ScalarE pass over each whole row after the last
tile); a row of two column chunks or more is normed chunk by chunk (kinds/reduction.py ``column_chunks``), so that
the multiplies, a residual add and the store of a chunk pipeline across the engines after the last matmul.
"""

from __future__ import annotations

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
    emit_store,
)
from neuron_compile.codegen.kernel_text import Patterns, kernel_context, kernel_names, render_template
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, kind_of, register_kind
from neuron_compile.kinds.matmul import operand_traffic, plan_streamed_moving, resident_context, tensor_seconds
from neuron_compile.kinds.reduction import ReductionBody, column_loop_lines, in_column_chunks, reduction_body
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TilePlan, TilingError

KEPT_ROWS = "kept_rows"  # the stem of the list of a row group's [rows, N] tiles, one per 128-row block
ROW_SUMS = "row_sums"  # and of their [rows, 1] sums of squares


def as_matmul(node: ir.MatMulNormEpilogue) -> ir.MatMul:
    """The matmul part: its stores, and the rows when they still go to HBM."""
    stores = node.stores + ((node.rows,) if node.store_rows else ())
    return ir.MatMul(node.name, node.domain, node.k, node.a, node.b, stores)


def rows_loads(node: ir.MatMulNormEpilogue) -> list[ir.Load]:
    """The norm's loads of the rows, which read the kept tiles instead."""
    exprs = kind_of(node.norm).exprs(node.norm)
    return list(dict.fromkeys(load for expr in exprs for load in ir.loads_of(expr)
                              if load.buffer == node.rows.buffer.name))


def row_plan(node: ir.MatMulNormEpilogue, outer: tuple[LoopDim, ...], partition: LoopDim) -> TilePlan:
    """The norm's plan for one row block: the matmul's ``outer`` loops and row tiles, the whole row of N on the
    free axis (the norm's domain is the matmul's)."""
    n = node.domain[-1]
    return TilePlan("reduction", outer, partition, (LoopDim(n, len(node.domain) - 1, 1, n),), 0)


def row_body(node: ir.MatMulNormEpilogue, plan: TilePlan, allocator: TileAllocator, kept: str,
             sums: str) -> ReductionBody:
    """The reduction kind's lines for one row block after its last N tile, the rows read from ``kept[block]``,
    their sums of squares from ``sums[block]``."""
    return reduction_body(node.norm, plan, allocator, Patterns(plan),
                          on_chip=tuple((load, f"{kept}[block]") for load in rows_loads(node)), summed=f"{sums}[block]",
                          column_chunks=in_column_chunks(plan, node.norm))


def keep_rows(node: ir.MatMulNormEpilogue, kept: str, sums: str, scope: TileScope, lines: list[str]) -> None:
    """An N tile's epilogue lines beside the stores': the rows' value copied into ``kept[block]`` (on GpSimd,
    which the epilogue leaves idle: ScalarE evacuates PSUM, VectorE computes the value), and the sum of its squares
    (ScalarE, one activation) added into ``sums[block]``, so that after the last tile only the norm's multiplies
    are left."""
    value = emit_store(node.rows.buffer.dtype, emit(node.rows.expr, scope, lines), scope, lines)
    destination = f"{kept}[block][0:rows, f0:f0 + cols]"
    lines.append(f"nisa.tensor_copy(dst={destination}, src={value}, engine=nisa.engine.gpsimd)")
    for load in rows_loads(node):  # the value's own tile: the sum need not wait for the copy
        bind_load(scope, load, Ref(tile=kept, dtype=load.dtype, view=value))
    partial = scope.tile(vector=True, stem="partial_sums")
    if emit_row_summed(node.norm.prologue, scope, lines, f"{partial}[0:rows, 0:1]") is None:
        raise TilingError(f"{node.name}: the norm's prologue {node.norm.prologue} is not one ScalarE activation")
    lines += ["if f0 == 0:", f"    nisa.tensor_copy(dst={sums}[block][0:rows, 0:1], src={partial}[0:rows, 0:1])",
              "else:", f"    nisa.tensor_tensor(dst={sums}[block][0:rows, 0:1], data1={sums}[block][0:rows, 0:1], "
              f"data2={partial}[0:rows, 0:1], op=nl.add)"]


def norm_bytes(node: ir.MatMulNormEpilogue, target) -> int:
    """SBUF bytes per partition the norm's tiles take: its row body emitted into a scratch allocator."""
    *batch, m, _ = node.domain
    partition = LoopDim(m, len(batch), 1, min(m, target.gemm_stationary_fmax))
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    scratch = TileAllocator(partition.tile)
    body = row_body(node, row_plan(node, outer, partition), scratch, KEPT_ROWS, ROW_SUMS)
    return scratch.sbuf_bytes + body.shared_bytes


def plan_norm_epilogue(node: ir.MatMulNormEpilogue, target) -> TilePlan:
    """The streamed resident plan with the most row blocks whose kept rows fit beside the norm's tiles."""
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE)
    norm = norm_bytes(node, target)
    row = node.domain[-1] * ir.ITEMSIZE[node.rows.buffer.dtype] + 4  # the kept rows and their sums
    if norm + row > budget // 2:
        raise TilingError(f"{node.name}: the norm's row of N={node.domain[-1]} elements keeps {norm + row} B per "
                          f"partition on chip, over half the SBUF budget ({budget} B per partition on {target.name})")
    blocks = math.ceil(node.domain[-2] / target.gemm_stationary_fmax)
    for cap in range(blocks, 0, -1):
        kept = norm + cap * row
        beside = dataclasses.replace(target, sbuf_bytes_per_partition=target.sbuf_bytes_per_partition
                                     - math.ceil(kept / SBUF_SHARE))
        plan = plan_streamed_moving(as_matmul(node), beside, quickest=True)
        if plan is not None:
            return dataclasses.replace(plan, row_group=min(plan.row_group, cap * target.gemm_stationary_fmax))
    raise TilingError(f"{node.name}: a^T of one row block and b's tiles do not fit beside one block's kept rows and "
                      f"the norm's tiles ({norm + row} B per partition) on {target.name}, or b needs a DMA transpose "
                      "it does not have")


def render_norm_epilogue(node: ir.MatMulNormEpilogue, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    kept, sums = allocator.take_name(KEPT_ROWS), allocator.take_name(ROW_SUMS)
    body = row_body(node, row_plan(node, plan.outer, plan.partition), allocator, kept, sums)
    n, dtype = node.domain[-1], NL_DTYPES[node.rows.buffer.dtype]
    row_epilogue = list(allocator.lines) + [f"cols = {n}"]
    for walk, after in body.passes:
        row_epilogue += walk + after
    row_epilogue += column_loop_lines(body, n)
    context = resident_context(as_matmul(node), plan, allocator,
                               more_epilogue=lambda scope, lines: keep_rows(node, kept, sums, scope, lines))
    tile = plan.partition.tile
    group_tiles = [f"{kept} = [nl.ndarray(({tile}, {n}), dtype={dtype}, buffer=nl.sbuf) for _ in range(blocks)]",
                   f"{sums} = [nl.ndarray(({tile}, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(blocks)]"]
    context.update(row_epilogue=row_epilogue, group_tiles=group_tiles, once=body.once)
    return render_template("matmul_resident.py.j2", **kernel_context(node, plan, name, parameters, **context))


class MatMulNormEpilogueKind(KernelKind):
    node_type = ir.MatMulNormEpilogue
    name = "matmul_norm_epilogue"
    refusal = "a matmul with a norm epilogue is made after grouping and takes no fused consumer"

    def stores(self, node):
        return as_matmul(node).stores + kind_of(node.norm).stores(node.norm)

    def exprs(self, node):
        """The norm's expressions with the rows' value where they load it: the rows are never read from HBM."""
        norm = [ir.with_stored_value(expr, node.rows) for expr in kind_of(node.norm).exprs(node.norm)]
        return [store.expr for store in node.stores] + [node.rows.expr] + norm

    def operand_loads(self, node):
        return [node.a, node.b]

    def operand_bytes(self, node, plan):
        return operand_traffic(as_matmul(node), plan)

    def tensor_seconds(self, node, target):
        return tensor_seconds(as_matmul(node), target)

    def map_exprs(self, node, fn):
        stores = tuple(dataclasses.replace(store, expr=fn(store.expr)) for store in node.stores)
        return dataclasses.replace(node, stores=stores, rows=dataclasses.replace(node.rows, expr=fn(node.rows.expr)),
                                   norm=kind_of(node.norm).map_exprs(node.norm, fn))

    def describe(self, node):
        matmul = kind_of(as_matmul(node)).describe(as_matmul(node)).split("\n")
        norm = ["  " + line for line in kind_of(node.norm).describe(node.norm).split("\n")]
        kept = "kept on chip and stored" if node.store_rows else "kept on chip"
        return "\n".join([f"{matmul[0]} with a norm epilogue", *matmul[1:],
                          f"  {node.rows.buffer.name} = {node.rows.expr} ({kept}), then normed:", *norm])

    def prune(self, node, needed):
        stores = tuple(store for store in node.stores if store.buffer.name in needed)
        return dataclasses.replace(node, stores=stores, store_rows=node.store_rows and node.rows.buffer.name in needed,
                                   norm=kind_of(node.norm).prune(node.norm, needed))

    def plan(self, node, target):
        return plan_norm_epilogue(node, target)

    def render(self, node, plan, name, parameters):
        return render_norm_epilogue(node, plan, name, parameters)


register_kind(MatMulNormEpilogueKind())
