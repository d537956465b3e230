"""Fusion stage: IR nodes -> kernel groups, each group one IR node with its producers' math inlined.

Input: the lowered IR nodes in graph order and the names of buffers that must reach HBM (region outputs).
Output: ``FusionResult`` — the fused IR nodes (one per kernel, in a valid launch order) and ``decisions``, the
reason every considered producer/consumer pair was or was not fused (the dump shows them).

Rules (after Inductor's): a pointwise node joins the group that produces one of its operands when it reads
that operand with the producer's own index map ("matching index") over the same domain — a pointwise chain,
a reduction/softmax epilogue, or a matmul epilogue; a pointwise node over a reduction's whole input domain
that reads the reduced value broadcast back becomes a row epilogue (rms norm: the row is still in SBUF); a
reduction, softmax or scan absorbs a pointwise producer group as its prologue when nothing else needs that
group's outputs (a scan's pointwise consumers over its domain become its epilogue, as a softmax's do); a node
joins one producer group, and a kind that takes several prologues (a concat) then absorbs its other producer groups
too (``absorb_other_producers``), or, from one it cannot take whole, the pointwise members only it reads
(``detach_epilogues``). No
fusion may create a cycle in the group DAG, nor (given a target) a kernel that no longer tiles within its SBUF, and
a random draw (dropout's mask) stays in pointwise kernels, which
evaluate it once per element: a reduction recomputing its prologue would draw a second, different mask.
A producer's store is kept only if its buffer is still read outside the group or is a region output. The rules
live with the kernel kinds (neuron_compile/kinds/); this module is the greedy driver.

After grouping, ``fuse_siblings`` computes a kernel inside a later kernel of its kind when both share their main
input and their kind pairs them: one matmul kernel with two products (a gated MLP's gate and up projections, the
gate read by the up projection's epilogue; attention's k and v projections, both stored); one reduction kernel
giving a variance and the mean of the same rows (a layer norm, kinds/reduction_siblings.py). Last, a row norm whose
normed rows matmuls multiply is computed inside each of them (``fold_row_norms``, passes/row_norm_operands.py), and a
row norm left on its own runs in the epilogue of the matmul writing its rows (``fold_norm_epilogues``,
passes/norm_epilogues.py). With ``in_place`` (a region launched as one kernel), a concat of whole buffers that
kernels write is assembled in place: marked before grouping, its inputs' writers store into its output after it
(passes/concat_in_place.py). Then a rotary embedding runs in the epilogue of the q / k projection whose heads it
rotates (``fold_rotary_epilogues``, passes/rotary_epilogues.py; a rotary of joint rows assembled in place, one
slice per projection). Last, what an attention kernel's keys and values need is
launched before the rest (passes/launch_order.py).

Before grouping, a pure copy (one load stored in another layout, as a write into an empty cache makes) whose every
reader can read its source through a strided view is dropped and its readers read the source, or else whose
source is a flash attention's output only it reads is dropped and the attention writes its layout
(``passes/copy_views.py``); then a cheap pointwise node (one store, one input or one reader, at most
``INLINE_MAX_OPS`` operations: a cast, a square, a negation, a rotary embedding's ``q * cos``) is inlined into its
readers (``inline_cheap``) when every reader reads it with its own index map (a constant, with any): recomputing it
costs an instruction or two where storing it costs an HBM round trip, and a kernel when its producer cannot take it
(rms norm's ``x.float()`` and ``x.float() ** 2``: 4-byte copies of a 2-byte tensor, written by the residual's
matmul epilogue and read back by the norm, which now reads ``x`` itself).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import networkx as nx

from neuron_compile import ir, kinds
from neuron_compile.passes.broadcast_reads import restated
from neuron_compile.passes.concat_in_place import assemble_in_place, mark_in_place
from neuron_compile.passes.copy_views import read_copies_as_views, write_copies_in_writers
from neuron_compile.passes.fold_traffic import traffic_reason
from neuron_compile.passes.launch_order import keys_and_values_first
from neuron_compile.passes.norm_epilogues import fold_norm_epilogues
from neuron_compile.passes.rotary_epilogues import fold_rotary_epilogues
from neuron_compile.passes.row_norm_operands import fold_row_norms
from neuron_compile.passes.tiling import TilingError, plan_kernel


@dataclasses.dataclass
class FusionResult:
    kernels: list[ir.Node]
    decisions: list[str]
    assembled: frozenset = frozenset()  # buffers several kernels write, disjoint slices each (concats in place)


def can_fuse(group: ir.Node, consumer: ir.Node, outside_readers: set[str]) -> str | None:
    """None if ``consumer`` may be merged into ``group`` (its producer), else the reason it may not.

    ``outside_readers`` are the group's buffers that something other than ``consumer`` still reads. The group's
    kind decides on an elementwise consumer (an epilogue), the consumer's kind on a producer (a prologue).
    """
    group_kind, consumer_kind = kinds.kind_of(group), kinds.kind_of(consumer)
    if group_kind.refusal:
        return group_kind.refusal
    if consumer_kind.elementwise:
        reason = group_kind.epilogue_reason(group, consumer, outside_readers)
        return reason or kinds.random_reason(group_kind, consumer)
    reason = consumer_kind.prologue_reason(group, consumer, outside_readers)
    return reason or kinds.random_reason(consumer_kind, group)


def merge(group: ir.Node, consumer: ir.Node) -> ir.Node:
    """``consumer`` merged into ``group`` (``can_fuse`` said yes)."""
    if kinds.kind_of(consumer).elementwise:
        return kinds.kind_of(group).merge_epilogue(group, consumer)
    return kinds.kind_of(consumer).merge_prologue(group, consumer)


FUSION_OFF = "fusion is off (config fusion=False, NEURON_COMPILE_FUSION=0)"


INLINE_MAX_OPS = 3


def _fits(target):
    """Whether a node can be tiled on ``target`` (passes/tiling.py raises TilingError when it cannot)."""
    def fits(node: ir.Node) -> bool:
        try:
            plan_kernel(node, target)
        except TilingError:
            return False
        return True

    return fits


def _operations(expr: ir.Expr, seen: set) -> int:
    if not isinstance(expr, ir.Op) or expr in seen:
        return 0
    seen.add(expr)
    return 1 + sum(_operations(arg, seen) for arg in expr.args)


def _cheap_store(node: ir.Node, readers: dict[str, int]) -> ir.Store | None:
    """The store of an elementwise node computing at most INLINE_MAX_OPS operations of one load or of none (a
    constant), or of several when one node reads it (inlined there, no load or instruction is made twice), else
    None."""
    if not kinds.kind_of(node).elementwise or len(kinds.stores(node)) != 1:
        return None
    store = kinds.stores(node)[0]
    if len(ir.access_layouts(store.expr)) != len(ir.loads_of(store.expr)):
        return None  # an iota
    if len(ir.loads_of(store.expr)) > 1 and readers.get(store.buffer.name, 0) != 1:
        return None
    return store if _operations(store.expr, set()) <= INLINE_MAX_OPS else None


def _reader_counts(nodes: list[ir.Node]) -> dict[str, int]:
    """How many nodes read each buffer."""
    counts: dict[str, int] = {}
    for node in nodes:
        for buffer in kinds.read_buffers(node):
            counts[buffer] = counts.get(buffer, 0) + 1
    return counts


def _narrows_a_pointwise_result(store: ir.Store, pointwise_outputs: set[str]) -> bool:
    """Whether ``store`` casts down (to bf16, say) values that pointwise nodes of the region compute wider. Inlined,
    each reader would load the wide value, which its producer then has to store (AdamW's fp32 ``exp_avg_sq`` read
    back by the parameter update only to be rounded to bf16); left alone, the cast joins its producer's kernel and
    the readers load the narrow value, as eager does."""
    loads = ir.loads_of(store.expr)
    return bool(loads) and all(
        load.buffer in pointwise_outputs and ir.ITEMSIZE.get(load.dtype, 4) > ir.ITEMSIZE.get(store.buffer.dtype, 4)
        for load in loads)


def _inlinable(nodes: list[ir.Node], region_outputs: set[str]) -> dict[str, ir.Store]:
    """The cheap stores (by buffer) that every reader reads through the store's own index map as an expression leaf
    (a matmul or gather operand cannot take an expression), that are not region outputs, and that do not cast down
    a pointwise node's result."""
    readers = _reader_counts(nodes)
    pointwise_outputs = {name for node in nodes if kinds.kind_of(node).elementwise
                         for name in kinds.written_buffers(node)}
    cheap = {store.buffer.name: store for store in (_cheap_store(node, readers) for node in nodes)
             if store is not None and store.buffer.name not in region_outputs
             and not _narrows_a_pointwise_result(store, pointwise_outputs)}
    for node in nodes:
        kind = kinds.kind_of(node)
        for load in kind.operand_loads(node):
            cheap.pop(load.buffer, None)
        for load in (leaf for expr in kind.exprs(node) for leaf in ir.loads_of(expr)):
            constant = load.buffer in cheap and not ir.loads_of(cheap[load.buffer].expr)  # any index map reads it
            if load.buffer in cheap and not constant and restated(cheap[load.buffer], load) is None:
                cheap.pop(load.buffer)
    return cheap


