"""Kernel kinds: the one registry that maps an IR node type to everything the passes need to know about it.

Input: ``register_kind(kind)`` calls from the kind modules (``neuron_compile.kinds.pointwise`` ...), made when
the ``neuron_compile.kinds`` package is imported (it imports every kind; the passes import it). Output:
``kind_of(node)``, the node's ``KernelKind``, and the questions the passes ask of any node (its loads, its
stores, its description, its expressions) answered by it.

A kind declares, in its own module: what a node of it reads and writes, its fusion rules (as the producer of a
group, ``epilogue_reason`` / ``merge_epilogue``; as the consumer of one, ``prologue_reason`` / ``merge_prologue``),
its tile planner and its renderer (with its jinja2 template). Nothing outside a kind's module branches on node
types; a node whose type no kind claims is an error (``UnknownKernelKind``), never another kind's path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from neuron_compile import ir
from neuron_compile.tiles import TilePlan


class UnknownKernelKind(TypeError):
    """An IR node whose type no kernel kind registered."""


class KernelKind:
    """The behaviour of one IR node type. Subclasses override what differs; the defaults fit a node whose only
    expressions are its stores' (a pointwise node)."""

    node_type: type = object
    name: str = ""
    elementwise = False  # a consumer of this kind becomes an epilogue of its producer's group
    takes_prologue = False  # a pointwise producer may be inlined as this kind's prologue
    # a group of this kind may take prologues from several producer groups (each merge keeps the earlier ones')
    takes_several_prologues = False
    takes_norm_epilogue = False  # a later row norm of its output rows may join it (``norm_epilogue_reason``)
    takes_rotary_epilogue = False  # a later rotary of its output's heads may join it (``rotary_epilogue_reason``)
    refusal: str | None = None  # why a group of this kind takes no fused consumer at all
    # the kind evaluates each expression once per element of its stores' tiles, so a random draw (ir.RandomKeep)
    # may live in it; kinds that recompute their math (row passes, chunked rows) or walk other tiles may not
    holds_random = False
    uses_collectives = False  # its kernel text calls nki.collectives (the module imports it)

    # ---- what a node reads and writes
    def stores(self, node) -> tuple[ir.Store, ...]:
        """Every store the node writes (its HBM outputs)."""
        return tuple(node.stores)

    def exprs(self, node) -> list[ir.Expr]:
        """Every expression the node evaluates."""
        return [store.expr for store in node.stores]

    def operand_loads(self, node) -> list[ir.Load]:
        """Reads that are not leaves of an expression (matmul operands, gather sources and indices)."""
        return []

    def operand_bytes(self, node, plan: TilePlan) -> int:
        """HBM bytes of the operand loads as ``plan`` reads them (passes/fold_traffic.py weighs folds by them and
        ``tensor_seconds``): each once unless the kind's plan loads one again (a matmul's b, once per row group)."""
        return sum(load_bytes(load) for load in self.operand_loads(node))

    def tensor_seconds(self, node, target) -> float:
        """TensorE time of the node's products at the target's peak (passes/fold_traffic.py weighs folds by it
        beside the bytes): none but a matmul's."""
        return 0.0

    def map_exprs(self, node, fn: Callable[[ir.Expr], ir.Expr]):
        """``node`` with ``fn`` applied to every expression (the range-guard pass rewrites through this)."""
        stores = tuple(dataclasses.replace(store, expr=fn(store.expr)) for store in node.stores)
        return dataclasses.replace(node, stores=stores)

    def result_floors(self, node, floor_of: Callable[[ir.Expr], float | None]) -> tuple[float | None, ...]:
        """Lower bounds on the values ``ir.Result(i)`` stands for in the node's expressions (every value but nan
        is at least the bound; None: unknown), given ``floor_of``, the same for an expression of the node."""
        return ()

    def describe(self, node) -> str:
        lines = [f"{type(node).__name__} {node.name} domain={list(node.domain)}{self.describe_head(node)}"]
        lines += [f"  {store.buffer.name} = {store.expr}" for store in node.stores]
        return "\n".join(lines)

    def describe_head(self, node) -> str:
        """What the first line of ``describe`` says after the domain."""
        return ""

    # ---- fusion (see passes/fusion.py for the driver and the rules' overview)
    def restate(self, layout: ir.Layout, group) -> ir.Layout | None:
        """A layout over a consumer's domain restated in this group's domain coordinates, or None if they differ."""
        return layout if layout.shape == tuple(group.domain) else None

    def epilogue_reason(self, group, consumer, outside: set[str]) -> str | None:
        """None if the elementwise ``consumer`` may join ``group`` (a node of this kind) as an epilogue."""
        return f"{type(group).__name__} kernels take no epilogue"

    def merge_epilogue(self, group, consumer):
        raise NotImplementedError(f"{self.name} takes no epilogue")

    def prologue_reason(self, producer, consumer, outside: set[str]) -> str | None:
        return f"{type(consumer).__name__} nodes start their own kernel"

    def merge_prologue(self, producer, consumer):
        raise NotImplementedError(f"{self.name} takes no prologue")

    def row_operand_reason(self, producer, consumer) -> str | None:
        """None if the whole kernel ``consumer`` (of this kind) may compute an operand it reads from the whole
        kernel ``producer`` itself, from the producer's inputs (a matmul's left operand normed on chip:
        passes/row_norm_operands.py)."""
        return f"{self.name} kernels compute no operand of theirs on chip"

    def merge_row_operand(self, producer, consumer, kept: set[str]):
        """``consumer`` computing its operand from ``producer``'s inputs, and storing ``producer``'s outputs
        named in ``kept`` (read outside both)."""
        raise NotImplementedError(f"{self.name} computes no operand on chip")

    def norm_epilogue_reason(self, producer, consumer) -> str | None:
        """None if the whole kernel ``consumer``, a row norm of rows the whole kernel ``producer`` (of this kind)
        writes, may run in ``producer``'s epilogue on those rows kept on chip (passes/norm_epilogues.py)."""
        return f"{self.name} kernels take no norm epilogue"

    def merge_norm_epilogue(self, producer, consumer, store_rows: bool):
        """``producer`` norming its rows as ``consumer`` does; ``store_rows``: they still go to HBM."""
        raise NotImplementedError(f"{self.name} takes no norm epilogue")

    def rotary_epilogue_reason(self, producer, consumer, norm=None) -> str | None:
        """None if the whole kernel ``consumer``, a rotary embedding of heads the whole kernel ``producer`` (of this
        kind) writes, may run in ``producer``'s epilogue on its output tiles, after ``norm`` (a whole kernel
        norming each head between them) when given (passes/rotary_epilogues.py)."""
        return f"{self.name} kernels take no rotary epilogue"

    def merge_rotary_epilogue(self, producer, consumer, store_source: bool, norm=None):
        """``producer`` rotating its output (normed by ``norm``) as ``consumer`` does; ``store_source``: the output
        still goes to HBM."""
        raise NotImplementedError(f"{self.name} takes no rotary epilogue")

    def sibling_reason(self, first, second, outside: set[str]) -> str | None:
        """None if ``first``, whose outputs only the later ``second`` reads (both whole kernels of this kind), may
        be computed inside ``second`` (horizontal fusion: one pass over their shared input)."""
        return f"{self.name} kernels take no sibling"

    def merge_sibling(self, first, second, outside: set[str]):
        """The one node computing both; ``outside``: ``first``'s outputs that something else reads."""
        raise NotImplementedError(f"{self.name} takes no sibling")

    def prune(self, node, needed: set[str]):
        """``node`` keeping only the stores whose buffers are ``needed`` (None: nothing left to compute)."""
        return dataclasses.replace(node, stores=tuple(store for store in node.stores if store.buffer.name in needed))

    # ---- tiling and codegen
    def plan(self, node, target) -> TilePlan:
        raise NotImplementedError(f"{self.name}: no tile planner")

    def plan_whole_columns(self, node, target, unit: int) -> TilePlan:
        """The plan of a kind taking rotary epilogues whose N tiles hold whole runs of ``unit`` output columns
        (the epilogue's heads)."""
        raise NotImplementedError(f"{self.name}: no plan of whole runs of columns")

    def render(self, node, plan: TilePlan, name: str, parameters: list[str]) -> str:
        """The kernel module's source text."""
        raise NotImplementedError(f"{self.name}: no renderer")


