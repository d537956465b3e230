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

    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "mean", prologue,
                          (row_store(mean, ir.Result()),)))
    inverse_std = ir.Op("rsqrt", (ir.Op("add", (ir.Result(), ir.Scalar(float(eps)))),))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "var", prologue,
                          (row_store(rstd, inverse_std),), correction=0.0))

    def broadcast(buffer):
        return ir.Load(buffer.name, broadcast_layout(buffer.layout, domain), buffer.dtype)

    normalized = ir.Op("mul", (ir.Op("sub", (prologue, broadcast(mean))), broadcast(rstd)))
    if weight is not None:
        normalized = ir.Op("mul", (normalized, load(ctx, weight, domain)))
    if bias is not None:
        normalized = ir.Op("add", (normalized, load(ctx, bias, domain)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (ir.Store(out, normalized, out.layout),)))
    return tuple(TensorValue(buffer.name, buffer.layout, buffer.dtype) for buffer in (out, mean, rstd))
