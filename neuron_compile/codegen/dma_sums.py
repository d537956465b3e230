"""Codegen stage: a stored sum added by the DMA engines on its way to HBM (``nisa.dma_compute``).

Input: a tile scope's stores (``ir.Store``), the scope, and for the choice, the tile's engine loads as the engine
balance planned them. Output: for a store of ``cast(add(a, b))`` whose operands are SBUF tiles, one
``nisa.dma_compute(dst=<HBM>, srcs=[a, b])`` in place of the add instruction and the store's dma_copy.

Why it is the same value: the DMA engines cast every source to fp32, add in fp32 and cast the sum to the
destination's dtype (SDK ``nki.isa.dma_compute``), which is what an fp32 add followed by the store's rounding
computes. Why only sometimes: the DMA then reads both operands (6 bytes per element for an fp32 and a bf16 one)
where the store moved the result (2), so it pays only where a compute engine, not the DMA, bounds the tile:
``tile_time_ns`` weighs a tile's busiest engine against its transfers as the cost model charges them, and the
kernel takes the cheaper of its two plans (AdamW's update kernels are GpSimd / VectorE-bound, their final add
moves off the ALU).
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir, op_table
from neuron_compile.codegen.expressions import TileScope, emit, unwidened
from neuron_compile.hardware import Target
from neuron_compile.runtime.simulator.cost import dma_transfer_time
from neuron_compile.runtime.simulator.trace import InstructionRecord, OperandInfo

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def summed_operands(store: ir.Store) -> tuple[ir.Expr, ir.Expr] | None:
    """(a, b) when ``store`` writes ``cast[dtype](add(a, b))`` to a float buffer of that dtype, or ``add(a, b)``
    (computed in fp32) to an fp32 buffer; else None."""
    total, dtype = _stored_sum(store.expr), store.buffer.dtype
    if total is None or dtype not in FLOAT_DTYPES:
        return None
    if total is store.expr and dtype != "float32":
        return None
    if total is not store.expr and store.expr.dtype != dtype:
        return None
    return total.args[0], total.args[1]


def _stored_sum(expr: ir.Expr) -> ir.Op | None:
    """The add a store's value is, directly or through its one cast."""
    if isinstance(expr, ir.Op) and expr.dtype is not None and op_table.spec(expr.op).form == "copy":
        expr = expr.args[0]
    return expr if isinstance(expr, ir.Op) and expr.op == "add" else None


def read_on_chip(stores: tuple[ir.Store, ...]) -> set:
    """The expressions the tile's instructions read: every subexpression of the stores' values, but a summed
    store's value and its sum only where something else reads them (then the ALU computes the sum anyway)."""
    seen: set = set()
    pending = []
    for store in stores:
        operands = summed_operands(store)
        pending += list(operands) if operands is not None else [store.expr]
    while pending:
        expr = pending.pop()
        if expr not in seen:
            seen.add(expr)
            pending += [arg for arg in getattr(expr, "args", ()) if isinstance(arg, ir.Op | ir.Load)]
    return seen


@dataclasses.dataclass
class DmaSums:
    """The stores of one tile whose sums the DMA engines add (not those whose sum the tile reads on chip, which
    ``read`` holds: ``read_on_chip``): each one's bytes read per element, by buffer name."""

    read: set
    read_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def emit(self, store: ir.Store, dst: str, scope: TileScope, lines: list[str]) -> bool:
        """Append the dma_compute storing ``store`` to ``dst`` (an HBM access pattern's text) and return True;
        False (nothing emitted but the operands, which the plain path reuses) when it does not apply."""
        operands = summed_operands(store)
        if operands is None or store.expr in self.read or _stored_sum(store.expr) in self.read:
            return False
        refs = [emit(unwidened(arg), scope, lines) for arg in operands]  # the DMA widens bf16 itself, exactly
        if not all(_plain_tile(ref, scope) for ref in refs):
            return False
        sources = ", ".join(scope.ref_text(ref) for ref in refs)
        lines.append(f"nisa.dma_compute(dst={dst}, srcs=[{sources}], scales=[1.0, 1.0], reduce_op=nl.add)")
        self.read_bytes[store.buffer.name] = sum(ir.ITEMSIZE[ref.dtype] for ref in refs)
        return True


def _plain_tile(ref, scope: TileScope) -> bool:
    """A full SBUF tile of floats read as it is (the DMA cannot read PSUM, a row vector or a broadcast view)."""
    return (ref.tile is not None and not ref.vector and ref.view is None and ref.dtype in FLOAT_DTYPES
            and ref.tile not in scope.allocator.psum_tiles)


def tile_time_ns(engine_loads: dict[str, float], transfer_bytes: list[int], partitions: int, columns: int,
                 target: Target) -> float:
    """One [partitions, columns] tile's time as the busiest of its compute engines (``engine_loads``: VectorE cycles
    per element, codegen/engine_balance.py) and the DMA pool (one transfer per entry of ``transfer_bytes``, bytes
    per element, charged by the cost model's own formula)."""
    compute_ns = max(engine_loads.values(), default=0.0) * columns / target.vector_ghz
    dma_ns = 0.0
    for itemsize in transfer_bytes:  # a DMA's cost depends on its bytes, not on its dtype's name
        shape = (partitions, columns)
        on_chip = OperandInfo("dst", "sbuf", shape, "uint8", itemsize, partitions, columns, itemsize)
        hbm = OperandInfo("src", "hbm", shape, "uint8", itemsize, partitions, columns, itemsize)
        dma_ns += dma_transfer_time(InstructionRecord("dma_copy", "dma", on_chip, (hbm,)), target).pool_ns
    return max(compute_ns, dma_ns)
