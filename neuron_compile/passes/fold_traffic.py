"""Fusion stage, after grouping: the time kernels' plans take at their roofline, which the norm folds weigh.

Input: whole fused kernels and the target. Output: ``planned_bytes``, one kernel's HBM traffic as its plan makes
it (every distinct element its expressions load, once; every store, once; its operands as its kind's plan reads
them, ``KernelKind.operand_bytes``: a resident matmul streams b past each row group of a^T); ``planned_seconds``,
the longer of that traffic at the target's DMA bandwidth and the kind's TensorE work at its peak
(``KernelKind.tensor_seconds``); and ``traffic_reason``, why kernels that would replace others are refused: their
planned time is longer.

The folds after grouping (a row norm computed inside the matmuls that multiply its rows, passes/row_norm_operands.py;
a row norm in the epilogue of the matmul writing them, passes/norm_epilogues.py) save the norm's round trip
through HBM and a kernel on the tail, but the norm's whole-row tiles then share SBUF with a^T: where they leave
room for fewer rows of a^T than the plain matmul's plan keeps, b crosses HBM once more per row group. A cost per
fold, not a cap on the row's width: a 2560-wide norm wins in a 256-row prefill; a down projection with a long K
whose extra passes over b outlast its TensorE work loses. Bytes alone would refuse folds whose extra traffic hides
under TensorE (Gemma3's down projection over 1024 rows: 66.1 MB fused against 62.9 apart, 1622.8 us for the layer
apart against 1607.7 fused). Each load counts once, as the plans read them when the row fits SBUF whole.
"""

from __future__ import annotations

import math

from neuron_compile import ir, kinds
from neuron_compile.kind_registry import load_bytes
from neuron_compile.passes.tiling import TilingError, plan_kernel

MB = 1e6


def planned_bytes(node: ir.Node, target) -> int:
    """HBM bytes ``node`` moves as planned for ``target`` (module docstring)."""
    kind = kinds.kind_of(node)
    loaded = dict.fromkeys(load for expr in kind.exprs(node) for load in ir.loads_of(expr))
    stored = sum(math.prod(store.layout.shape) * ir.ITEMSIZE.get(store.buffer.dtype, 4) for store in kind.stores(node))
    return kind.operand_bytes(node, plan_kernel(node, target)) + sum(map(load_bytes, loaded)) + stored


def planned_seconds(node: ir.Node, target) -> float:
    """``node``'s roofline as planned: its planned bytes over the DMA bandwidth, or its TensorE work if longer."""
    return max(planned_bytes(node, target) / target.dma_bytes_per_s, kinds.kind_of(node).tensor_seconds(node, target))


def traffic_reason(replaced: list[ir.Node], merged: list[ir.Node], target) -> str | None:
    """None if the kernels ``merged`` take no longer at their planned rooflines than the kernels ``replaced`` they
    stand for, else both figures. The merged kernels fit the target (the folds ask that first); a replaced kernel
    that does not tile there (nothing checked it) cannot win against them."""
    try:
        before = sum(planned_seconds(node, target) for node in replaced)
    except TilingError:
        return None
    after = sum(planned_seconds(node, target) for node in merged)
    if after <= before:
        return None
    moved = sum(planned_bytes(node, target) for node in merged), sum(planned_bytes(node, target) for node in replaced)
    return (f"{', '.join(node.name for node in merged)} would take {after * 1e6:.1f} us fused at its planned roofline "
            f"({moved[0] / MB:.2f} MB through HBM), {before * 1e6:.1f} us apart ({moved[1] / MB:.2f} MB): the norm's "
            "rows leave room for fewer rows of a^T, and b's extra passes outlast the round trip saved")
