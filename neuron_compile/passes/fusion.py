"""Fusion stage: IR nodes -> kernel groups, each group one IR node with its producers' math inlined.

Input: the lowered IR nodes in graph order and the names of buffers that must reach HBM (region outputs).
Output: ``FusionResult`` — the fused IR nodes (one per kernel, in a valid launch order) and ``decisions``, the
reason every considered producer/consumer pair was or was not fused (the dump shows them).

Rules (after Inductor's): a pointwise node joins the group that produces one of its operands when it reads
that operand with the producer's own index map ("matching index") over the same domain — a pointwise chain,
a reduction/softmax epilogue, or a matmul epilogue; a pointwise node over a reduction's whole input domain
that reads the reduced value broadcast back becomes a row epilogue (rms norm: the row is still in SBUF); a
reduction, softmax or scan absorbs a pointwise producer group as its prologue when nothing else needs that
group's outputs (a scan's pointwise consumers over its domain become its epilogue, as a softmax's do). No
fusion may create a cycle in the group DAG.
A producer's store is kept only if its buffer is still read outside the group or is a region output.
"""

from __future__ import annotations

import dataclasses

import networkx as nx

from neuron_compile import ir


@dataclasses.dataclass
class FusionResult:
    kernels: list[ir.Node]
    decisions: list[str]


ROW_FUSION_MAX_ROW = 2048  # elements of a reduced row a row epilogue may keep in SBUF (well inside the budget)


def _all_stores(node: ir.Node) -> tuple[ir.Store, ...]:
    return tuple(node.stores) + tuple(getattr(node, "row_stores", ()))


def _writers(node: ir.Node) -> set[str]:
    return {store.buffer.name for store in _all_stores(node)}


def _reads(node: ir.Node) -> set[str]:
    return {load.buffer for load in ir.node_loads(node)}


def _to_group_domain(layout: ir.Layout, group: ir.Node) -> ir.Layout | None:
    """Restate a layout over a consumer's domain in the group's domain coordinates, or None if they differ."""
    if isinstance(group, ir.Reduction):
        domain = group.domain
        out_shape = tuple(size for dim, size in enumerate(domain) if dim not in group.reduce_dims)
        keep_shape = tuple(1 if dim in group.reduce_dims else size for dim, size in enumerate(domain))
        if layout.shape == keep_shape:
            strides = tuple(0 if dim in group.reduce_dims else s for dim, s in enumerate(layout.strides))
            return ir.Layout(domain, strides, layout.offset)
        if layout.shape == out_shape:
            kept = iter(layout.strides)
            strides = tuple(0 if dim in group.reduce_dims else next(kept) for dim in range(len(domain)))
            return ir.Layout(domain, strides, layout.offset)
        return None
    if isinstance(group, ir.MatMul) and len(layout.shape) == 2 and group.domain[0] == 1:
        layout = ir.Layout((1, *layout.shape), (0, *layout.strides), layout.offset)
    return layout if layout.shape == tuple(group.domain) else None


