"""Lowering stage, convolution family: aten.convolution (conv1d / conv2d / conv3d; transposed convolutions decline).

Input: an ATen FX node. Output: a zero-padded copy of the input when there is padding (pooling's padded copy),
then one implicit-GEMM ``ir.MatMul`` (``shifts``: a term per kernel position): every output element gets

    sum_kk sum_ci weight[g * Cout/G + co, ci, kk] * x_padded[n, g * Cin/G + ci, o * stride + kk * dilation]

which for one position ``kk`` is a batched matmul with M = Cout/G, K = Cin/G: the weight slice and the shifted
input are both plain access patterns (im2col without a copy), and the positions are the terms, all accumulated in
PSUM (fp32, as eager accumulates) with the bias added once in the epilogue. With stride 1 (every layer of a VAE
decoder but its downsamplers) the rows are computed as wide as the padded input's: output (r, c) reads input
element r * row + c, so all the output rows are one column range (N = out rows * input row), each position is a
column shift of it (the kernel loads the input once per window of shifts), and a copy keeps the valid columns.
Strided convolutions batch over output rows: batch dims (*n, g, *out[:-1]), N = out[-1]. A depthwise convolution
(one input channel per group, K = 1) is one pointwise kernel instead: the positions' shifted inputs times their
weights, summed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.movement import padded_copy
from neuron_compile.lowering.registry import TensorValue, register_lowering

aten = torch.ops.aten

# Kernel positions, the terms of one implicit-GEMM matmul: each keeps its a^T chunks resident in SBUF.
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
        return (f"{node.target}: {positions} kernel positions (the terms of one matmul, each with its weight slice "
                f"resident; limit {MAX_KERNEL_POSITIONS})")
    return None


@dataclasses.dataclass(frozen=True)
class PositionMatmuls:
    """How each kernel position's term of the matmul walks the input and the output: batch dims (*n, g, *rows) with
    M = Cout/G, K = Cin/G and N columns; strides of the lead dims and the row dims on each side, and of one column."""

    lead: tuple[int, ...]
    rows: tuple[int, ...]
    columns: int
    input: ir.Load  # only its buffer, offset and dtype are used; strides below
    input_strides: tuple[int, ...]  # (*lead, channel, *rows, column)
    output: ir.Buffer
    output_offset: int
    output_strides: tuple[int, ...]  # (*lead, channel, *rows, column)


@register_lowering(aten.convolution.default, check=_check_convolution)
def lower_convolution(ctx, node):
    source_arg, weight_arg, bias_arg, stride, padding, dilation, _, _, groups = node.args[:9]
    source, weight = ctx.value(source_arg), ctx.value(weight_arg)
    dims = len(weight.layout.shape) - 2
    stride, padding, dilation = (list(v) * dims if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    out = ctx.output_buffer(node, "convolution")
    bias = ctx.value(bias_arg) if bias_arg is not None else None
    if weight.layout.shape[1] == 1:
        _depthwise_convolution(ctx, source, weight, bias, out, stride, padding, dilation, groups)
        return TensorValue(out.name, out.layout, out.dtype)
    if dims > 1 and all(s == 1 for s in stride):
        plan, wide = _wide_row_plan(ctx, source, weight, out, padding, dilation)
    else:
        plan, wide = _row_plan(ctx, source, out, stride, padding), None
    _accumulate_positions(ctx, plan, weight, bias, dilation, groups)
    if wide is not None:  # the valid columns of the wide rows, in the output's layout
        view = ir.Layout(out.layout.shape, wide.layout.strides, 0)
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), out.layout.shape,
                              (ir.Store(out, ir.Load(wide.name, view, wide.dtype), out.layout),)))
    return TensorValue(out.name, out.layout, out.dtype)


def _padded_input(ctx, source: TensorValue, padding, slack_rows: int) -> ir.Load:
    """The input, zero-padded (and ``slack_rows`` more zero rows after the first spatial dim) when asked."""
    dims = len(padding)
    if not any(padding) and not slack_rows:
        return ir.Load(source.buffer, source.layout, source.dtype)
    lead, sizes = tuple(source.layout.shape[:-dims]), list(source.layout.shape[-dims:])
    totals = [n + 2 * p for n, p in zip(sizes, padding)]
    totals[0] += slack_rows
    padded = padded_copy(ctx, source, lead, sizes, padding, totals, source.dtype)
    return ir.Load(padded.name, padded.layout, padded.dtype)


def _row_plan(ctx, source: TensorValue, out: ir.Buffer, stride, padding) -> PositionMatmuls:
    """Batched over output rows: batch (*n, g, *out[:-1]), N = out[-1], a strided row of the (padded) input."""
    dims = len(stride)
    data = _padded_input(ctx, source, padding, slack_rows=0)
    spatial = data.layout.strides[-dims:]
    input_strides = (*data.layout.strides[:-dims], *(st * s for st, s in zip(stride, spatial)))
    outs = out.layout.shape[-dims:]
    return PositionMatmuls(out.layout.shape[:-dims - 1], tuple(outs[:-1]), outs[-1], data, input_strides,
                           out, out.layout.offset, out.layout.strides)


def _wide_row_plan(ctx, source: TensorValue, weight: TensorValue, out: ir.Buffer, padding, dilation):
    """Stride 1: each kernel position's term covers every output row at once. Output row r, column c reads input
    element r * row + c (+ the position's offset) of the contiguous (padded) input, so the rows are computed as wide
    as the input's (the columns past the output's width are never read back) and N = out rows * input row: a
    single stride. One zero row after the input keeps the last position's wide read inside the buffer. Returns the
    plan and the wide result buffer the valid columns are copied from (None when the rows are not wider)."""
    dims = len(padding)
    kernel = weight.layout.shape[2:]
    reaches_past = any((k - 1) * d for k, d in zip(kernel[1:], dilation[1:]))
    sizes = source.layout.shape[-dims:]
    contiguous_rows = source.layout.strides[-dims:] == ir.contiguous_strides(sizes)
    slack = 1 if reaches_past or not contiguous_rows else 0
    data = _padded_input(ctx, source, padding, slack_rows=slack)
    padded_sizes = data.layout.shape[-dims:]
    outs = out.layout.shape[-dims:]
    lead = out.layout.shape[:-dims - 1]
    columns = outs[0] * data.layout.strides[-dims]
    input_strides = (*data.layout.strides[:-dims], 1)
    if tuple(padded_sizes[1:]) == tuple(outs[1:]) and out.layout.strides[-dims:] == ir.contiguous_strides(outs):
        return PositionMatmuls(lead, (), columns, data, input_strides, out, out.layout.offset,
                               (*out.layout.strides[:-dims], 1)), None
    wide = ctx.scratch_buffer((*out.layout.shape[:-dims], outs[0], *padded_sizes[1:]), out.dtype, "wide_rows")
    return PositionMatmuls(lead, (), columns, data, input_strides, wide, 0,
                           (*wide.layout.strides[:-dims], 1)), wide


def _accumulate_positions(ctx, plan: PositionMatmuls, weight: TensorValue, bias: TensorValue | None, dilation,
                          groups: int) -> None:
    """One implicit-GEMM matmul: a term per kernel position, each reading the weight's slice for that position and
    the input shifted by it, all accumulated in PSUM; the epilogue adds the bias and stores into the plan's output."""
    w_shape = weight.layout.shape
    kernel = list(w_shape[2:])
    out_per_group, in_per_group = w_shape[0] // groups, w_shape[1]
    nlead, nrows = len(plan.lead), len(plan.rows)
    batch = (*plan.lead, groups, *plan.rows)
    domain = (*batch, out_per_group, plan.columns)
    zeros_lead, zeros_rows = (0,) * nlead, (0,) * nrows
    w_out, w_in, *w_spatial = weight.layout.strides
    x_lead, x_channel = plan.input_strides[:nlead], plan.input_strides[nlead]
    x_rows, x_column = plan.input_strides[nlead + 1:-1], plan.input_strides[-1]
    o_lead, o_channel = plan.output_strides[:nlead], plan.output_strides[nlead]
    o_rows, o_column = plan.output_strides[nlead + 1:-1], plan.output_strides[-1]
    store_layout = ir.Layout(domain, (*o_lead, out_per_group * o_channel, *o_rows, o_channel, o_column),
                             plan.output_offset)
    x_spatial = plan.input.layout.strides[-len(kernel):]  # a kernel position offsets the read by these
    a = ir.Load(weight.buffer, ir.Layout((*batch, out_per_group, in_per_group),
                                         (*zeros_lead, out_per_group * w_out, *zeros_rows, w_out, w_in),
                                         weight.layout.offset), weight.dtype)
    b = ir.Load(plan.input.buffer, ir.Layout((*batch, in_per_group, plan.columns),
                                             (*x_lead, in_per_group * x_channel, *x_rows, x_channel, x_column),
                                             plan.input.layout.offset), plan.input.dtype)
    positions = list(itertools.product(*(range(k) for k in kernel)))
    shifts = tuple((sum(p * s for p, s in zip(position, w_spatial)),
                    sum(p * d * s for p, d, s in zip(position, dilation, x_spatial))) for position in positions)
    expr = ir.Result()
    if bias is not None:
        (bias_stride,) = bias.layout.strides
        bias_layout = ir.Layout(domain, (*zeros_lead, out_per_group * bias_stride, *zeros_rows, bias_stride, 0),
                                bias.layout.offset)
        expr = ir.Op("add", (expr, ir.Load(bias.buffer, bias_layout, bias.dtype)))
    store = ir.Store(plan.output, expr, store_layout)
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, in_per_group, a, b, (store,),
                       shifts=shifts if len(shifts) > 1 else ()))


