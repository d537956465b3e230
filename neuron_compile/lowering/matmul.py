"""Lowering stage, matmul family: mm, bmm, addmm (linear arrives as addmm / mm after decomposition), addmv,
addbmm.

Input: an ATen FX node. Output: one ``ir.MatMul`` over (batch, M, N); addmm's ``beta * bias + alpha * a @ b``
is its epilogue store expression. addmv is an addmm with the vector read as an (M, 1) column; addbmm is a bmm
into an fp32 scratch buffer and a Reduction over the batch dim whose epilogue adds ``beta * self``.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.lowering.reduction import store_layout_in_domain
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


def _scaled_sum(product: ir.Expr, bias_load: ir.Expr, beta: float, alpha: float) -> ir.Expr:
    """``beta * bias + alpha * product``; beta = 0 drops the bias entirely (eager ignores it: nan and inf too)."""
    product = product if alpha == 1 else ir.Op("mul", (product, ir.Scalar(alpha)))
    if beta == 0:
        return product
    scaled_bias = bias_load if beta == 1 else ir.Op("mul", (bias_load, ir.Scalar(beta)))
    return ir.Op("add", (product, scaled_bias))


def _check_scaled_matmul(node: torch.fx.Node) -> str | None:
    for name in ("beta", "alpha"):
        if not isinstance(node.kwargs.get(name, 1), (int, float)) or isinstance(node.kwargs.get(name, 1), bool):
            return f"{node.target}: {name}={node.kwargs.get(name)!r} is not a real number"
    return _check_matmul(node)


@register_lowering(aten.addmm.default, check=_check_scaled_matmul)
def lower_addmm(ctx, node):
    bias = ctx.value(node.args[0])
    beta, alpha = float(node.kwargs.get("beta", 1)), float(node.kwargs.get("alpha", 1))

    def epilogue(domain):
        bias_load = ir.Load(bias.buffer, broadcast_layout(bias.layout, domain), bias.dtype)
        return _scaled_sum(ir.Result(), bias_load, beta, alpha)

    return _emit_matmul(ctx, node, node.args[1], node.args[2], epilogue)


@register_lowering(aten.addmv.default, check=_check_scaled_matmul)
def lower_addmv(ctx, node):
    """beta * self + alpha * mat @ vec, with vec read as an (M, 1) column and the result stored as (N, 1)."""
    bias, mat, vec = (ctx.value(arg) for arg in node.args[:3])
    beta, alpha = float(node.kwargs.get("beta", 1)), float(node.kwargs.get("alpha", 1))
    buffer = ctx.output_buffer(node, "addmv")
    rows, k = mat.layout.shape
    domain = (1, rows, 1)
    (out_stride,) = buffer.layout.strides
    (vec_stride,) = vec.layout.strides
    bias_layout = broadcast_layout(bias.layout, (rows,))
    bias_load = ir.Load(bias.buffer, ir.Layout(domain, (0, bias_layout.strides[0], 0), bias_layout.offset), bias.dtype)
    store = ir.Store(buffer, _scaled_sum(ir.Result(), bias_load, beta, alpha), ir.Layout(domain, (0, out_stride, 0)))
    column = ir.Layout((1, k, 1), (0, vec_stride, 0), vec.layout.offset)
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, k, ir.Load(mat.buffer, _batched(mat.layout), mat.dtype),
                       ir.Load(vec.buffer, column, vec.dtype), (store,)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


@register_lowering(aten.addbmm.default, check=_check_scaled_matmul)
def lower_addbmm(ctx, node):
    """beta * self + alpha * sum_b batch1[b] @ batch2[b]: the products stay fp32 in a scratch buffer (eager
    accumulates in fp32 too), summed over b by a Reduction whose store is the epilogue."""
    bias, batch1, batch2 = (ctx.value(arg) for arg in node.args[:3])
    beta, alpha = float(node.kwargs.get("beta", 1)), float(node.kwargs.get("alpha", 1))
    batch, rows, k = batch1.layout.shape
    cols = batch2.layout.shape[2]
    domain = (batch, rows, cols)
    products = ctx.scratch_buffer(domain, "float32", "products")
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, k, ir.Load(batch1.buffer, batch1.layout, batch1.dtype),
                       ir.Load(batch2.buffer, batch2.layout, batch2.dtype),
                       (ir.Store(products, ir.Result(), products.layout),)))
    buffer = ctx.output_buffer(node, "addbmm")
    store_layout = store_layout_in_domain(buffer.layout, domain, (0,))
    bias_layout = broadcast_layout(bias.layout, (rows, cols))
    bias_load = ir.Load(bias.buffer, ir.Layout(domain, (0, *bias_layout.strides), bias_layout.offset), bias.dtype)
    store = ir.Store(buffer, _scaled_sum(ir.Result(), bias_load, beta, alpha), store_layout)
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, (0,), "sum",
                          ir.Load(products.name, products.layout, "float32"), (store,)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)
