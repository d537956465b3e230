"""Kernel kind ``pointwise``: elementwise math over one domain (``ir.Pointwise``), and the epilogue rule.

Fusion: a pointwise consumer joins its producer's group when it reads the producer with its own index map over
the same domain (a chain). Tiling: the output as [rows, cols] (rows on partitions in chunks of 128, cols in free
chunks sized to the SBUF share); a long last dim is split by a divisor so rows fill the partitions. Codegen: per
tile one DMA per input through its access pattern, the expression body, one DMA per store (pointwise.py.j2).
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir
from neuron_compile.codegen.expressions import TileAllocator, TileScope
from neuron_compile.codegen.kernel_text import Patterns, kernel_context, kernel_names, render_template, store_lines
from neuron_compile.dims import LoopDim, collapse
from neuron_compile.kind_registry import register_kind
from neuron_compile.kinds.fusion_rules import MatchingIndexEpilogue
from neuron_compile.tiles import TilePlan, count_tiles, free_tile, largest_divisor_at_most


def plan_pointwise(node: ir.Pointwise, target) -> TilePlan:
    layouts = [store.layout for store in node.stores]
    layouts += [layout for store in node.stores for layout in ir.access_layouts(store.expr)]
    dims = collapse(node.domain, list(range(len(node.domain))), layouts)
    if not dims:
        dims = [LoopDim(1, None)]
    if len(dims) == 1 or dims[-2].size < target.partitions <= dims[-1].size:
        # One long dim, or a short one before a long one (8 heads before 128 x 128 scores): split the long one
        # so that rows fill the partitions (a divisor keeps the split exact); the short dim becomes a loop.
        last = dims[-1]
        rows = largest_divisor_at_most(last.size, target.partitions)
        cols = last.size // rows
        if len(dims) == 1 or rows > dims[-2].size:
            split = [LoopDim(rows, last.source, cols * last.multiplier), LoopDim(cols, last.source, last.multiplier)]
            dims = [*dims[:-1], *split]
    tiles = count_tiles([store.expr for store in node.stores])
    partition = dataclasses.replace(dims[-2], tile=min(dims[-2].size, target.partitions))
    free = dataclasses.replace(dims[-1], tile=free_tile(dims[-1].size, tiles, target))
    return TilePlan("pointwise", tuple(dims[:-2]), partition, (free,), tiles)


def pointwise_body(node: ir.Pointwise, plan: TilePlan, allocator: TileAllocator) -> list[str]:
    """The lines of one [rows, cols] tile: loads, the expressions, the stores (concat parts reuse it)."""
    patterns = Patterns(plan)
    free = [(plan.free[0], "cols")]

    def load_pattern(load: ir.Load, tile: str):
        return f"{tile}[0:rows, 0:cols]", patterns.hbm(load.buffer, load.layout, free, True)

    def vector_pattern(load: ir.Load, tile: str):
        if plan.free[0].stride(load.layout) != 0:
            return None
        return f"{tile}[0:rows, 0:1]", patterns.hbm(load.buffer, load.layout, [(LoopDim(1, None), "1")], False)

    scope = TileScope(allocator, plan.free[0].tile, "[0:rows, 0:cols]", load_pattern, vector_pattern=vector_pattern)
    body: list[str] = []
    store_lines(node.stores, scope, patterns, free, True, body)
    return body


class PointwiseKind(MatchingIndexEpilogue):
    node_type = ir.Pointwise
    name = "pointwise"
    elementwise = True
    holds_random = True

    def plan(self, node, target):
        return plan_pointwise(node, target)

    def render(self, node, plan, name, parameters):
        allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
        body = pointwise_body(node, plan, allocator)
        context = kernel_context(node, plan, name, parameters, allocations=allocator.lines, body=body)
        return render_template("pointwise.py.j2", **context)


register_kind(PointwiseKind())
