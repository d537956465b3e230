"""Kernel kinds: the fusion rule that gives a matmul a row-norm epilogue (``ir.MatMul`` -> ``ir.MatMulNormEpilogue``).

Input: a whole matmul kernel and a whole row-reduction kernel after it that reads one of the matmul's stores (a
decoder's final RMSNorm of ``h + down(...)``). Output: a reason they may not fuse, or the matmul that norms those
rows itself, each row block once its last N tile is done (kinds/matmul_norm_epilogue.py plans and renders it;
passes/norm_epilogues.py drives it). The rule: the norm is a mean or a sum of squares (an RMSNorm's), its rows
are the matmul's whole rows of N (one reduced dim, the last), it reads exactly one of the matmul's stores and that
one with the store's own index map, the matmul is plain (no paired product, no implicit GEMM), and the norm draws
no random numbers.
"""

from __future__ import annotations

from neuron_compile import ir
from neuron_compile.kind_registry import kind_of
from neuron_compile.kinds.matmul_row_norm import NORM_OPS, over_matmul_rows


def _loads_of(norm: ir.Reduction) -> list[ir.Load]:
    return [load for expr in kind_of(norm).exprs(norm) for load in ir.loads_of(expr)]


def norm_epilogue_reason(matmul: ir.MatMul, norm) -> str | None:
    """None if ``norm``, a later kernel, may run in ``matmul``'s epilogue on the rows it keeps on chip."""
    if not isinstance(norm, ir.Reduction):
        return f"a matmul's norm epilogue is a row reduction, not a {type(norm).__name__}"
    if matmul.b2 is not None or matmul.shifts:
        return f"{matmul.name} is a paired matmul or an implicit GEMM, whose N loop is not the rows' one"
    norm = over_matmul_rows(norm, matmul.domain)
    if norm.op not in NORM_OPS or not ir.is_square(norm.prologue):
        what = "squares" if ir.is_square(norm.prologue) else "other values than squares"
        return f"{norm.name} is a {norm.op} of {what}, not an RMSNorm's mean of squares"
    rank = len(norm.domain)
    if norm.reduce_dims != (rank - 1,) or norm.domain != matmul.domain:
        return (f"{norm.name}'s rows (domain {list(norm.domain)} over {list(norm.reduce_dims)}) are not "
                f"{matmul.name}'s whole rows of N={matmul.domain[-1]}")
    written = {store.buffer.name: store for store in matmul.stores}
    read = sorted({load.buffer for load in _loads_of(norm)} & written.keys())
    if len(read) != 1:
        return f"{norm.name} reads {len(read)} of {matmul.name}'s stores, not one"
    if any(load.buffer == read[0] and not ir.same_index_map(load.layout, written[read[0]].layout)
           for load in _loads_of(norm)):
        return f"{read[0]} is read through a view that changes the index map"
    if any(ir.draws_random(expr) for expr in kind_of(norm).exprs(norm)):
        return f"{norm.name} draws random numbers"
    return None


def merge_norm_epilogue(matmul: ir.MatMul, norm: ir.Reduction, store_rows: bool) -> ir.MatMulNormEpilogue:
    """``matmul`` norming the rows ``norm`` reads; ``store_rows``: they still go to HBM for another reader."""
    norm = over_matmul_rows(norm, matmul.domain)
    read = {load.buffer for load in _loads_of(norm)}
    rows = next(store for store in matmul.stores if store.buffer.name in read)
    others = tuple(store for store in matmul.stores if store is not rows)
    return ir.MatMulNormEpilogue(matmul.name, matmul.domain, matmul.k, matmul.a, matmul.b, others, rows, store_rows,
                                 norm)
