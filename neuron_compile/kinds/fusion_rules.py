"""Kernel kinds: the fusion rules several kinds share (Inductor's "matching index" rule and prologue inlining).

Input: a producer group, a consumer node and the kind that answers for the group. Output: a reason they may not
fuse (None when they may), or the merged node. The driver (passes/fusion.py) asks each kind, which uses these.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir
from neuron_compile.kind_registry import KernelKind, kind_of, loads


def stored_exprs(stores) -> dict[str, ir.Store]:
    return {store.buffer.name: store for store in stores}


def matching_index_reason(kind: KernelKind, group, consumer) -> str | None:
    """None if every store of the elementwise ``consumer`` lies in ``group``'s domain and it reads each of the
    group's buffers with the index map the group writes it with."""
    if any(kind.restate(store.layout, group) is None for store in consumer.stores):
        return f"domains differ: {list(consumer.domain)} vs {list(group.domain)}"
    stores = stored_exprs(group.stores)
    for load in loads(consumer):
        restated = kind.restate(load.layout, group) if load.buffer in stores else None
        if load.buffer in stores and (restated is None or not ir.same_index_map(restated, stores[load.buffer].layout)):
            return f"{load.buffer} is read through a view that changes the index map"
    return None


def inline_into_group(kind: KernelKind, expr: ir.Expr, stores: dict[str, ir.Store], group) -> ir.Expr:
    """``expr`` with loads of the group's stored buffers replaced by their expressions, and other loads restated
    in the group's domain."""

    def leaf(node):
        if isinstance(node, ir.Result):
            return node
        if node.buffer in stores:
            return stores[node.buffer].expr
        return dataclasses.replace(node, layout=kind.restate(node.layout, group))

    return ir.map_leaves(expr, leaf)


def merge_as_epilogue(kind: KernelKind, group, consumer):
    """``consumer``'s stores appended to ``group``'s, its reads of the group inlined."""
    stores = stored_exprs(kind.stores(group))
    new_stores = tuple(
        ir.Store(store.buffer, inline_into_group(kind, store.expr, stores, group), kind.restate(store.layout, group))
        for store in consumer.stores
    )
    return dataclasses.replace(group, stores=group.stores + new_stores)


def prologue_reason(producer, consumer, outside: set[str]) -> str | None:
    """None if the pointwise ``producer`` group may be inlined as ``consumer``'s prologue (a reduction, softmax or
    scan reads it over its own domain, and nothing else needs the producer's outputs)."""
    if not kind_of(producer).elementwise:
        return f"a {type(consumer).__name__} prologue must be pointwise, not {type(producer).__name__}"
    if producer.domain != consumer.domain:
        return f"prologue domain {list(producer.domain)} differs from {list(consumer.domain)}"
    if outside:
        return f"the prologue's outputs {sorted(outside)} are needed outside the kernel"
    stores = stored_exprs(producer.stores)
    for load in ir.loads_of(consumer.prologue):
        if load.buffer in stores and not ir.same_index_map(load.layout, stores[load.buffer].layout):
            return f"{load.buffer} is read through a view that changes the index map"
    if any(load.buffer in stores for store in consumer.stores for load in ir.loads_of(store.expr)):
        return "the epilogue reads the prologue's output"
    return None


def merge_as_prologue(producer, consumer):
    """``consumer`` with the producer's expressions inlined into its prologue."""
    stores = stored_exprs(kind_of(producer).stores(producer))

    def inline_producer(leaf):
        return stores[leaf.buffer].expr if isinstance(leaf, ir.Load) and leaf.buffer in stores else leaf

    return dataclasses.replace(consumer, prologue=ir.map_leaves(consumer.prologue, inline_producer))


class MatchingIndexEpilogue(KernelKind):
    """A kind whose elementwise consumers join it when they read it with its own index map (Inductor's rule)."""

    def epilogue_reason(self, group, consumer, outside):
        return matching_index_reason(self, group, consumer)

    def merge_epilogue(self, group, consumer):
        return merge_as_epilogue(self, group, consumer)


class ProloguedKind(MatchingIndexEpilogue):
    """A kind with a prologue expression over its domain (reduction, row normalize, scan): it absorbs pointwise
    producers and takes pointwise consumers over its domain as epilogues."""

    takes_prologue = True

    def exprs(self, node) -> list[ir.Expr]:
        return [store.expr for store in node.stores] + [node.prologue]

    def map_exprs(self, node, fn):
        node = super().map_exprs(node, fn)
        return dataclasses.replace(node, prologue=fn(node.prologue))

    def describe_head(self, node):
        """A row along one dim (row normalize, scan); the reduction's several dims say so themselves."""
        return f" {node.op} over {node.dim}\n  prologue: {node.prologue}"

    def prologue_reason(self, producer, consumer, outside):
        return prologue_reason(producer, consumer, outside)

    def merge_prologue(self, producer, consumer):
        return merge_as_prologue(producer, consumer)