def _value_as_read(store: ir.Store, read: ir.Load) -> ir.Expr:
    """The cheap store's value as ``read`` sees it: its expression, over the reader's domain when the reader reads it
    through a repeating view (passes/broadcast_reads.py; ``_inlinable`` kept only stores every reader can restate).
    A constant reads the same through any view."""
    if not ir.loads_of(store.expr):
        return store.expr
    return restated(store, read)


def inline_cheap(nodes: list[ir.Node], region_outputs: set[str], fits=None) -> list[ir.Node]:
    """``nodes`` with the inlinable cheap nodes' expressions in place of their loads, and those nodes gone. A
    reader that would no longer fit the target once inlined (``fits(node)`` False: its tiles over the SBUF budget)
    keeps its loads, and the cheap nodes it reads stay."""
    cheap = _inlinable(nodes, region_outputs)
    while cheap:
        def inline(expr: ir.Expr, cheap=cheap) -> ir.Expr:  # recursively: a cheap node may read another one
            return ir.map_leaves(expr, lambda leaf: inline(_value_as_read(cheap[leaf.buffer], leaf))
                                 if isinstance(leaf, ir.Load) and leaf.buffer in cheap else leaf)

        kept = [node for node in nodes
                if not (kinds.written_buffers(node) and kinds.written_buffers(node) <= set(cheap))]
        inlined = [kinds.map_exprs(node, inline) for node in kept]
        misfits = [node for node, new in zip(kept, inlined, strict=True)
                   if fits is not None and kinds.read_buffers(node) & set(cheap) and not fits(new)]
        if not misfits:
            return inlined
        for node in misfits:  # leave these readers' loads alone, and with them the nodes they read
            for buffer in kinds.read_buffers(node):  # each pass drops at least one cheap node, so the loop ends
                cheap.pop(buffer, None)
    return nodes


