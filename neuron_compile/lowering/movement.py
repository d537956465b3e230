"""Lowering stage, movement family: views cost no kernel; cat becomes a copy kernel.

Input: an ATen FX node. Output: for view ops, a ``TensorValue`` that reads the producer's buffer through the
node's own sizes, strides and storage offset (from ``meta["val"]``: that is exactly an NKI access pattern);
clone is a pointwise copy (pointwise.py); cat is an ``ir.Concat``, one copy loop per input into its slice.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.lowering.registry import TensorValue, register_lowering

aten = torch.ops.aten

VIEW_OPS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.alias.default,
)


RESHAPES = (aten.reshape.default, aten._unsafe_view.default)


def _check_view(node: torch.fx.Node) -> str | None:
    # A reshape of a non-contiguous tensor may copy; its result then owns new storage that we cannot view.
    source = node.args[0].meta.get("val")
    if source is None:
        return f"{node.target}: its input has no meta['val']"
    if node.target in RESHAPES and not source.is_contiguous():
        return f"{node.target}: a reshape of a non-contiguous tensor needs a copy"
    return None


def _offset_delta(node: torch.fx.Node, base: ir.Layout) -> int:
    """Elements a slice or select moves the start by (meta['val'] storage offsets are not reliable: tracing
    may fakeify every intermediate on its own storage)."""
    if node.target is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        dim %= len(base.shape)
        start = 0 if start is None else start
        start = max(0, min(start + base.shape[dim] if start < 0 else start, base.shape[dim]))
        return start * base.strides[dim]
    if node.target is aten.select.int:
        dim, index = node.args[1] % len(base.shape), node.args[2]
        return (index % base.shape[dim]) * base.strides[dim]
    return 0


@register_lowering(*VIEW_OPS, check=_check_view)
def lower_view(ctx, node):
    base = ctx.value(node.args[0])
    result = node.meta["val"]
    if node.target not in RESHAPES:
        offset = base.layout.offset + _offset_delta(node, base.layout)
        return TensorValue(base.buffer, ir.Layout(tuple(result.shape), tuple(result.stride()), offset), base.dtype)
    # A reshape of a contiguous tensor: the same elements with contiguous strides, whatever storage tracing gave.
    layout = ir.Layout(tuple(result.shape), ir.contiguous_strides(tuple(result.shape)), base.layout.offset)
    return TensorValue(base.buffer, layout, base.dtype)


@register_lowering(aten.cat.default)
def lower_cat(ctx, node):
    tensors = node.args[0]
    output = ctx.output_buffer(node, "cat")
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(output.layout.shape)
    parts, start = [], 0
    for tensor in tensors:
        value = ctx.value(tensor)
        shape = value.layout.shape
        if 0 in shape:  # contributes nothing (also the legacy 1-D empty tensor cat accepts)
            continue
        # The part's slice of the output: the output's strides, moved ``start`` along the cat dim.
        target = ir.Layout(shape, output.layout.strides, output.layout.offset + start * output.layout.strides[dim])
        source = ir.Load(value.buffer, value.layout, value.dtype)
        parts.append(ir.Pointwise(ctx.fresh_name("part"), shape, (ir.Store(output, source, target),)))
        start += shape[dim]
    ctx.emit(ir.Concat(ctx.fresh_name("kernel"), output.layout.shape, tuple(parts), output))
    return TensorValue(output.name, output.layout, output.dtype)
