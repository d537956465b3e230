"""Lowering stage, convolution family: aten.convolution (conv1d / conv2d / conv3d; transposed convolutions decline).

Input: an ATen FX node. Output: a zero-padded copy of the input when there is padding (pooling's padded copy),
then one ``ir.MatMul`` per kernel position: for position ``kk``, every output element gets

    sum_ci weight[g * Cout/G + co, ci, kk] * x_padded[n, g * Cin/G + ci, o * stride + kk * dilation]

which is a batched matmul with batch dims (*n, g, *out[:-1]), M = Cout/G, K = Cin/G, N = out[-1]: the
weight slice and the shifted input are both plain access patterns (im2col without a copy). Each matmul's
epilogue adds the previous position's partial sum (an fp32 scratch buffer, as eager accumulates in fp32) — the
first adds the bias — and the last stores the result in the output's layout and dtype.
"""

from __future__ import annotations

import itertools
import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.movement import padded_copy
from neuron_compile.lowering.registry import TensorValue, register_lowering

aten = torch.ops.aten

# Kernel positions, one matmul kernel each: beyond this the graph of kernels gets long for little gain.
MAX_KERNEL_POSITIONS = 64


def _check_convolution(node: torch.fx.Node) -> str | None:
    source, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args[:9]
    x, w = source.meta["val"], weight.meta["val"]
    if transposed:
        return f"{node.target}: transposed convolution"
    if x.dtype != w.dtype or (bias is not None and bias.meta["val"].dtype != x.dtype):
        return f"{node.target}: mixed dtypes (nc_matmul needs both operands fp32 or both bf16)"
    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtype {x.dtype}"
    dims = w.dim() - 2
    if x.dim() not in (dims + 1, dims + 2) or not isinstance(groups, int):
        return f"{node.target}: input rank {x.dim()} for a {dims}-d kernel"
    if any(not isinstance(v, int) for v in (*stride, *padding, *dilation)) or min(padding, default=0) < 0:
        return f"{node.target}: stride {stride}, padding {padding}, dilation {dilation}"
    positions = math.prod(w.shape[2:])
    if positions > MAX_KERNEL_POSITIONS:
        return f"{node.target}: {positions} kernel positions (one matmul kernel each, limit {MAX_KERNEL_POSITIONS})"
    return None


@register_lowering(aten.convolution.default, check=_check_convolution)
def lower_convolution(ctx, node):
    source_arg, weight_arg, bias_arg, stride, padding, dilation, _, _, groups = node.args[:9]
    source, weight = ctx.value(source_arg), ctx.value(weight_arg)
    w_shape = weight.layout.shape
    dims = len(w_shape) - 2
    stride, padding, dilation = (list(v) * dims if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    lead = source.layout.shape[:-dims - 1]  # (n,) or () for an unbatched input
    channels, sizes = source.layout.shape[-dims - 1], list(source.layout.shape[-dims:])
    out = ctx.output_buffer(node, "convolution")
    outs = list(out.layout.shape[-dims:])
    kernel = list(w_shape[2:])
    out_per_group, in_per_group = w_shape[0] // groups, w_shape[1]

    if any(padding):
        totals = [n + 2 * p for n, p in zip(sizes, padding)]
        padded = padded_copy(ctx, source, (*lead, channels), sizes, padding, totals, source.dtype)
        data = ir.Load(padded.name, padded.layout, padded.dtype)
    else:
        data = ir.Load(source.buffer, source.layout, source.dtype)
    x_lead = data.layout.strides[:len(lead)]
    x_channel, x_spatial = data.layout.strides[len(lead)], data.layout.strides[len(lead) + 1:]
    w_out, w_in, *w_spatial = weight.layout.strides
    o_lead = out.layout.strides[:len(lead)]
    o_channel, o_spatial = out.layout.strides[len(lead)], out.layout.strides[len(lead) + 1:]

    batch = (*lead, groups, *outs[:-1])
    domain = (*batch, out_per_group, outs[-1])
    zeros_lead, zeros_out = (0,) * len(lead), (0,) * (dims - 1)
    # Output (*n, g, *out[:-1], co, out[-1]) in the output buffer; the bias per output channel.
    store_layout = ir.Layout(domain, (*o_lead, out_per_group * o_channel, *o_spatial[:-1], o_channel, o_spatial[-1]),
                             out.layout.offset)
    partial = None
    positions = list(itertools.product(*(range(k) for k in kernel)))
    for index, position in enumerate(positions):
        a_offset = weight.layout.offset + sum(p * s for p, s in zip(position, w_spatial))
        a = ir.Load(weight.buffer, ir.Layout((*batch, out_per_group, in_per_group),
                                             (*zeros_lead, out_per_group * w_out, *zeros_out, w_out, w_in), a_offset),
                    weight.dtype)
        b_offset = data.layout.offset + sum(p * d * s for p, d, s in zip(position, dilation, x_spatial))
        b_out = [st * s for st, s in zip(stride, x_spatial)]
        b = ir.Load(data.buffer, ir.Layout((*batch, in_per_group, outs[-1]),
                                           (*x_lead, in_per_group * x_channel, *b_out[:-1], x_channel, b_out[-1]),
                                           b_offset), data.dtype)
        expr = ir.Result()
        if partial is not None:
            expr = ir.Op("add", (expr, ir.Load(partial.name, partial.layout, partial.dtype)))
        elif bias_arg is not None:
            bias = ctx.value(bias_arg)
            (bias_stride,) = bias.layout.strides
            bias_layout = ir.Layout(domain, (*zeros_lead, out_per_group * bias_stride, *zeros_out, bias_stride, 0),
                                    bias.layout.offset)
            expr = ir.Op("add", (expr, ir.Load(bias.buffer, bias_layout, bias.dtype)))
        if index == len(positions) - 1:
            store = ir.Store(out, expr, store_layout)
        else:
            partial = ctx.scratch_buffer(domain, "float32", "conv_partial")
            store = ir.Store(partial, expr, partial.layout)
        ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, in_per_group, a, b, (store,)))
    return TensorValue(out.name, out.layout, out.dtype)
