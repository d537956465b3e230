"""Codegen helper for a row kernel's row epilogue when each partition holds several short rows: stage "render".

A row reduction over short rows (a q / k norm's 128-element heads) takes ``k`` rows per partition
(kinds/reduction.py, ``TilePlan.grouped_rows``): its results are a [P, k] tile, one value per row, not a (P, 1)
column a tensor_scalar could take as its operand. Its row epilogue (rms norm's ``x * rsqrt(mean + eps) * w``)
then reads them so:

* the epilogue's values constant along each row (the reduced value and the math on it) are computed once per row,
  on [P, k] tiles (``row_values``), and read through a view that repeats each along its row (a step-0 entry);
* a row times such a value (``x * rsqrt(...)``) is ``k`` ScalarE activations, each scaling one row by its (P, 1)
  column of the results (``scale=``), instead of a VectorE tensor_tensor against the view (two cycles per element):
  the engine that a short-row kernel leaves idle besides the square.

Input: the row epilogue's expressions, the kernel's row scope ([P, k x row]) and results scope ([P, k]). Output:
the row scope's memo filled with those values and products, the instructions appended to ``lines``.
"""

from __future__ import annotations

from neuron_compile import ir
from neuron_compile.codegen.expressions import Ref, TileScope, emit, unwidened


def row_constant_ops(exprs: list[ir.Expr], reduce_dims) -> list[ir.Op]:
    """The largest Op subexpressions of ``exprs`` whose value is the same along the reduced dims (built from the
    reduced value, numbers and loads with stride 0 along the row), in order of first appearance."""
    constant: dict[ir.Expr, bool] = {}

    def is_constant(expr) -> bool:
        if expr not in constant:
            if isinstance(expr, ir.Load):
                constant[expr] = all(expr.layout.strides[dim] == 0 for dim in reduce_dims)
            elif isinstance(expr, ir.Op):
                constant[expr] = all([is_constant(arg) for arg in expr.args])
            else:
                constant[expr] = isinstance(expr, (ir.Result, ir.Scalar))
        return constant[expr]

    found: dict[ir.Op, None] = {}

    def visit(expr) -> None:
        if isinstance(expr, ir.Op) and is_constant(expr):
            found[expr] = None
        elif isinstance(expr, ir.Op):
            for arg in expr.args:
                visit(arg)

    for expr in exprs:
        visit(expr)
    return list(found)


def row_values(exprs: list[ir.Expr], reduce_dims, row: TileScope, results: TileScope, per_partition: int,
               lines: list[str]) -> None:
    """Fill ``row``'s memo (and its ``Result``) for a row epilogue over ``per_partition`` rows per partition: the
    values constant along each row computed on ``results``' [P, k] tiles and read through a view repeating each
    along its row; products of a row and such a value as ScalarE activations scaled per row."""
    width = row.free // per_partition

    def along_rows(ref: Ref) -> Ref:
        if ref.tile is None:
            return ref  # a number
        view = f"{ref.tile}.ap([[{results.free}, rows], [1, {per_partition}], [0, {width}]], offset=0)"
        return Ref(tile=ref.tile, dtype=ref.dtype, view=view)

    row.results = (along_rows(results.results[0]),)
    per_row = {value: emit(value, results, lines) for value in row_constant_ops(exprs, reduce_dims)}
    for value, ref in per_row.items():
        row.memo[value] = along_rows(ref)
    for product, (scaled, ref) in _row_products(exprs, per_row).items():
        out = _scaled_rows(scaled, ref, row, per_partition, lines)
        if out is not None:
            row.memo[product] = out


def _row_products(exprs: list[ir.Expr], per_row: dict[ir.Op, Ref]) -> dict[ir.Op, tuple[ir.Expr, Ref]]:
    """``mul(x, v)`` (or ``mul(v, x)``) subexpressions with ``v`` a per-row fp32 tile: product -> (x, v's tile)."""
    found: dict[ir.Op, tuple[ir.Expr, Ref]] = {}

    def visit(expr) -> None:
        if not isinstance(expr, ir.Op) or expr in per_row or expr in found:
            return
        if expr.op == "mul":
            for scaled, factor in (expr.args, expr.args[::-1]):
                ref = per_row.get(factor)
                if ref is not None and ref.tile is not None and ref.dtype == "float32" and scaled not in per_row:
                    found[expr] = (scaled, ref)
                    break
        for arg in expr.args:
            visit(arg)

    for expr in exprs:
        visit(expr)
    return found


def _scaled_rows(scaled: ir.Expr, factor: Ref, row: TileScope, per_partition: int, lines: list[str]) -> Ref | None:
    """``scaled`` times one value per row: per row ``j`` a ScalarE copy of its columns with ``scale`` the (P, 1)
    column ``j`` of ``factor`` (activation scales must be fp32 vectors). None (nothing emitted) unless ``scaled``
    is a whole tile."""
    value = emit(unwidened(scaled), row, lines)  # ScalarE computes in fp32 from a bf16 tile: no widening copy
    if value.tile is None or value.vector or value.view is not None:
        return None
    width = row.free // per_partition
    out = row.tile(stem="scaled_rows")
    for j in range(per_partition):
        columns = f"[0:rows, {j * width}:{(j + 1) * width}]"
        lines.append(f"nisa.activation(dst={out}{columns}, op=nl.copy, data={value.tile}{columns}, "
                     f"scale={factor.tile}[0:rows, {j}:{j + 1}])")
    row.balance.note("scalar")
    return Ref(tile=out)
