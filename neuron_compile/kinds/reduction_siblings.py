"""Kernel kind ``reduction``, fusion stage: a variance and a mean of the same rows in one kernel (horizontal fusion).

A layer norm lowers to two reductions of one prologue: the variance (whose epilogue is ``rstd = rsqrt(var +
eps)``) and the mean, whose row epilogue reads ``rstd`` back and normalizes the row, ``(x - mean) * rstd``. The
variance's first pass is that same mean: two kernels loaded every row twice and reduced it twice. The variance
kernel takes the mean kernel in (``fuse_siblings`` in passes/fusion.py): the mean is its ``Result(1)``, the mean
kernel's reads of the variance's outputs become the variance's epilogue expressions, and the variance's outputs
reach HBM only where something else reads them (a training graph saves rstd for the backward).

Input: two reduction nodes, the earlier one's outputs read outside the pair. Output: a reason they stay apart
(None when they may pair), or the merged node.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir
from neuron_compile.kinds.fusion_rules import stored_exprs

MEAN = ir.Result(1)  # a paired variance's mean


def sibling_reason(first: ir.Reduction, second: ir.Reduction, outside: set[str]) -> str | None:
    """None if ``first`` is a variance and ``second`` the mean of the same prologue over the same dims, reading
    ``first``'s outputs (if at all) element for element along its rows."""
    if not (isinstance(first, ir.Reduction) and isinstance(second, ir.Reduction)):
        return "sibling fusion pairs two reductions"
    if (first.op, second.op) != ("var", "mean"):
        return "only a variance takes the mean of its rows in"
    if first.row_stores or MEAN in _results(first) or MEAN in _results(second):
        return "the variance already has a row epilogue or a paired mean"
    if (first.domain, first.reduce_dims, first.prologue) != (second.domain, second.reduce_dims, second.prologue):
        return "the reductions do not share their prologue, domain and reduced dims"
    written = stored_exprs(first.stores)
    for load in _loads(second):
        if load.buffer in written and not ir.same_index_map(load.layout, written[load.buffer].layout):
            return f"{load.buffer} is read through a view that changes the index map"
    return None


def merge_sibling(first: ir.Reduction, second: ir.Reduction, outside: set[str]) -> ir.Reduction:
    """The variance ``first`` computing ``second`` too: ``second``'s stores and row stores over ``Result(1)`` (the
    mean), its reads of ``first``'s outputs replaced by their expressions; ``first``'s stores kept where
    ``outside`` needs them."""
    written = stored_exprs(first.stores)

    def restated(expr: ir.Expr) -> ir.Expr:
        as_mean = ir.map_leaves(expr, lambda leaf: MEAN if leaf == ir.Result() else leaf)
        return ir.map_leaves(as_mean, lambda leaf: written[leaf.buffer].expr
                             if isinstance(leaf, ir.Load) and leaf.buffer in written else leaf)

    def mapped(stores: tuple[ir.Store, ...]) -> tuple[ir.Store, ...]:
        return tuple(dataclasses.replace(store, expr=restated(store.expr)) for store in stores)

    kept = tuple(store for store in first.stores if store.buffer.name in outside)
    return dataclasses.replace(first, name=second.name, stores=kept + mapped(second.stores),
                               row_stores=mapped(second.row_stores))


def reads_mean(node: ir.Reduction) -> bool:
    """Whether a variance's stores read the mean of its rows (``Result(1)``)."""
    return MEAN in _results(node)


def _loads(node: ir.Reduction) -> list[ir.Load]:
    return [load for store in node.stores + node.row_stores for load in ir.loads_of(store.expr)]


def _results(node: ir.Reduction) -> set[ir.Result]:
    """The results the node's stores read."""
    found: set[ir.Result] = set()

    def note(leaf):
        if isinstance(leaf, ir.Result):
            found.add(leaf)
        return leaf

    for store in node.stores + node.row_stores:
        ir.map_leaves(store.expr, note)
    return found
