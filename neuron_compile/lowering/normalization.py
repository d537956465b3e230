"""Lowering stage, normalization family: aten.native_layer_norm (kept whole by the front end's decompositions).

Input: an ATen FX node. Output: three IR nodes — the row mean (a Reduction), the row rstd (a biased-variance
Reduction with ``rsqrt(var + eps)`` as its epilogue) and the normalize-and-affine Pointwise that reads both
broadcast along the normalized dims — and the (out, mean, rstd) tuple that getitem nodes pick from.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.lowering.reduction import store_layout_in_domain
from neuron_compile.lowering.registry import TensorValue, broadcast_layout, load, register_lowering

aten = torch.ops.aten


def _check_layer_norm(node: torch.fx.Node) -> str | None:
    if not isinstance(node.args[4] if len(node.args) > 4 else None, (int, float)):
        return f"{node.target}: eps is not a number"
    return None


@register_lowering(aten.native_layer_norm.default, check=_check_layer_norm, multi_output=True)
def lower_layer_norm(ctx, node):
    source, normalized_shape, weight, bias, eps = node.args[:5]
    domain = ctx.value(source).layout.shape
    reduce_dims = tuple(range(len(domain) - len(normalized_shape), len(domain)))
    out_meta, mean_meta, rstd_meta = node.meta["val"]
    mean, rstd, out = ctx.new_buffer(mean_meta, "mean"), ctx.new_buffer(rstd_meta, "rstd"), ctx.new_buffer(
        out_meta, "layer_norm"
    )
    prologue = load(ctx, source, domain)

    def row_store(buffer, expr):
        return ir.Store(buffer, expr, store_layout_in_domain(buffer.layout, domain, reduce_dims))

    # The normalize step reads fp32 copies of the statistics: with bf16 outputs, x - round(mean) would cancel
    # catastrophically on near-constant rows (eager keeps them in fp32 internally too).
    row_shape = tuple(1 if dim in reduce_dims else size for dim, size in enumerate(domain))
    mean_fp32, rstd_fp32 = (ctx.scratch_buffer(row_shape, "float32", stem) for stem in ("mean_fp32", "rstd_fp32"))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "mean", prologue,
                          (row_store(mean, ir.Result()), row_store(mean_fp32, ir.Result()))))
    inverse_std = ir.Op("rsqrt", (ir.Op("add", (ir.Result(), ir.Scalar(float(eps)))),))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "var", prologue,
                          (row_store(rstd, inverse_std), row_store(rstd_fp32, inverse_std)), correction=0.0))

    def broadcast(buffer):
        return ir.Load(buffer.name, broadcast_layout(buffer.layout, domain), buffer.dtype)

    normalized = ir.Op("mul", (ir.Op("sub", (prologue, broadcast(mean_fp32))), broadcast(rstd_fp32)))
    if weight is not None:
        normalized = ir.Op("mul", (normalized, load(ctx, weight, domain)))
    if bias is not None:
        normalized = ir.Op("add", (normalized, load(ctx, bias, domain)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (ir.Store(out, normalized, out.layout),)))
    return tuple(TensorValue(buffer.name, buffer.layout, buffer.dtype) for buffer in (out, mean, rstd))


def _check_layer_norm_backward(node: torch.fx.Node) -> str | None:
    weight = node.args[5]
    mask = node.args[7]
    if weight is None and mask[1]:
        return f"{node.target}: a weight gradient without a weight"
    return None


@register_lowering(aten.native_layer_norm_backward.default, check=_check_layer_norm_backward, multi_output=True)
def lower_layer_norm_backward(ctx, node):
    """grad_input = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = grad * weight, xhat = (x - mean) * rstd;
    grad_weight = sum(grad * xhat) and grad_bias = sum(grad) over the leading (batch) dims."""
    grad_arg, source, normalized_shape, mean_arg, rstd_arg, weight, bias, output_mask = node.args[:8]
    domain = ctx.value(source).layout.shape
    rank = len(domain)
    normalized = tuple(range(rank - len(normalized_shape), rank))
    leading = tuple(range(rank - len(normalized_shape)))
    grad, x = load(ctx, grad_arg, domain), load(ctx, source, domain)
    xhat = ir.Op("mul", (ir.Op("sub", (x, load(ctx, mean_arg, domain))), load(ctx, rstd_arg, domain)))
    scaled = ir.Op("mul", (grad, load(ctx, weight, domain))) if weight is not None else grad
    row_shape = tuple(1 if dim in normalized else size for dim, size in enumerate(domain))

    def row_mean(prologue, stem):
        # fp32 row statistics, as eager's kernel keeps them
        buffer = ctx.scratch_buffer(row_shape, "float32", stem)
        store = ir.Store(buffer, ir.Result(), store_layout_in_domain(buffer.layout, domain, normalized))
        ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, normalized, "mean", prologue, (store,)))
        return ir.Load(buffer.name, broadcast_layout(buffer.layout, domain), "float32")

    outputs = [None, None, None]
    out_metas = node.meta["val"]
    if output_mask[0]:
        mean_scaled = row_mean(scaled, "mean_grad")
        mean_scaled_xhat = row_mean(ir.Op("mul", (scaled, xhat)), "mean_grad_xhat")
        centered = ir.Op("sub", (ir.Op("sub", (scaled, mean_scaled)), ir.Op("mul", (xhat, mean_scaled_xhat))))
        grad_input = ctx.new_buffer(out_metas[0], "grad_input")
        expr = ir.Op("mul", (load(ctx, rstd_arg, domain), centered))
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (ir.Store(grad_input, expr, grad_input.layout),)))
        outputs[0] = grad_input
    for index, prologue, stem in ((1, ir.Op("mul", (grad, xhat)), "grad_weight"), (2, grad, "grad_bias")):
        if output_mask[index]:
            buffer = ctx.new_buffer(out_metas[index], stem)
            store = ir.Store(buffer, ir.Result(), store_layout_in_domain(buffer.layout, domain, leading))
            ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, leading, "sum", prologue, (store,)))
            outputs[index] = buffer
    return tuple(None if b is None else TensorValue(b.name, b.layout, b.dtype) for b in outputs)