def _misfit_reason(group: ir.Node, node: ir.Node, inside: set[str], readers: dict[str, set[str]],
                   region_outputs: set[str], fits) -> str | None:
    """Why ``node`` may not join ``group`` although their kinds agree: the merged kernel, with the stores nothing
    outside it reads pruned, would not tile within the target's SBUF (a row kernel keeps whole rows of every value
    it computes on chip; each fused epilogue adds rows). None when it fits."""
    merged = merge(group, node)
    needed = {name for name in kinds.written_buffers(merged)
              if name in region_outputs or readers.get(name, set()) - inside}
    pruned = kinds.kind_of(merged).prune(merged, needed)
    if pruned is None or not kinds.stores(pruned) or fits(pruned):
        return None
    return "the fused kernel would not fit the target's SBUF"


@dataclasses.dataclass
class FusionState:
    """The greedy driver's groups (by id), the group writing each buffer, each group's member nodes, the group DAG,
    each buffer's reader nodes, the region's outputs and the decisions so far."""

    groups: dict[int, ir.Node]
    group_of: dict[str, int]
    members: dict[int, list[ir.Node]]
    dag: nx.DiGraph
    readers: dict[str, set[str]]
    region_outputs: set[str]
    decisions: list[str]


def absorb_other_producers(state: FusionState, joined: int, others: list[int], fits) -> list[int]:
    """After a node joined group ``joined``, its other producer groups that the merged kind takes as prologues
    are merged in too (Wan's second ``slice_scatter`` reads the first, already joined, and the pointwise math of
    its own slice); the producers left, ``joined`` among them."""
    if not kinds.kind_of(state.groups[joined]).takes_several_prologues:
        return [joined, *others]
    left = [joined]
    for other in others:
        group, producer = state.groups[joined], state.groups[other]
        inside = {member.name for member in state.members[joined] + state.members[other]}
        outside = {name for name in kinds.written_buffers(producer)
                   if name in state.region_outputs or state.readers.get(name, set()) - inside}
        reason = can_fuse(producer, group, outside)
        if reason is None and any(nx.has_path(state.dag, other, rest) for rest in others + [joined]
                                  if rest != other and rest in state.dag):
            reason = "fusing would create a cycle through another kernel"
        if reason is None and fits is not None:
            reason = _misfit_reason(producer, group, inside, state.readers, state.region_outputs, fits)
        state.decisions.append(f"{producer.name} into {group.name} (a second producer): "
                               + ("fused" if reason is None else reason))
        if reason is not None:
            detach_epilogues(state, joined, other, fits)
            left.append(other)
            continue
        state.groups[joined] = merge(producer, group)
        state.members[joined] += state.members.pop(other)
        for buffer in kinds.written_buffers(producer):
            state.group_of[buffer] = joined
        for before in list(state.dag.predecessors(other)):
            state.dag.add_edge(before, joined)
        state.dag.remove_node(other)
        del state.groups[other]
    return left


