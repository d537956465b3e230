"""Kernel kind ``concat``: every input copied into its slice of one output buffer (``ir.Concat``, aten.cat).

One kernel writes the whole output (a buffer has one writer). Fusion: a pointwise producer whose outputs only the
concat reads is inlined into the parts that read it over their own domain (a prologue: rotate_half's ``neg``) or
read one slice of it restated over the concat's (LTX's ``x * cos`` read as its even and odd elements), and
so is a concat producer whose parts the reads match one for one (Wan's two step-2 slice_scatters); a concat takes
such prologues from several producer groups. A pointwise consumer over the concat's domain (or over one the
concat's splits, restated: ``ir.refine_layout``) that reads its outputs with their own index map is distributed
over the parts (an epilogue: each part computes the consumer on its slice, reading the other operands through the
sliced access patterns), so ``cat`` -> ``mul`` -> ``add`` is one kernel and the concatenation itself need not reach
HBM. Tiling: one pointwise plan per part; consecutive parts writing the phases of the same rows (a stack on the
last dim) share one. Codegen: the parts' pointwise bodies one after the other, with fresh tiles per iteration
(concat.py.j2); interleaved phases are assembled on chip and stored as contiguous rows (codegen/strided_rows.py).
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import TileAllocator
from neuron_compile.codegen.kernel_text import kernel_context, kernel_names, render_template
from neuron_compile.codegen.strided_rows import interleaving
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, describe, kind_of, loads, register_kind
from neuron_compile.kinds.fusion_rules import stored_exprs
from neuron_compile.kinds.pointwise import plan_pointwise, pointwise_body
from neuron_compile.tiles import TilePlan, count_tiles


def slice_layout(layout: ir.Layout, start: tuple[int, ...], extent: tuple[int, ...]) -> ir.Layout:
    """``layout`` (over a concat's domain) restricted to the box of ``extent`` elements from ``start``."""
    offset = layout.offset + sum(first * stride for first, stride in zip(start, layout.strides))
    return ir.Layout(tuple(extent), layout.strides, offset)


def _has_iota(expr: ir.Expr) -> bool:
    return any(isinstance(node, ir.Iota) for node in ir.nodes_of(expr))


def over_domain(node: ir.Pointwise, domain: tuple[int, ...]) -> ir.Pointwise | None:
    """``node`` restated over ``domain`` when that only splits its dims (``ir.refine_layout``: Flux's rotary
    ``x * cos + stack([-x2, x1], -1).flatten(-2) * sin`` over [.., 128] against the stack's [.., 64, 2]), else
    None. Not with an index (iota) or random draws, whose values follow the domain's coordinates."""
    if tuple(node.domain) == tuple(domain):
        return node
    exprs = [store.expr for store in node.stores]
    if any(_has_iota(expr) or ir.draws_random(expr) for expr in exprs):
        return None
    used = [store.layout for store in node.stores] + [layout for expr in exprs for layout in ir.access_layouts(expr)]
    layouts = {layout: ir.refine_layout(layout, tuple(domain)) for layout in used}
    if any(layout is None for layout in layouts.values()):
        return None

    def leaf(node):
        return dataclasses.replace(node, layout=layouts[node.layout]) if isinstance(node, ir.Load) else node

    return dataclasses.replace(node, domain=tuple(domain), stores=tuple(
        dataclasses.replace(store, expr=ir.map_leaves(store.expr, leaf), layout=layouts[store.layout])
        for store in node.stores))


def producer_value(producer: ir.Pointwise, load: ir.Load, concat_domain: tuple[int, ...]) -> ir.Expr | None:
    """The expression a part's ``load`` of the pointwise ``producer``'s output stands for, over the part's domain
    (``load.layout.shape``): the producer restated over it, or, when the part reads one slice of the producer
    restated over the concat's domain (LTX's rotary reads ``x * cos`` over [.., 1024] as the even and the odd
    elements of [.., 512, 2], its parts' [.., 512, 1]), that slice of each of its layouts. None otherwise."""
    domain = tuple(load.layout.shape)
    restated = over_domain(producer, domain)
    if restated is not None:
        store = stored_exprs(restated.stores)[load.buffer]
        return store.expr if ir.same_index_map(load.layout, store.layout) else None
    wide = over_domain(producer, tuple(concat_domain))
    cut = [dim for dim, (size, full) in enumerate(zip(domain, concat_domain)) if size != full]
    if wide is None or len(domain) != len(concat_domain) or len(cut) != 1 or domain[cut[0]] != 1:
        return None
    store = stored_exprs(wide.stores)[load.buffer]
    stride, delta = store.layout.strides[cut[0]], load.layout.offset - store.layout.offset
    if stride <= 0 or delta % stride or not 0 <= delta // stride < concat_domain[cut[0]]:
        return None
    start = tuple(delta // stride if dim == cut[0] else 0 for dim in range(len(domain)))
    if not ir.same_index_map(load.layout, slice_layout(store.layout, start, domain)):
        return None

    def leaf(node):
        return dataclasses.replace(node, layout=slice_layout(node.layout, start, domain)) \
            if isinstance(node, ir.Load) else node

    return ir.map_leaves(store.expr, leaf)


def epilogue_refusal(group: ir.Concat, consumer) -> str | None:
    """None if the pointwise ``consumer`` may be distributed over ``group``'s parts (see the module docstring)."""
    if len(group.starts) != len(group.parts):
        return "the concat's parts have no known place in its output"
    if sum(math.prod(part.domain) for part in group.parts) != math.prod(group.domain):
        return "the concat's parts do not cover its output"
    if any(_has_iota(store.expr) for store in consumer.stores):
        return "the epilogue computes an index (iota), which the parts' slices would shift"
    restated = over_domain(consumer, group.domain)
    if restated is None:
        return f"domains differ: {list(consumer.domain)} vs {list(group.domain)}"
    consumer = restated
    written = {store.buffer.name: store.layout for store in group.stores}
    for load in loads(consumer):
        if load.buffer in written and not ir.same_index_map(load.layout, written[load.buffer]):
            return f"{load.buffer} is read through a view that changes the index map"
    return None


def with_epilogue(part: ir.Pointwise, start: tuple[int, ...], consumer) -> ir.Pointwise:
    """``part`` also computing ``consumer``'s stores on its slice: reads of what the part stores become its
    expressions, other loads are sliced to the part's box."""
    stored = stored_exprs(part.stores)

    def leaf(node):
        if isinstance(node, ir.Load) and node.buffer in stored:
            return stored[node.buffer].expr
        return dataclasses.replace(node, layout=slice_layout(node.layout, start, part.domain))

    added = tuple(ir.Store(store.buffer, ir.map_leaves(store.expr, leaf), slice_layout(store.layout, start, part.domain))
                  for store in consumer.stores)
    return dataclasses.replace(part, stores=part.stores + added)


def prologue_refusal(producer, consumer: ir.Concat, outside: set[str]) -> str | None:
    """None if the pointwise ``producer`` may be inlined into the parts of ``consumer`` that read it, or the
    concat ``producer``'s parts into the parts that read exactly one of them (``concat_prologue_refusal``)."""
    if isinstance(producer, ir.Concat):
        return concat_prologue_refusal(producer, consumer, outside)
    if not kind_of(producer).elementwise:
        return f"a concat part's prologue must be pointwise, not {type(producer).__name__}"
    if outside:
        return f"the prologue's outputs {sorted(outside)} are needed outside the kernel"
    written = stored_exprs(producer.stores)
    for part in consumer.parts:
        for load in loads(part):
            if load.buffer in written and producer_value(producer, load, consumer.domain) is None:
                return (f"{load.buffer} (over {list(producer.domain)}) is read through a view that is neither its "
                        f"index map over the part's {list(part.domain)} nor a slice of it over the concat's")
    return None


def concat_prologue_refusal(producer: ir.Concat, consumer: ir.Concat, outside: set[str]) -> str | None:
    """None if every read of ``producer``'s output by ``consumer``'s parts is one producer part's store (the same
    domain and index map): Wan's ``out[..., 0::2] = a`` then ``out[..., 1::2] = b`` is two slice_scatters, the
    second copying the first's ``a`` back; merged, it computes ``a`` and ``b`` and the first's other part (a copy
    of ``empty``'s odd elements) goes."""
    if outside:
        return f"the producer concat's outputs {sorted(outside)} are needed outside the kernel"
    if producer.epilogue_stores:
        return "the producer concat has an epilogue"
    for part in consumer.parts:
        for load in loads(part):
            if load.buffer in {store.buffer.name for store in producer.stores} and _phase_part(
                    producer, part, load) is None:
                return f"{load.buffer} is read through a view that is none of its parts' slices"
    return None


def _phase_part(producer: ir.Concat, reader: ir.Pointwise, load: ir.Load) -> ir.Store | None:
    """The producer part's store that ``load`` (in ``reader``) reads exactly, or None."""
    for part in producer.parts:
        for store in part.stores:
            if (store.buffer.name == load.buffer and part.domain == reader.domain
                    and ir.same_index_map(store.layout, load.layout)):
                return store
    return None


def inline_concat_prologue(producer: ir.Concat, part: ir.Pointwise) -> ir.Pointwise:
    written = {store.buffer.name for store in producer.stores}

    def leaf(node):
        if isinstance(node, ir.Load) and node.buffer in written:
            return _phase_part(producer, part, node).expr
        return node

    return dataclasses.replace(part, stores=tuple(
        dataclasses.replace(store, expr=ir.map_leaves(store.expr, leaf)) for store in part.stores))


def inline_prologue(producer, part: ir.Pointwise, concat_domain: tuple[int, ...]) -> ir.Pointwise:
    written = {store.buffer.name for store in producer.stores}
    if not any(load.buffer in written for load in loads(part)):
        return part

    def leaf(node):
        if isinstance(node, ir.Load) and node.buffer in written:
            return producer_value(producer, node, concat_domain)
        return node

    return dataclasses.replace(part, stores=tuple(
        dataclasses.replace(store, expr=ir.map_leaves(store.expr, leaf)) for store in part.stores))


def interleaved_parts(node: ir.Concat) -> list[list[int]]:
    """Runs of consecutive parts that write interleaved phases of the same rows (``stack([a, b], -1)``,
    ``out[..., 0::2] = a; out[..., 1::2] = b``): equal domains, one store each, to one buffer through layouts
    that differ only by offsets ``base .. base + k - 1``, the smallest stride ``k``. They are planned as one loop
    nest and stored by contiguous DMAs (codegen/strided_rows.py)."""
    runs: list[list[int]] = []
    for index, part in enumerate(node.parts):
        if runs and _next_phase(node.parts[runs[-1][-1]], part, node.parts[runs[-1][0]]):
            runs[-1].append(index)
        else:
            runs.append([index])
    return [run for run in runs if len(run) > 1 and _steps_by_count(node.parts[run[0]], len(run))]


def _next_phase(previous: ir.Pointwise, part: ir.Pointwise, first: ir.Pointwise) -> bool:
    if len(part.stores) != 1 or len(previous.stores) != 1 or part.domain != first.domain:
        return False
    last, store = previous.stores[0], part.stores[0]
    return (last.buffer.name == store.buffer.name and last.layout.shape == store.layout.shape
            and last.layout.strides == store.layout.strides and store.layout.offset == last.layout.offset + 1)


def _steps_by_count(part: ir.Pointwise, count: int) -> bool:
    layout = part.stores[0].layout
    strides = [abs(stride) for size, stride in zip(layout.shape, layout.strides) if size > 1 and stride]
    return bool(strides) and min(strides) == count


def plan_parts(node: ir.Concat, target, tiles: int) -> tuple[TilePlan, ...]:
    """Each part's pointwise plan; the parts of an interleaved run share one (planned over all their stores)."""
    plans = {}
    for run in interleaved_parts(node):
        together = dataclasses.replace(node.parts[run[0]], stores=tuple(
            store for index in run for store in node.parts[index].stores))
        plans.update(dict.fromkeys(run, plan_pointwise(together, target, tiles=tiles + len(run))))
    return tuple(plans.get(index) or plan_pointwise(part, target, tiles=tiles) for index, part in
                 enumerate(node.parts))


def shared_loops(node: ir.Concat, plan: TilePlan) -> list[list[int]]:
    """The parts' indices grouped into loop nests: consecutive parts whose plans walk the same loops share one, so
    their common loads (rotate_half reads both halves of q in each part) are loaded once per tile. A part that
    reads what a part of the nest writes starts a new nest: it must see all of that part's tiles stored."""
    groups: list[list[int]] = []
    for index, part_plan in enumerate(plan.parts):
        if groups and _same_loops(plan.parts[groups[-1][0]], part_plan) and not _reads_any_of(
                node.parts[index], [node.parts[member] for member in groups[-1]]):
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _same_loops(first: TilePlan, second: TilePlan) -> bool:
    return (first.outer, first.partition, first.free) == (second.outer, second.partition, second.free)


def _reads_any_of(part: ir.Pointwise, others: list[ir.Pointwise]) -> bool:
    written = {store.buffer.name for other in others for store in other.stores}
    return any(load.buffer in written for load in loads(part)) or any(
        store.buffer.name in {load.buffer for other in others for load in loads(other)} for store in part.stores)


def nest_stores(node: ir.Concat, indices: list[int], plan: TilePlan) -> tuple[tuple, tuple]:
    """(the stores of the nest's parts stored one by one, the groups of interleaved stores stored whole)."""
    groups = []
    for run in interleaved_parts(node):
        if set(run) <= set(indices):
            group = interleaving(tuple(node.parts[index].stores[0] for index in run), plan.free[-1])
            if group is not None:
                groups.append(group)
    grouped = {id(store) for group in groups for store in group}
    single = tuple(store for index in indices for store in node.parts[index].stores if id(store) not in grouped)
    return single, tuple(groups)


# Why a concat marked in place (passes/concat_in_place.py) fuses nothing: its parts must stay plain copies.
IN_PLACE = "the concat is assembled in place: its inputs' writers are to store into its output"


class ConcatKind(KernelKind):
    node_type = ir.Concat
    name = "concat"
    takes_prologue = True
    takes_several_prologues = True  # each producer is inlined into the parts that read it, the others kept

    def epilogue_reason(self, group, consumer, outside):
        return IN_PLACE if group.in_place else epilogue_refusal(group, consumer)

    def merge_epilogue(self, group, consumer):
        consumer = over_domain(consumer, group.domain)
        parts = tuple(with_epilogue(part, start, consumer) for part, start in zip(group.parts, group.starts))
        full = tuple(ir.Store(store.buffer, ir.Result(), store.layout) for store in consumer.stores)
        return dataclasses.replace(group, parts=parts, epilogue_stores=group.epilogue_stores + full)

    def prologue_reason(self, producer, consumer, outside):
        if consumer.in_place or getattr(producer, "in_place", False):
            return IN_PLACE
        return prologue_refusal(producer, consumer, outside)

    def merge_prologue(self, producer, consumer):
        if isinstance(producer, ir.Concat):
            return dataclasses.replace(consumer, parts=tuple(inline_concat_prologue(producer, part)
                                                             for part in consumer.parts))
        return dataclasses.replace(consumer, parts=tuple(inline_prologue(producer, part, consumer.domain)
                                                         for part in consumer.parts))

    def exprs(self, node):
        return [store.expr for part in node.parts for store in part.stores]

    def operand_loads(self, node):
        """An in-place concat's copies stay loads: nothing is inlined into them."""
        return [store.expr for part in node.parts for store in part.stores] if node.in_place else []

    def map_exprs(self, node, fn):
        parts = tuple(
            dataclasses.replace(part, stores=tuple(dataclasses.replace(s, expr=fn(s.expr)) for s in part.stores))
            for part in node.parts
        )
        return dataclasses.replace(node, parts=parts)

    def describe(self, node):
        head = f"Concat {node.name} domain={list(node.domain)}"
        return "\n".join([head] + [describe(part) for part in node.parts])

    def prune(self, node, needed):
        """The parts keeping only the needed stores (the concatenation itself may go); None if none is."""
        parts = tuple(dataclasses.replace(part, stores=tuple(s for s in part.stores if s.buffer.name in needed))
                      for part in node.parts)
        return dataclasses.replace(node, parts=parts) if any(part.stores for part in parts) else None

    def plan(self, node, target):
        # A part's tiles stay allocated while the next part runs (they are the kernel's locals), so every part is
        # sized for the SBUF the parts' tiles take together.
        together = sum(count_tiles([store.expr for store in part.stores]) for part in node.parts)
        parts = plan_parts(node, target, together)
        synthetic = LoopDim(1, None)
        tiles = max(part.tiles_per_iteration for part in parts)
        return TilePlan("concat", (), synthetic, (synthetic,), tiles, parts=parts)

    def render(self, node, plan, name, parameters):
        nests, count = [], 0
        for indices in shared_loops(node, plan):
            loop_plan = plan.parts[indices[0]]
            allocator = TileAllocator(loop_plan.partition.tile, reserved=kernel_names(node, parameters))
            allocator.count = count  # distinct tile names across loops
            stores, interleaved = nest_stores(node, indices, loop_plan)
            body = pointwise_body(stores, loop_plan, allocator, interleaved)
            count = allocator.count
            nests.append(dict(plan=loop_plan, body=body, allocations=allocator.lines, inputs=indices,
                              depth=len(loop_plan.outer) + 1))
        context = kernel_context(node, plan, name, parameters, allocations=[], nests=nests)
        return render_template("concat.py.j2", **context)


register_kind(ConcatKind())
