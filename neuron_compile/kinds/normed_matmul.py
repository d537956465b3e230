"""Kernel kind ``normed_matmul``: a matmul whose left operand is a row norm of rows it loads itself (``ir.NormedMatMul``).

Fusion: made after grouping by passes/row_norm_operands.py under the rule in kinds/matmul_row_norm.py (an RMSNorm's
normed rows, recomputed by every projection reading them, or computed by the first and stored for narrow others);
it takes no further fusion. Tiling: the matmul's resident form (a^T of a row group kept, b streamed past it once per
group), planned in the SBUF left beside the norm's whole-row tiles, with the N tile quickest at its roofline; a norm
row too wide for that raises ``TilingError`` and the kernels stay apart. Codegen: matmul_resident.py.j2 with a row
prologue: per 128-row block, the reduction kind's row body (load the rows, reduce, the row epilogue computing the
operand, and the norm's stores something outside reads), then TensorE transposes of the operand's K chunks, a PSUM
bank of them at a time, into a^T.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, TileAllocator
from neuron_compile.codegen.kernel_text import Patterns, kernel_context, kernel_names, render_template
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, kind_of, register_kind
from neuron_compile.kinds import rotary_epilogue_rule
from neuron_compile.kinds.matmul import operand_traffic, plan_streamed_moving, resident_context, tensor_seconds
from neuron_compile.kinds.reduction import ReductionBody, reduction_body
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.tiles import TilePlan, TilingError

PSUM_BANK_BYTES = 2048  # per partition: the transposes of as many K chunks as fit one bank share one PSUM -> SBUF copy


def as_matmul(node: ir.NormedMatMul) -> ir.MatMul:
    """The matmul part, its left operand read as the buffer the norm used to write."""
    return ir.MatMul(node.name, node.domain, node.k, node.a, node.b, node.stores, node.b2)


def row_plan(node: ir.NormedMatMul, outer: tuple[LoopDim, ...], partition: LoopDim) -> TilePlan:
    """The norm's plan for one row block: the matmul's ``outer`` loops and row tiles (``partition``), the whole
    row of K on the free axis (the norm's domain is the matmul's with K for N, so the dims index both alike)."""
    return TilePlan("reduction", outer, partition, (LoopDim(node.k, len(node.domain) - 1, 1, node.k),), 0)


def row_body(node: ir.NormedMatMul, plan: TilePlan, allocator: TileAllocator) -> ReductionBody:
    """The reduction kind's lines for one row block, the operand computed after the norm's own row stores."""
    return reduction_body(node.norm, plan, allocator, Patterns(plan), operands=((node.operand, node.a.dtype),))


def row_bytes(node: ir.NormedMatMul, target) -> int:
    """SBUF bytes per partition the norm's tiles take: its row body emitted into a scratch allocator."""
    *batch, m, _ = node.domain
    partition = LoopDim(m, len(batch), 1, min(m, target.gemm_stationary_fmax))
    outer = tuple(LoopDim(size, dim, 1, 1) for dim, size in enumerate(batch))
    scratch = TileAllocator(partition.tile)
    body = row_body(node, row_plan(node, outer, partition), scratch)
    return scratch.sbuf_bytes + body.shared_bytes


def plan_normed_matmul(node: ir.NormedMatMul, target, unit: int = 1) -> TilePlan:
    """The resident form beside the norm's rows, its N tiles whole runs of ``unit`` columns (kinds/matmul.py
    ``moving_tile_widths``)."""
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE)
    rows = row_bytes(node, target)
    if rows > budget // 2:
        raise TilingError(f"{node.name}: the norm's row of K={node.k} elements keeps {rows} B per partition on chip, "
                          f"over half the SBUF budget ({budget} B per partition on {target.name})")
    beside = dataclasses.replace(target, sbuf_bytes_per_partition=target.sbuf_bytes_per_partition
                                 - math.ceil(rows / SBUF_SHARE))
    plan = plan_streamed_moving(as_matmul(node), beside, quickest=True, unit=unit)
    if plan is None:
        raise TilingError(f"{node.name}: a^T of one row block and b's tiles do not fit beside the norm's rows "
                          f"({rows} B per partition) on {target.name}, or b needs a DMA transpose it does not have")
    return plan


