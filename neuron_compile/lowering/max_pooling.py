"""Lowering stage, max pooling: max_pool2d / max_pool3d with indices (max_pool1d arrives as 2-D), and adaptive
max pooling with even windows.

Input: an ATen FX node. Output: IR nodes over the window domain (*leading, *out, *kernel), read through an unfold
access pattern of the input (a -inf padded copy when padding or a ceil_mode overhang needs one):

* values: a ``max`` Reduction over the kernel dims (nan propagates, as in eager);
* indices, following ATen's CPU loop (``if val > max or isnan(val)``: the first maximum, or the last nan): the
  smallest valid position equal to the window's maximum and the largest valid nan position, two Reductions over
  an exact int32 iota of each element's flat position in its input plane, then one select. Padding positions are
  never valid (eager's windows skip them; an all -inf window points at its first real element).

Positions below 2**24 (checked) are exact in fp32; the int32 index buffer is widened to eager's int64.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.lowering.movement import padded_copy
from neuron_compile.lowering.pooling import expand_per_dim
from neuron_compile.lowering.reduction import reduce_into, row_shape_reason
from neuron_compile.lowering.registry import INTEGER_OPS, TensorValue, register_lowering

aten = torch.ops.aten


def _arguments(node: torch.fx.Node, dims: int) -> dict:
    """kernel, stride, padding, dilation per pooled dim, with sizes and outs; adaptive pooling as kernel = stride."""
    source = node.args[0].meta["val"]
    sizes = list(source.shape[-dims:])
    outs = list(node.meta["val"][0].shape[-dims:])
    if node.target in (aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default):
        kernel = [size // out for size, out in zip(sizes, outs)]
        return dict(kernel=kernel, stride=kernel, padding=[0] * dims, dilation=[1] * dims, sizes=sizes, outs=outs)
    kernel = expand_per_dim(node.args[1], dims)
    stride = expand_per_dim(node.args[2] if len(node.args) > 2 else None, dims, kernel)
    padding = expand_per_dim(node.args[3] if len(node.args) > 3 else 0, dims)
    dilation = expand_per_dim(node.args[4] if len(node.args) > 4 else 1, dims)
    return dict(kernel=kernel, stride=stride, padding=padding, dilation=dilation, sizes=sizes, outs=outs)


def _check_max_pool(dims: int):
    def check(node: torch.fx.Node) -> str | None:
        source = node.args[0].meta["val"]
        if source.dim() not in (dims + 1, dims + 2):
            return f"{node.target}: rank {source.dim()} input"
        if not source.is_floating_point():
            return f"{node.target}: {source.dtype} input (only float32, bfloat16)"
        args = _arguments(node, dims)
        if node.target in (aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default) and any(
            size % out for size, out in zip(args["sizes"], args["outs"])
        ):
            return f"{node.target}: input {args['sizes']} not a multiple of output {args['outs']} (uneven windows)"
        if not all(len(args[key]) == dims for key in ("kernel", "stride", "padding", "dilation")):
            return f"{node.target}: kernel/stride/padding/dilation do not have {dims} entries"
        if math.prod(args["sizes"]) >= FP32_EXACT_INTEGER:
            return f"{node.target}: input planes of {math.prod(args['sizes'])} elements (>= 2**24 positions)"
        window = torch.empty((*source.shape[:-dims], *args["outs"], *args["kernel"]), device="meta")
        return row_shape_reason(node, window, tuple(range(window.dim() - dims, window.dim())))

    return check


def _window_layout(layout: ir.Layout, nlead: int, args: dict) -> ir.Layout:
    """(*lead, *out, *kernel) over a (*lead, *pooled) layout: out dims step stride, kernel dims dilation."""
    pooled = layout.strides[nlead:]
    return ir.Layout(
        (*layout.shape[:nlead], *args["outs"], *args["kernel"]),
        (*layout.strides[:nlead], *(s * t for s, t in zip(args["stride"], pooled)),
         *(d * t for d, t in zip(args["dilation"], pooled))),
        layout.offset,
    )


def _coordinate(domain, nlead: int, dims: int, d: int, args: dict) -> ir.Iota:
    """Pooled dim ``d``'s input coordinate of each window element: out * stride + kernel * dilation - padding."""
    strides = [0] * len(domain)
    strides[nlead + d], strides[nlead + dims + d] = args["stride"][d], args["dilation"][d]
    return ir.Iota(ir.Layout(domain, tuple(strides), -args["padding"][d]))


