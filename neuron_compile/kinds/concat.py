"""Kernel kind ``concat``: every input copied into its slice of one output buffer (``ir.Concat``, aten.cat).

One kernel writes the whole output (a buffer has one writer). Fusion: none (a concat takes no epilogue).
Tiling: one pointwise plan per part. Codegen: the parts' pointwise bodies one after the other, with fresh tiles
per iteration (concat.py.j2).
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir
from neuron_compile.codegen.expressions import TileAllocator
from neuron_compile.codegen.kernel_text import kernel_context, kernel_names, render_template
from neuron_compile.dims import LoopDim
from neuron_compile.kind_registry import KernelKind, describe, register_kind
from neuron_compile.kinds.pointwise import plan_pointwise, pointwise_body
from neuron_compile.tiles import TilePlan


class ConcatKind(KernelKind):
    node_type = ir.Concat
    name = "concat"
    refusal = "a concat kernel takes no epilogue"

    def exprs(self, node):
        return [store.expr for part in node.parts for store in part.stores]

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
        return node if node.output.name in needed else None

    def plan(self, node, target):
        parts = tuple(plan_pointwise(part, target) for part in node.parts)
        synthetic = LoopDim(1, None)
        tiles = max(part.tiles_per_iteration for part in parts)
        return TilePlan("concat", (), synthetic, (synthetic,), tiles, parts=parts)

    def render(self, node, plan, name, parameters):
        parts, count = [], 0
        for part, part_plan in zip(node.parts, plan.parts):
            allocator = TileAllocator(part_plan.partition.tile, reserved=kernel_names(node, parameters))
            allocator.count = count  # distinct tile names across parts
            body = pointwise_body(part, part_plan, allocator)
            count = allocator.count
            parts.append(dict(plan=part_plan, body=body, allocations=allocator.lines, depth=len(part_plan.outer) + 1))
        context = kernel_context(node, plan, name, parameters, allocations=[], parts=parts)
        return render_template("concat.py.j2", **context)


register_kind(ConcatKind())
