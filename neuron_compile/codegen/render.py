"""Codegen stage: a fused IR node and its TilePlan -> the source text of one standalone NKI kernel module.

Input: ``ir.Node``, ``TilePlan``, the kernel's name and its HBM input buffers. Output: ``KernelSource`` (name,
source, parameter buffer names, output buffers). The node's kernel kind renders it (``neuron_compile.kinds``,
each from its jinja2 template through the helpers in ``codegen/kernel_text.py``).
"""

from __future__ import annotations

from neuron_compile import ir, kinds
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.tiles import TilePlan

__all__ = ["KernelSource", "render_kernel"]


def render_kernel(node: ir.Node, plan: TilePlan, name: str, parameters: list[str]) -> KernelSource:
    source = kinds.kind_of(node).render(node, plan, name, parameters)
    return KernelSource(name, source, tuple(parameters), tuple(store.buffer for store in kinds.stores(node)))
