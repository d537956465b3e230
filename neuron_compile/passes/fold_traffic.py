"""Fusion stage, after grouping: the HBM bytes kernels move by their tile plans, which the norm folds weigh.

Input: whole fused kernels and the target. Output: ``planned_bytes``, one kernel's HBM traffic as its plan makes
it (every distinct element its expressions load, once; every store, once; its operands as its kind's plan reads
them, ``KernelKind.operand_bytes``: a resident matmul streams b past each row group of a^T), and
``traffic_reason``, why kernels that would replace others are refused: they move more bytes.

The folds after grouping (a row norm computed inside the matmuls that multiply its rows, passes/row_norm_operands.py;
a row norm in the epilogue of the matmul writing its rows, passes/norm_epilogues.py) save the norm's round trip
through HBM, but the norm's whole-row tiles then share SBUF with a^T: where they leave room for fewer rows of
a^T than the plain matmul's plan keeps, b crosses HBM once more per row group. A cost per fold, not a cap on the
row's width: a 2560-wide norm wins in a 256-row prefill; a projection with a long K over many rows may lose.
Each load counts once, as the plans read them when the row fits SBUF whole (the folds need whole rows).
"""

from __future__ import annotations

import math

from neuron_compile import ir, kinds
from neuron_compile.kind_registry import load_bytes
from neuron_compile.passes.tiling import plan_kernel

MB = 1e6


def planned_bytes(node: ir.Node, target) -> int:
    """HBM bytes ``node`` moves as planned for ``target`` (module docstring)."""
    kind = kinds.kind_of(node)
    loaded = dict.fromkeys(load for expr in kind.exprs(node) for load in ir.loads_of(expr))
    stored = sum(math.prod(store.layout.shape) * ir.ITEMSIZE.get(store.buffer.dtype, 4) for store in kind.stores(node))
    return kind.operand_bytes(node, plan_kernel(node, target)) + sum(map(load_bytes, loaded)) + stored


def traffic_reason(replaced: list[ir.Node], merged: list[ir.Node], target) -> str | None:
    """None if the kernels ``merged`` move no more HBM bytes than the kernels ``replaced`` they stand for, else
    both figures."""
    before = sum(planned_bytes(node, target) for node in replaced)
    after = sum(planned_bytes(node, target) for node in merged)
    if after <= before:
        return None
    return (f"{', '.join(node.name for node in merged)} would move {after / MB:.2f} MB through HBM fused, "
            f"{before / MB:.2f} MB apart (the norm's rows leave room for fewer rows of a^T: b streams past more row "
            "groups than the round trip saves)")