_KINDS: dict[type, KernelKind] = {}


def register_kind(kind: KernelKind) -> KernelKind:
    """Register ``kind`` for its ``node_type`` (one kind per type)."""
    if kind.node_type in _KINDS:
        raise ValueError(f"{kind.node_type.__name__} already has the kernel kind {_KINDS[kind.node_type].name}")
    _KINDS[kind.node_type] = kind
    return kind


def kind_of(node) -> KernelKind:
    try:
        return _KINDS[type(node)]
    except KeyError:
        raise UnknownKernelKind(
            f"no kernel kind is registered for {type(node).__name__} (known: {', '.join(registered_kinds())})"
        ) from None


def registered_kinds() -> list[str]:
    return [kind.name for kind in _KINDS.values()]


def registered_node_types() -> list[type]:
    return list(_KINDS)


def loads(node) -> list[ir.Load]:
    """Every buffer read of ``node``, in order of first appearance, without duplicates."""
    kind = kind_of(node)
    found = [load for expr in kind.exprs(node) for load in ir.loads_of(expr)] + kind.operand_loads(node)
    return list(dict.fromkeys(found))


def load_bytes(load: ir.Load) -> int:
    """HBM bytes of the distinct elements ``load`` reads (a broadcast dim, stride 0, reads its elements once)."""
    elements = math.prod(size for size, stride in zip(load.layout.shape, load.layout.strides) if stride != 0)
    return elements * ir.ITEMSIZE.get(load.dtype, 4)