def can_fuse(group: ir.Node, consumer: ir.Node, outside_readers: set[str]) -> str | None:
    """None if ``consumer`` may be merged into ``group`` (its producer), else the reason it may not.

    ``outside_readers`` are the group's buffers that something other than ``consumer`` still reads.
    """
    if isinstance(group, ir.Concat):
        return "a concat kernel takes no epilogue"
    if isinstance(group, ir.Gather):
        return "a gather kernel (indirect DMA) takes no epilogue"
    if isinstance(group, ir.Scatter):
        return "a scatter kernel (indirect DMA) takes no epilogue"
    if isinstance(consumer, ir.Pointwise):
        converted = [_to_group_domain(store.layout, group) for store in consumer.stores]
        if any(layout is None for layout in converted) and isinstance(group, ir.Reduction):
            if consumer.domain == group.domain:
                return _row_fusion_reason(group, consumer)
            reduced = [size for dim, size in enumerate(group.domain) if dim not in group.reduce_dims]
            return (f"domain {list(consumer.domain)} is not the reduction's output {reduced}: the result is "
                    "broadcast back over the reduced dims, which needs the whole row first")
        if getattr(group, "row_stores", ()):
            return "the reduction already has a row epilogue; its reduced outputs take no other epilogue"
        if any(layout is None for layout in converted):
            if isinstance(group, ir.Reduction):
                reduced = [size for dim, size in enumerate(group.domain) if dim not in group.reduce_dims]
                return (f"domain {list(consumer.domain)} is not the reduction's output {reduced}: the result is "
                        "broadcast back over the reduced dims, which needs the whole row first")
            return f"domains differ: {list(consumer.domain)} vs {list(group.domain)}"
        stores = {store.buffer.name: store for store in group.stores}
        for load_ in ir.node_loads(consumer):
            if load_.buffer in stores:
                restated = _to_group_domain(load_.layout, group)
                if restated != stores[load_.buffer].layout:
                    return f"{load_.buffer} is read through a view that changes the index map"
        return None
    if isinstance(consumer, (ir.Reduction, ir.RowNormalize, ir.Scan)):
        if not isinstance(group, ir.Pointwise):
            return f"a {type(consumer).__name__} prologue must be pointwise, not {type(group).__name__}"
        if group.domain != consumer.domain:
            return f"prologue domain {list(group.domain)} differs from {list(consumer.domain)}"
        if outside_readers:
            return f"the prologue's outputs {sorted(outside_readers)} are needed outside the kernel"
        stores = {store.buffer.name: store for store in group.stores}
        for load_ in ir.loads_of(consumer.prologue):
            if load_.buffer in stores and load_.layout != stores[load_.buffer].layout:
                return f"{load_.buffer} is read through a view that changes the index map"
        if any(load_.buffer in stores for store in consumer.stores for load_ in ir.loads_of(store.expr)):
            return "the epilogue reads the prologue's output"
        return None
    return f"{type(consumer).__name__} nodes start their own kernel"


def _ops_of(expr: ir.Expr) -> set[str]:
    if isinstance(expr, ir.Op):
        return {expr.op}.union(*(_ops_of(arg) for arg in expr.args))
    return set()


def _row_fusion_reason(group: ir.Reduction, consumer: ir.Pointwise) -> str | None:
    """None if ``consumer`` (over the reduction's whole domain) may become a row epilogue of ``group``."""
    row = 1
    for dim in group.reduce_dims:
        row *= group.domain[dim]
    if row > ROW_FUSION_MAX_ROW:
        return f"a row epilogue would keep a {row}-element row in SBUF (limit {ROW_FUSION_MAX_ROW})"
    stores = {store.buffer.name: store for store in _all_stores(group)}
    varying = False
    for load_ in ir.node_loads(consumer):
        if load_.buffer in stores:
            if load_.layout != stores[load_.buffer].layout:
                return f"{load_.buffer} is read through a view that changes the index map"
            varying |= any(store is stores[load_.buffer] for store in getattr(group, "row_stores", ()))
        else:
            varying |= any(load_.layout.strides[dim] != 0 for dim in group.reduce_dims)
    if not varying:
        return "the consumer is constant along the row (a broadcast of the reduced value)"
    if "where" in set().union(*(_ops_of(store.expr) for store in consumer.stores)):
        return "where in a row epilogue"
    return None


def _inline(expr: ir.Expr, stores: dict[str, ir.Store], group: ir.Node, result: ir.Expr | None) -> ir.Expr:
    """Replace loads of the group's stored buffers by their expressions; restate other loads in group domain."""

    def leaf(node):
        if isinstance(node, ir.Result):
            return node if result is None else result
        layout = _to_group_domain(node.layout, group)
        if node.buffer in stores:
            return stores[node.buffer].expr
        return dataclasses.replace(node, layout=layout)

    return ir.map_leaves(expr, leaf)


