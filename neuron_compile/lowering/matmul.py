"""Lowering stage, matmul family: mm, bmm, addmm (linear arrives as addmm / mm after decomposition).

Input: an ATen FX node. Output: one ``ir.MatMul`` over (batch, M, N); addmm's ``beta * bias + alpha * a @ b``
is its epilogue store expression.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.lowering.registry import TensorValue, broadcast_layout, register_lowering

aten = torch.ops.aten


def _batched(layout: ir.Layout) -> ir.Layout:
    """A 2-D layout as a 3-D one with a size-1, stride-0 batch dim."""
    if len(layout.shape) == 3:
        return layout
    return ir.Layout((1, *layout.shape), (0, *layout.strides), layout.offset)


def _check_matmul(node: torch.fx.Node) -> str | None:
    a, b = (arg.meta["val"] for arg in node.args[-2:])
    if a.dtype != b.dtype:
        return f"{node.target}: mixed operand dtypes {a.dtype} and {b.dtype} (nc_matmul needs both fp32 or both bf16)"
    if a.dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtype {a.dtype}"
    return None


def _emit_matmul(ctx, node, a_arg, b_arg, epilogue) -> TensorValue:
    a, b = ctx.value(a_arg), ctx.value(b_arg)
    buffer = ctx.output_buffer(node, "matmul")
    a_layout, b_layout = _batched(a.layout), _batched(b.layout)
    batch, m, k = a_layout.shape
    n = b_layout.shape[2]
    domain = (batch, m, n)
    store = ir.Store(buffer, epilogue(domain), _batched(buffer.layout))
    node_ir = ir.MatMul(
        ctx.fresh_name("kernel"), domain, k, ir.Load(a.buffer, a_layout, a.dtype), ir.Load(b.buffer, b_layout, b.dtype),
        (store,),
    )
    ctx.emit(node_ir)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


@register_lowering(aten.mm.default, aten.bmm.default, check=_check_matmul)
def lower_mm(ctx, node):
    return _emit_matmul(ctx, node, node.args[0], node.args[1], lambda domain: ir.Result())


@register_lowering(aten.addmm.default, check=_check_matmul)
def lower_addmm(ctx, node):
    bias = ctx.value(node.args[0])
    beta, alpha = float(node.kwargs.get("beta", 1)), float(node.kwargs.get("alpha", 1))

    def epilogue(domain):
        bias_load = ir.Load(bias.buffer, broadcast_layout(bias.layout, domain), bias.dtype)
        product = ir.Result() if alpha == 1 else ir.Op("mul", (ir.Result(), ir.Scalar(alpha)))
        scaled_bias = bias_load if beta == 1 else ir.Op("mul", (bias_load, ir.Scalar(beta)))
        return ir.Op("add", (product, scaled_bias))

    return _emit_matmul(ctx, node, node.args[1], node.args[2], epilogue)