def detach_epilogues(state: FusionState, joined: int, other: int, fits) -> None:
    """Pointwise members of producer group ``other`` (which ``joined``, a kind taking several prologues, cannot take
    whole) that only ``joined`` reads, and that read nothing of ``other`` but buffers stored for readers outside it,
    leave ``other`` and become prologues of ``joined``: they are recomputed from those buffers instead of stored and
    read back. LTX's rotary: ``x * cos`` had joined the q norm as a row epilogue, whose fp32 product made an HBM
    round trip of 4 bytes an element into the rotary's concat, which reads the normed ``x`` anyway."""
    for member in list(state.members[other]):
        if not _detachable(state, member, other, joined):  # asked again: an earlier detach changes the groups
            continue
        group = state.groups[joined]
        reason = can_fuse(member, group, set())
        if reason is None and fits is not None:
            inside = {node.name for node in state.members[joined]} | {member.name}
            reason = _misfit_reason(member, group, inside, state.readers, state.region_outputs, fits)
        state.decisions.append(f"{member.name} out of {state.groups[other].name} into {group.name}: "
                               + ("fused" if reason is None else reason))
        if reason is not None:
            continue
        written = kinds.written_buffers(member)
        state.groups[joined] = merge(member, group)
        state.groups[other] = kinds.kind_of(state.groups[other]).prune(
            state.groups[other], kinds.written_buffers(state.groups[other]) - written)
        state.members[other].remove(member)
        state.members[joined].append(member)
        for buffer in written:
            state.group_of[buffer] = joined


def _detachable(state: FusionState, member: ir.Node, other: int, joined: int) -> bool:
    """Whether ``member`` of group ``other`` is a pointwise node whose outputs only group ``joined`` reads and whose
    reads of ``other`` are of buffers stored for other readers anyway (``detach_epilogues``)."""
    written = kinds.written_buffers(member)
    joined_names = {node.name for node in state.members[joined]}
    if not kinds.kind_of(member).elementwise or not written & kinds.read_buffers(state.groups[joined]):
        return False
    if written & state.region_outputs or any(state.readers.get(name, set()) - joined_names for name in written):
        return False
    staying = {node.name for node in state.members[other]} - {member.name}
    stored_anyway = {name for node in state.members[other] if node is not member for name in kinds.written_buffers(node)
                     if name in state.region_outputs or state.readers.get(name, set()) - staying - {member.name}}
    produced_here = kinds.written_buffers(state.groups[other]) - written
    return all(name in stored_anyway for name in kinds.read_buffers(member) & produced_here)