def merge(group: ir.Node, consumer: ir.Node) -> ir.Node:
    """``consumer`` merged into ``group`` (``can_fuse`` said yes)."""
    stores = {store.buffer.name: store for store in _all_stores(group)}
    if isinstance(group, ir.Reduction) and isinstance(consumer, ir.Pointwise) and consumer.domain == group.domain \
            and any(_to_group_domain(store.layout, group) is None for store in consumer.stores):
        inlined = tuple(
            ir.Store(store.buffer, ir.map_leaves(store.expr, lambda leaf: stores[leaf.buffer].expr if isinstance(
                leaf, ir.Load) and leaf.buffer in stores else leaf), store.layout)
            for store in consumer.stores
        )
        return dataclasses.replace(group, row_stores=group.row_stores + inlined)
    if isinstance(consumer, ir.Pointwise):
        new_stores = tuple(
            ir.Store(store.buffer, _inline(store.expr, stores, group, None), _to_group_domain(store.layout, group))
            for store in consumer.stores
        )
        return dataclasses.replace(group, stores=group.stores + new_stores)
    def inline_producer(leaf):
        return stores[leaf.buffer].expr if isinstance(leaf, ir.Load) and leaf.buffer in stores else leaf

    prologue = ir.map_leaves(consumer.prologue, inline_producer)
    return dataclasses.replace(consumer, prologue=prologue)


def _prune(node: ir.Node, needed: set[str]) -> ir.Node | None:
    if isinstance(node, ir.Concat):
        return node if node.output.name in needed else None
    kept = tuple(store for store in node.stores if store.buffer.name in needed)
    if isinstance(node, ir.Reduction):
        rows = tuple(store for store in node.row_stores if store.buffer.name in needed)
        return dataclasses.replace(node, stores=kept, row_stores=rows)
    return dataclasses.replace(node, stores=kept)


def fuse(nodes: list[ir.Node], region_outputs: set[str]) -> FusionResult:
    """Greedy fusion in graph order (see the module docstring)."""
    groups: dict[int, ir.Node] = {}
    group_of: dict[str, int] = {}  # buffer -> id of the group writing it
    members: dict[int, list[ir.Node]] = {}
    dag = nx.DiGraph()
    decisions: list[str] = []
    readers: dict[str, set[str]] = {}
    for node in nodes:
        for buffer in _reads(node):
            readers.setdefault(buffer, set()).add(node.name)
    for node in nodes:
        producers = sorted({group_of[b] for b in _reads(node) if b in group_of})
        target = None
        for candidate in producers:
            group = groups[candidate]
            inside = {member.name for member in members[candidate]} | {node.name}
            outside = {
                name for name in _writers(group) if name in region_outputs or readers.get(name, set()) - inside
            }
            reason = can_fuse(group, node, outside)
            others = [p for p in producers if p != candidate]
            if reason is None and any(nx.has_path(dag, candidate, other) for other in others):
                reason = "fusing would create a cycle through another kernel"
            decisions.append(f"{node.name} into {group.name}: " + ("fused" if reason is None else reason))
            if reason is None:
                target = candidate
                break
        if target is None:
            target = len(groups) + 1
            groups[target] = node
            members[target] = [node]
            dag.add_node(target)
        else:
            groups[target] = merge(groups[target], node)
            members[target].append(node)
        for buffer in _writers(node):
            group_of[buffer] = target
        for producer in producers:
            if producer != target:
                dag.add_edge(producer, target)
    # A buffer must reach HBM if it is a region output or still read by another group.
    needed = set(region_outputs)
    for group_id, group in groups.items():
        for buffer in _reads(group):
            if group_of.get(buffer) is not None:
                needed.add(buffer)
    kernels = [_prune(groups[group_id], needed) for group_id in nx.topological_sort(dag)]
    return FusionResult([kernel for kernel in kernels if kernel is not None and _all_stores(kernel)], decisions)