def stores(node) -> tuple[ir.Store, ...]:
    return kind_of(node).stores(node)


def written_buffers(node) -> set[str]:
    """The names of the buffers ``node`` writes."""
    return {store.buffer.name for store in stores(node)}


def read_buffers(node) -> set[str]:
    """The names of the buffers ``node`` reads."""
    return {load.buffer for load in loads(node)}


def describe(node) -> str:
    """A readable multi-line dump of one node (kernel docstrings and the per-pass dumps show it)."""
    return kind_of(node).describe(node)


def random_reason(host, moved) -> str | None:
    """None unless fusing would move ``moved``'s random draw into a kernel of the kind ``host`` that does not hold
    one: a recomputed or re-tiled random op draws a different mask than the one stored."""
    if host.holds_random or not any(ir.draws_random(expr) for expr in kind_of(moved).exprs(moved)):
        return None
    return f"{moved.name} draws random numbers, which a {host.name} kernel could draw twice over different tiles"


def map_exprs(node, fn: Callable[[ir.Expr], ir.Expr]):
    return kind_of(node).map_exprs(node, fn)


def map_loads(node, fn: Callable[[ir.Load], ir.Load]):
    """``node`` with ``fn`` applied to every load its expressions hold and to every load held by one of its fields
    (the operand loads of a matmul or an attention node). A kind that keeps operand loads deeper is not reached:
    callers check ``loads`` of the result."""
    node = map_exprs(node, lambda expr: ir.map_leaves(expr, lambda leaf: fn(leaf) if isinstance(leaf, ir.Load)
                                                      else leaf))
    operands = {field.name: fn(getattr(node, field.name)) for field in dataclasses.fields(node)
                if isinstance(getattr(node, field.name), ir.Load)}
    return dataclasses.replace(node, **operands) if operands else node