def _depthwise_convolution(ctx, source: TensorValue, weight: TensorValue, bias: TensorValue | None, out: ir.Buffer,
                           stride, padding, dilation, groups: int) -> None:
    """One input channel per group (depthwise, K = 1): a matmul per position would multiply 1 x 1 tiles, so the
    whole convolution is one pointwise kernel over (*n, g, Cout / G, *out): the sum over kernel positions of the
    shifted (padded) input times the position's weight, broadcast along the pixels, in fp32 as eager sums."""
    dims = len(stride)
    data = _padded_input(ctx, source, padding, slack_rows=0)
    outs = out.layout.shape[-dims:]
    lead = out.layout.shape[:-dims - 1]
    out_per_group = weight.layout.shape[0] // groups
    domain = (*lead, groups, out_per_group, *outs)
    zeros_lead, zeros_spatial = (0,) * len(lead), (0,) * dims
    x_strides = data.layout.strides
    x_spatial = x_strides[-dims:]
    read = (*x_strides[:len(lead)], x_strides[len(lead)], 0, *(st * s for st, s in zip(stride, x_spatial)))
    w_out, _, *w_spatial = weight.layout.strides
    w_read = (*zeros_lead, out_per_group * w_out, w_out, *zeros_spatial)
    total = None
    for position in itertools.product(*(range(k) for k in weight.layout.shape[2:])):
        x_offset = data.layout.offset + sum(p * d * s for p, d, s in zip(position, dilation, x_spatial))
        w_offset = weight.layout.offset + sum(p * s for p, s in zip(position, w_spatial))
        term = ir.Op("mul", (ir.Load(data.buffer, ir.Layout(domain, read, x_offset), data.dtype),
                             ir.Load(weight.buffer, ir.Layout(domain, w_read, w_offset), weight.dtype)))
        total = term if total is None else ir.Op("add", (total, term))
    if bias is not None:
        (bias_stride,) = bias.layout.strides
        bias_read = (*zeros_lead, out_per_group * bias_stride, bias_stride, *zeros_spatial)
        total = ir.Op("add", (total, ir.Load(bias.buffer, ir.Layout(domain, bias_read, bias.layout.offset),
                                             bias.dtype)))
    o_strides = out.layout.strides
    write = (*o_strides[:len(lead)], out_per_group * o_strides[len(lead)], *o_strides[len(lead):])
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (ir.Store(out, total, ir.Layout(domain, write,
                                                                                              out.layout.offset)),)))