def transpose_lines(node: ir.NormedMatMul, plan: TilePlan, source: str, allocator: TileAllocator) -> list[str]:
    """The operand's rows (tile ``source``, [rows, K]) into ``stationary[block]`` [K chunk, K chunks, rows]: each K
    chunk transposed on TensorE into PSUM, a bank of chunks copied out at once (the last chunk alone when K is
    ragged), on ScalarE: VectorE and GpSimd have the norm's multiplies and the epilogue (392.6 us for the Llama
    layer against 393.7 with tensor_copy on VectorE)."""
    lines: list[str] = []
    dtype = node.a.dtype
    whole = node.k % plan.k_tile == 0
    per_bank = max(1, PSUM_BANK_BYTES // (plan.partition.tile * ir.ITEMSIZE[dtype])) if whole else 1
    transposed = allocator.take_name("transposed")
    lines += [
        f"for kg in range(0, {plan.k_tiles}, {per_bank}):",
        f"    kn = min({per_bank}, {plan.k_tiles} - kg)",
        f"    {transposed} = nl.ndarray(({plan.k_tile}, {per_bank}, {plan.partition.tile}), "
        f"dtype={NL_DTYPES[dtype]}, buffer=nl.psum)",
        "    for j in range(kn):",
        f"        k0 = (kg + j) * {plan.k_tile}",
        f"        kk = min({plan.k_tile}, {node.k} - k0)",
        f"        nisa.nc_transpose(dst={transposed}[0:kk, j, 0:rows], data={source}[0:rows, k0:k0 + kk])",
    ]
    chunk_rows = plan.k_tile if whole else "kk"
    lines.append(f"    nisa.activation(dst=stationary[block][0:{chunk_rows}, kg:kg + kn, 0:rows], op=nl.copy, "
                 f"data={transposed}[0:{chunk_rows}, 0:kn, 0:rows])")
    return lines


def normed_context(node: ir.NormedMatMul, plan: TilePlan, allocator: TileAllocator, more_epilogue=None) -> dict:
    """The resident form's template entries with the norm's row prologue; ``more_epilogue`` as
    ``resident_context`` takes it."""
    body = row_body(node, row_plan(node, plan.outer, plan.partition), allocator)
    transposes = transpose_lines(node, plan, body.operands[0], allocator)
    row_prologue = list(allocator.lines) + [f"cols = {node.k}"]
    for walk, after in body.passes:
        row_prologue += walk + after
    context = resident_context(as_matmul(node), plan, allocator, loads_a=False, more_epilogue=more_epilogue)
    context.update(row_prologue=row_prologue + transposes, once=body.once)
    return context


def render_normed_matmul(node: ir.NormedMatMul, plan: TilePlan, name: str, parameters: list[str]) -> str:
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    context = normed_context(node, plan, allocator)
    return render_template("matmul_resident.py.j2", **kernel_context(node, plan, name, parameters, **context))


class NormedMatMulKind(KernelKind):
    node_type = ir.NormedMatMul
    name = "normed_matmul"
    refusal = "a normed matmul is made after grouping and takes no fused consumer"
    takes_rotary_epilogue = True

    def stores(self, node):
        return tuple(node.stores) + kind_of(node.norm).stores(node.norm)

    def exprs(self, node):
        return [store.expr for store in node.stores] + kind_of(node.norm).exprs(node.norm) + [node.operand]

    def operand_loads(self, node):
        return [node.b] + ([node.b2] if node.b2 is not None else [])

    def operand_bytes(self, node, plan):
        """b as often as the plan streams it; the rows the operand is computed from are the norm's loads."""
        return operand_traffic(as_matmul(node), plan, loads_a=False)

    def tensor_seconds(self, node, target):
        return tensor_seconds(as_matmul(node), target)

    def map_exprs(self, node, fn):
        stores = tuple(dataclasses.replace(store, expr=fn(store.expr)) for store in node.stores)
        return dataclasses.replace(node, stores=stores, norm=kind_of(node.norm).map_exprs(node.norm, fn),
                                   operand=fn(node.operand))

    def describe(self, node):
        matmul = kind_of(as_matmul(node)).describe(as_matmul(node)).split("\n")
        norm = ["  " + line for line in kind_of(node.norm).describe(node.norm).split("\n")]
        return "\n".join([f"Normed{matmul[0]}", *matmul[1:], f"  a ({node.a.buffer}) computed here: {node.operand}",
                          "  from the rows of", *norm])

    def prune(self, node, needed):
        norm = kind_of(node.norm).prune(node.norm, needed)
        stores = tuple(store for store in node.stores if store.buffer.name in needed)
        return dataclasses.replace(node, stores=stores, norm=norm)

    def rotary_epilogue_reason(self, producer, consumer, norm=None):
        return rotary_epilogue_rule.rotary_epilogue_reason(producer, consumer, norm)

    def merge_rotary_epilogue(self, producer, consumer, store_source, norm=None):
        return rotary_epilogue_rule.merge_rotary_epilogue(producer, consumer, store_source, norm)

    def epilogue_context(self, node, plan, allocator, more_epilogue):
        """The template entries with ``more_epilogue`` in each tile's epilogue (kinds/matmul_rotary.py)."""
        return normed_context(node, plan, allocator, more_epilogue)

    def plan(self, node, target):
        return plan_normed_matmul(node, target)

    def plan_whole_columns(self, node, target, unit):
        """The plan whose N tiles hold whole runs of ``unit`` columns (a rotary epilogue's heads)."""
        return plan_normed_matmul(node, target, unit)

    def render(self, node, plan, name, parameters):
        return render_normed_matmul(node, plan, name, parameters)


register_kind(NormedMatMulKind())
