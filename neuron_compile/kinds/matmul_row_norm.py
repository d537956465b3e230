"""Kernel kinds: the fusion rule that gives a matmul a row-norm prologue (``ir.MatMul`` -> ``ir.NormedMatMul``).

Input: a whole row-reduction kernel with a row epilogue (an RMSNorm: the mean of squares of each row, then
``x * rsqrt(mean + eps) * weight`` over the row) and a whole matmul kernel multiplying one of its row stores as
its left operand. Output: a reason they may not fuse, or the matmul that computes that operand itself from the
norm's inputs, per row block (kinds/normed_matmul.py plans and renders it; passes/row_norm_operands.py drives it).
The rule: the norm is a mean or a sum (``NORM_OPS``, an RMSNorm's), its rows are the matmul's rows of K (one
reduced dim, the last), the matmul reads the row store only as ``a`` and with the store's own index map, is no
implicit GEMM, and the norm draws no random numbers (several matmuls may each recompute it).
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.kind_registry import kind_of

# The reductions a matmul recomputes on chip: an RMSNorm's mean of squares (one ScalarE pass giving its sum, then
# two multiplies). A layer norm's variance (two passes, then x - mean, the scale and the shift on VectorE) made the
# diffusers Flux mid size slower inside its projections: 1.99992x -> 2.19x of its roofline with every reader
# recomputing it, 2.03x with only the norms one matmul reads (stop 33).
NORM_OPS = ("mean", "sum")


def _as_rows(layout: ir.Layout) -> ir.Layout | None:
    """``layout`` over (*kept, K) as one over (1, M, K), M the kept dims' product: each kept dim's stride is the
    next one's times its size (contiguous rows, or stride 0 throughout: a weight), size-1 dims aside (their stride
    is never used); None when they do not merge."""
    kept = [(size, stride) for size, stride in zip(layout.shape[:-1], layout.strides[:-1]) if size != 1]
    if any(outer[1] != inner[1] * inner[0] for outer, inner in zip(kept, kept[1:])):
        return None
    row_stride = kept[-1][1] if kept else 0
    rows = math.prod(size for size, _ in kept)
    return ir.Layout((1, rows, layout.shape[-1]), (0, row_stride, layout.strides[-1]), layout.offset)


def _indexes_without_loads(expr: ir.Expr) -> bool:
    """Whether ``expr`` has a leaf indexing the domain that is not a Load (an iota, a random draw); each shared
    subexpression is visited once."""
    seen, pending = set(), [expr]
    while pending:
        node = pending.pop()
        if isinstance(node, (ir.Iota, ir.RandomKeep)):
            return True
        if isinstance(node, ir.Op) and node not in seen:
            seen.add(node)
            pending.extend(node.args)
    return False


def in_matmul_domain(norm: ir.Reduction, matmul: ir.MatMul) -> ir.Reduction:
    """``norm`` over the matmul's domain with K for N (``over_matmul_rows``)."""
    return over_matmul_rows(norm, (*matmul.domain[:-1], matmul.k))


def over_matmul_rows(norm: ir.Reduction, domain: tuple[int, ...]) -> ir.Reduction:
    """``norm`` over ``domain``, a matmul's (1, M, row): mm's domain is (1, M, N) while the norm's rows may have
    several kept dims (batch and sequence: a linear flattens them into M), merged into M when every layout of the
    norm allows it (``_as_rows``); unchanged otherwise (the rules then decline)."""
    rows = (1, math.prod(domain[:-1]), domain[-1])
    if norm.domain == domain or domain[:-2] != (1,) or norm.reduce_dims != (
            len(norm.domain) - 1,) or (1, math.prod(norm.domain[:-1]), norm.domain[-1]) != rows:
        return norm
    if any(_indexes_without_loads(expr) for expr in kind_of(norm).exprs(norm)):
        return norm  # an iota's index map would need restating too: left as it is, the rule declines
    layouts = [load.layout for expr in kind_of(norm).exprs(norm) for load in ir.loads_of(expr)]
    if any(_as_rows(layout) is None for layout in layouts + [store.layout for store in kind_of(norm).stores(norm)]):
        return norm

    def restated(expr: ir.Expr) -> ir.Expr:
        return ir.map_leaves(expr, lambda leaf: ir.Load(leaf.buffer, _as_rows(leaf.layout), leaf.dtype)
                             if isinstance(leaf, ir.Load) else leaf)

    def stores(stores: tuple[ir.Store, ...]) -> tuple[ir.Store, ...]:
        return tuple(ir.Store(store.buffer, restated(store.expr), _as_rows(store.layout)) for store in stores)

    return dataclasses.replace(norm, domain=rows, reduce_dims=(2,), prologue=restated(norm.prologue),
                               stores=stores(norm.stores), row_stores=stores(norm.row_stores))


def row_operand_reason(norm, matmul: ir.MatMul) -> str | None:
    """None if ``matmul`` may compute its left operand, a row store of the kernel ``norm``, itself."""
    if not isinstance(norm, ir.Reduction):
        return f"a matmul computes only a row reduction's row store on chip, not a {type(norm).__name__}'s"
    norm = in_matmul_domain(norm, matmul)
    if norm.op not in NORM_OPS:
        return (f"{norm.name} is a {norm.op}: a layer norm's two passes over the row cost every matmul recomputing "
                "them more vector work than their round trip through HBM saves")
    stores = {store.buffer.name: store for store in norm.row_stores}
    if matmul.a.buffer not in stores:
        return f"{matmul.name}'s left operand is not one of {norm.name}'s row stores"
    if matmul.shifts:
        return "an implicit GEMM (a convolution) loads its operand once per term"
    rank = len(norm.domain)
    if norm.reduce_dims != (rank - 1,) or norm.domain != (*matmul.domain[:-1], matmul.k):
        return (f"{norm.name}'s rows (domain {list(norm.domain)} over {list(norm.reduce_dims)}) are not "
                f"{matmul.name}'s rows of K={matmul.k}")
    if not ir.same_index_map(matmul.a.layout, stores[matmul.a.buffer].layout):
        return f"{matmul.a.buffer} is read through a view that changes the index map"
    others = [matmul.b, matmul.b2] + [load for store in matmul.stores for load in ir.loads_of(store.expr)]
    written = {store.buffer.name for store in kind_of(norm).stores(norm)}
    beside = sorted({load.buffer for load in others if load is not None and load.buffer in written})
    if beside:
        return f"{matmul.name} reads {', '.join(beside)} of {norm.name}'s beside its left operand"
    if any(ir.draws_random(expr) for expr in kind_of(norm).exprs(norm)):
        return f"{norm.name} draws random numbers, which every matmul computing it would draw again"
    return None


def merge_row_operand(norm: ir.Reduction, matmul: ir.MatMul, kept: set[str]) -> ir.NormedMatMul:
    """``matmul`` with ``norm`` as its prologue; of ``norm``'s outputs only those named in ``kept`` stay stored."""
    norm = in_matmul_domain(norm, matmul)
    operand = next(store.expr for store in norm.row_stores if store.buffer.name == matmul.a.buffer)
    return ir.NormedMatMul(matmul.name, matmul.domain, matmul.k, matmul.a, matmul.b, matmul.stores,
                           kind_of(norm).prune(norm, kept), operand, matmul.b2)
