"""Lowering stage, creation family: tensors whose contents eager leaves uninitialized (empty, empty_like, ...).

Input: an ATen FX node (aten.empty.memory_format, aten.empty_permuted, aten.empty_strided, aten.new_empty,
aten.new_empty_strided). Output: a ``TensorValue`` over a fresh HBM buffer with exactly eager's sizes and strides
(from the node's fake value) and no instructions: eager's memory is uninitialized, and the region NaN-fills
buffers no kernel writes, as the simulator does for every new buffer. A later kernel that writes the buffer
(a copy or fill into it) is lowered as its own node.
"""

from __future__ import annotations

import torch

from neuron_compile.lowering.registry import TensorValue, register_lowering

aten = torch.ops.aten


def _check_empty(node: torch.fx.Node) -> str | None:
    meta = node.meta["val"]
    if meta.layout is not torch.strided:  # sparse or mkldnn layouts have no flat HBM form
        return f"{node.target}: layout {meta.layout}"
    return None


@register_lowering(
    aten.empty.memory_format,
    aten.empty_permuted.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    check=_check_empty,
)
def lower_empty(ctx, node):
    buffer = ctx.output_buffer(node, "empty")
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)