def fuse(nodes: list[ir.Node], region_outputs: set[str], enabled: bool = True, target=None,
         in_place: bool = False) -> FusionResult:
    """Greedy fusion in graph order (see the module docstring); ``enabled=False`` keeps one kernel per node. With a
    ``target``, cheap nodes are inlined only into readers that still fit it. ``in_place``: concats may be assembled
    in place (only where the region's kernels are launched as one)."""
    fits = None if target is None else _fits(target)
    in_place = in_place and enabled
    if in_place:
        nodes = mark_in_place(nodes, region_outputs)
    if enabled:
        nodes = write_copies_in_writers(read_copies_as_views(nodes, region_outputs), region_outputs)
        nodes = inline_cheap(nodes, region_outputs, fits=fits)
    groups: dict[int, ir.Node] = {}
    fresh_ids = itertools.count(1)  # a group absorbed into another leaves a gap: ids are never reused
    group_of: dict[str, int] = {}  # buffer -> id of the group writing it
    members: dict[int, list[ir.Node]] = {}
    dag = nx.DiGraph()
    decisions: list[str] = []
    readers: dict[str, set[str]] = {}
    for node in nodes:
        for buffer in kinds.read_buffers(node):
            readers.setdefault(buffer, set()).add(node.name)
    for node in nodes:
        producers = sorted({group_of[b] for b in kinds.read_buffers(node) if b in group_of})
        joined = None
        for candidate in producers:
            group = groups[candidate]
            inside = {member.name for member in members[candidate]} | {node.name}
            outside = {name for name in kinds.written_buffers(group)
                       if name in region_outputs or readers.get(name, set()) - inside}
            reason = can_fuse(group, node, outside) if enabled else FUSION_OFF
            others = [p for p in producers if p != candidate]
            if reason is None and any(nx.has_path(dag, candidate, other) for other in others):
                reason = "fusing would create a cycle through another kernel"
            if reason is None and fits is not None:
                reason = _misfit_reason(group, node, inside, readers, region_outputs, fits)
            decisions.append(f"{node.name} into {group.name}: " + ("fused" if reason is None else reason))
            if reason is None:
                joined = candidate
                break
        if joined is None:
            joined = next(fresh_ids)
            groups[joined] = node
            members[joined] = [node]
            dag.add_node(joined)
        else:
            groups[joined] = merge(groups[joined], node)
            members[joined].append(node)
            state = FusionState(groups, group_of, members, dag, readers, region_outputs, decisions)
            producers = absorb_other_producers(state, joined, [p for p in producers if p != joined], fits)
        for buffer in kinds.written_buffers(node):
            group_of[buffer] = joined
        for producer in producers:
            if producer != joined:
                dag.add_edge(producer, joined)
    # A buffer must reach HBM if it is a region output or still read by another group.
    needed = set(region_outputs)
    for group_id, group in groups.items():
        for buffer in kinds.read_buffers(group):
            if group_of.get(buffer) is not None:
                needed.add(buffer)
    kernels = [kinds.kind_of(groups[group_id]).prune(groups[group_id], needed) for group_id in nx.topological_sort(dag)]
    kernels = [kernel for kernel in kernels if kernel is not None and kinds.stores(kernel)]
    if enabled:
        kernels = fuse_siblings(kernels, region_outputs, decisions, fits)
        weigh = None if target is None else functools.partial(traffic_reason, target=target)
        kernels = fold_row_norms(kernels, region_outputs, decisions, fits, weigh)
        kernels = fold_norm_epilogues(kernels, region_outputs, decisions, fits, weigh)
    assembled = frozenset()
    if in_place:
        kernels, assembled = assemble_in_place(kernels, decisions, fits)
    if enabled:
        kernels, assembled = fold_rotary_epilogues(kernels, region_outputs, decisions, fits, assembled)
        kernels = keys_and_values_first(kernels)
    return FusionResult(kernels, decisions, assembled)


def fuse_siblings(kernels: list[ir.Node], region_outputs: set[str], decisions: list[str], fits=None) -> list[ir.Node]:
    """Horizontal fusion: a kernel that shares a later kernel's main input is computed inside it when their kind
    allows: one pass over the input (a gated MLP's gate projection inside its up projection, whose epilogue reads it
    so that the gate never goes through HBM; attention's k projection inside its v projection). The pair takes the
    later kernel's place, so everything either one reads is ready; a kernel that reads the earlier one's outputs
    before that place keeps them apart."""
    kernels = list(kernels)
    reads = {kernel.name: kinds.read_buffers(kernel) for kernel in kernels}
    index = 0
    while index < len(kernels):
        second = kernels[index]
        for position, first in enumerate(kernels[:index]):
            written = kinds.written_buffers(first)
            related = written & reads[second.name] or reads[first.name] & reads[second.name]
            if type(first) is not type(second) or not related:
                continue  # only kernels that share an input, or read one another, can be siblings
            others = [node for node in kernels if node is not first and node is not second]
            outside = {buffer for buffer in written
                       if buffer in region_outputs or any(buffer in reads[node.name] for node in others)}
            kind = kinds.kind_of(second)
            reason = kind.sibling_reason(first, second, outside)
            if reason is None and any(written & reads[node.name] for node in kernels[position + 1:index]):
                reason = f"a kernel between them reads {first.name}'s outputs"
            merged = kind.merge_sibling(first, second, outside) if reason is None else None
            if merged is not None and fits is not None and not fits(merged):
                reason = "the paired kernel would not fit the target's SBUF"
            decisions.append(f"{first.name} inside {second.name}: " + ("fused" if reason is None else reason))
            if reason is None:
                kernels[index] = merged
                reads[merged.name] = kinds.read_buffers(merged)
                kernels.remove(first)
                index -= 1
                break
        index += 1
    return kernels