def _lower_max_pool(ctx, node, dims: int):
    args = _arguments(node, dims)
    source = ctx.value(node.args[0])
    lead = source.layout.shape[:-dims]
    nlead = len(lead)
    sizes, outs, kernel, padding = args["sizes"], args["outs"], args["kernel"], args["padding"]
    extents = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(outs, args["stride"], kernel, args["dilation"])]
    totals = [max(p + n, extent) for p, n, extent in zip(padding, sizes, extents)]
    if any(padding) or any(t > n for t, n in zip(totals, sizes)):
        padded = padded_copy(ctx, source, lead, sizes, padding, totals, source.dtype, band_value=-math.inf)
        data = TensorValue(padded.name, ir.Layout(padded.layout.shape, padded.layout.strides, 0), padded.dtype)
    else:
        data = source
    domain = (*lead, *outs, *kernel)
    reduce_dims = tuple(range(nlead + dims, len(domain)))
    x = ir.Load(data.buffer, _window_layout(data.layout, nlead, args), data.dtype)

    values_meta, indices_meta = node.meta["val"]
    values = ctx.new_buffer(values_meta, "max_pool")
    maximum = reduce_into(ctx, values, domain, reduce_dims, "max", x)

    valid, position, plane_stride = None, None, 1
    for d in reversed(range(dims)):
        coordinate = _coordinate(domain, nlead, dims, d, args)
        inside = ir.Op("mul", (ir.Op("ge", (coordinate, ir.Scalar(0.0))),
                               ir.Op("lt", (coordinate, ir.Scalar(float(sizes[d]))))))
        term = ir.Op("mul", (coordinate, ir.Scalar(float(plane_stride))))
        valid = inside if valid is None else ir.Op("mul", (valid, inside))
        position = term if position is None else ir.Op("add", (position, term))
        plane_stride *= sizes[d]
    is_max = ir.Op("mul", (valid, ir.Op("eq", (x, maximum))))
    is_nan = ir.Op("mul", (valid, ir.Op("ne", (x, x))))
    kept = tuple(1 if dim in reduce_dims else size for dim, size in enumerate(domain))
    first_max = reduce_into(ctx, ctx.scratch_buffer(kept, "float32", "first_max"), domain, reduce_dims, "min",
                            ir.Op("where", (is_max, position, ir.Scalar(float(plane_stride)))))
    # The last nan's position (a max over -1 elsewhere) where the window has one, else the first maximum's.
    indices = ctx.new_buffer(indices_meta, "max_pool_index")
    index = ir.Op("where", (ir.Op("ge", (ir.Result(), ir.Scalar(0.0))), ir.Result(), first_max))
    last_nan = ir.Op("where", (is_nan, position, ir.Scalar(-1.0)))
    reduce_into(ctx, indices, domain, reduce_dims, "max", last_nan, result=index)
    return (TensorValue(values.name, values.layout, values.dtype),
            TensorValue(indices.name, indices.layout, indices.dtype))


MAX_POOLS = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
             aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3}

for _op, _dims in MAX_POOLS.items():
    register_lowering(_op, check=_check_max_pool(_dims), multi_output=True)(
        lambda ctx, node, dims=_dims: _lower_max_pool(ctx, node, dims))

# The int64 indices are plane positions the kernel computes exactly (below 2**24, checked).
INTEGER_OPS.update(MAX_POOLS)
