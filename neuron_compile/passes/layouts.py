"""Pass (ATen graph -> runtime): which graph inputs the matmuls want in column-major layout.

Input: an aot_autograd ATen graph. Output: the indices of the placeholders that are weights read only through a
transpose feeding a matmul (``linear`` becomes ``mm(x, t(w))`` / ``addmm(b, x, t(w))``), or only as the weight of
a convolution that is a matmul (not transposed, more than one input channel per group).

Why: ``nc_matmul`` contracts over partitions, so both operands need K on partitions. ``x @ w.T`` with ``w`` stored
[N, K] row-major has K contiguous, and every call would bring the weight in through ``dma_transpose`` (90% of the
DMA rate) or a TensorE transpose. Given a column-major copy of ``w`` (the same shape and values, strides (1, N)),
the transpose is a [K, N] row-major tensor and each tile is a plain DMA with N contiguous. The copy is made once
per weight and version by runtime/weight_layouts.py; the layout decision is made here, once per graph, from the
graph alone. An input with any other use (an embedding gather of a tied weight, an output, an in-place update)
keeps its layout: the copy would slow that use down or leave the update on the copy.

A convolution's weight [Cout, Cin, *kernel] is the stationary operand, a^T [Cin on partitions, Cout]: stored as
given, each partition's Cout elements are Cin * positions apart, one DMA burst per element. Its copy has the
output channels innermost (dim 0's stride 1, as a column-major matrix), so each row of a^T is one contiguous run.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

_TRANSPOSES = (aten.t.default, aten.permute.default, aten.transpose.int)
# matmul op -> the argument position of its right-hand operand (the [K, N] one)
_RIGHT_OPERAND = {aten.mm.default: 1, aten.addmm.default: 2}


def _is_2d_transpose(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    if node.target == aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target == aten.transpose.int:
        return sorted(dim % 2 for dim in node.args[1:3]) == [0, 1]
    return True


def _feeds_matmuls_only(transpose: torch.fx.Node) -> bool:
    """Every user of ``transpose`` reads it as a matmul's right-hand operand, and nothing else."""
    for user in transpose.users:
        position = _RIGHT_OPERAND.get(user.target) if user.op == "call_function" else None
        if position is None or user.args[position] is not transpose:
            return False
        if any(arg is transpose for index, arg in enumerate(user.args) if index != position):
            return False
    return bool(transpose.users)


def _is_matmul_convolution_weight(weight: torch.fx.Node, user: torch.fx.Node) -> bool:
    """``user`` is a convolution lowered as a matmul (not transposed, K = input channels per group > 1) that reads
    ``weight`` as its weight and nowhere else."""
    if user.op != "call_function" or user.target != aten.convolution.default:
        return False
    if user.args[1] is not weight or any(arg is weight for index, arg in enumerate(user.args) if index != 1):
        return False
    return not user.args[6] and weight.meta["val"].shape[1] > 1


def column_major_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Indices of the placeholders of ``gm`` that every use reads as the transposed right operand of a matmul, or
    as the weight of a convolution that is a matmul."""
    chosen = []
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or not node.users:
            continue
        if not all(isinstance(size, int) for size in value.shape) or value.shape[0] == 1 or value.numel() == 0:
            continue  # a symbolic size is an activation's; one row has no layout to choose
        if value.dim() == 2 and min(value.shape) > 1 and all(
                _is_2d_transpose(user) and _feeds_matmuls_only(user) for user in node.users):
            chosen.append(index)
        elif value.dim() > 2 and all(_is_matmul_convolution_weight(node, user) for user in node.users):
            chosen.append(index)
    return tuple(chosen)
