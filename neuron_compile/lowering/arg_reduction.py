"""Lowering stage, index-of-extremum family: max.dim / min.dim (values and indices), argmax, argmin.

Input: an ATen FX node. Output: up to two ``ir.Reduction`` nodes over the input shape: the extremum (``max`` /
``min``), then the index: the smallest position whose element equals the extremum, or is nan (eager's max / min
propagate nan and point at the first nan: then no element equals the nan extremum and only nans qualify), i.e.
``min(where(x == m or x != x, position, size))``. Positions are an exact int32 iota along the reduced dim (the
row-major flat position for argmax / argmin without a dim); below 2**24 the fp32 minimum is exact, and the index
buffer is int32, widened to eager's int64 when the region returns it.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.lowering.reduction import normalize_dims, reduce_into, row_shape_reason, store_layout_in_domain
from neuron_compile.lowering.registry import INTEGER_OPS, TensorValue, register_lowering

aten = torch.ops.aten

def _dim_argument(node: torch.fx.Node):
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")


def _check_arg_reduction(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta["val"]
    if not source.is_floating_point():
        return f"{node.target}: {source.dtype} source (only float32, bfloat16)"
    if source.numel() == 0:
        return f"{node.target}: an empty source"  # eager raises (no extremum of nothing)
    if source.dim() == 0:
        return None  # one element: its value, at index 0
    dim = _dim_argument(node)
    reduce_dims = normalize_dims(dim, source.dim())
    positions = math.prod(source.shape[d] for d in reduce_dims)
    if positions >= FP32_EXACT_INTEGER:  # larger positions are not all fp32 values: the minimum could round
        return f"{node.target}: {positions} positions (>= 2**24, not exact in fp32)"
    return row_shape_reason(node, source, reduce_dims)


def _positions(shape: tuple[int, ...], reduce_dims: tuple[int, ...]) -> ir.Iota:
    """Each element's position along the reduced dims, row-major over them (one dim: its own index)."""
    strides, running = [0] * len(shape), 1
    for dim in reversed(reduce_dims):
        strides[dim] = running
        running *= shape[dim]
    return ir.Iota(ir.Layout(shape, tuple(strides), 0))


def _emit_index(ctx, meta, x: ir.Load, extremum: TensorValue, reduce_dims) -> TensorValue:
    domain = x.layout.shape
    buffer = ctx.new_buffer(meta, "index")
    if not domain:  # a 0-d source: index 0
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (), (ir.Store(buffer, ir.Scalar(0.0), buffer.layout),)))
        return TensorValue(buffer.name, buffer.layout, buffer.dtype)
    m = ir.Load(extremum.buffer, store_layout_in_domain(extremum.layout, domain, reduce_dims), extremum.dtype)
    qualifies = ir.Op("maximum", (ir.Op("eq", (x, m)), ir.Op("ne", (x, x))))
    size = math.prod(domain[d] for d in reduce_dims)
    candidate = ir.Op("where", (qualifies, _positions(domain, reduce_dims), ir.Scalar(float(size))))
    reduce_into(ctx, buffer, domain, reduce_dims, "min", candidate)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _emit_extremum(ctx, buffer: ir.Buffer, x: ir.Load, op: str, reduce_dims) -> TensorValue:
    domain = x.layout.shape
    if not domain:  # a 0-d source is its own extremum
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (), (ir.Store(buffer, x, buffer.layout),)))
        return TensorValue(buffer.name, buffer.layout, buffer.dtype)
    reduce_into(ctx, buffer, domain, reduce_dims, op, x)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


EXTREMUM = {aten.max.dim: "max", aten.min.dim: "min", aten.argmax.default: "max", aten.argmin.default: "min"}


def _source(ctx, node) -> tuple[ir.Load, tuple[int, ...]]:
    """The source read over its shape, and the reduced dims. When several reduced dims lie out of row-major order
    in memory, a contiguous copy is read instead: positions count row-major, and a row walked in another order
    would not merge with them into one access pattern."""
    value = ctx.value(node.args[0])
    shape = value.layout.shape
    source = ir.Load(value.buffer, value.layout, value.dtype)
    if not shape:
        return source, ()
    reduce_dims = normalize_dims(_dim_argument(node), len(shape))
    strides = [value.layout.strides[d] for d in reduce_dims if shape[d] > 1]
    if len(strides) < 2 or strides == sorted(strides, reverse=True):
        return source, reduce_dims
    copy = ctx.scratch_buffer(shape, value.dtype, "row_major")
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), shape, (ir.Store(copy, source, copy.layout),)))
    return ir.Load(copy.name, copy.layout, copy.dtype), reduce_dims


@register_lowering(aten.max.dim, aten.min.dim, check=_check_arg_reduction, multi_output=True)
def lower_extremum_with_index(ctx, node):
    x, reduce_dims = _source(ctx, node)
    values_meta, indices_meta = node.meta["val"]
    values = _emit_extremum(ctx, ctx.new_buffer(values_meta, "values"), x, EXTREMUM[node.target], reduce_dims)
    return values, _emit_index(ctx, indices_meta, x, values, reduce_dims)


@register_lowering(aten.argmax.default, aten.argmin.default, check=_check_arg_reduction)
def lower_arg_extremum(ctx, node):
    x, reduce_dims = _source(ctx, node)
    # argmax returns no values: the extremum goes to an fp32 scratch buffer shaped like the kept dims.
    kept_shape = tuple(1 if dim in reduce_dims else size for dim, size in enumerate(x.layout.shape))
    scratch = ctx.scratch_buffer(kept_shape, "float32", EXTREMUM[node.target])
    extremum = _emit_extremum(ctx, scratch, x, EXTREMUM[node.target], reduce_dims)
    return _emit_index(ctx, node.meta["val"], x, extremum, reduce_dims)


# The int64 indices are positions the kernel computes exactly (fewer than 2**24, checked): any value is fine.
INTEGER_OPS.update(EXTREMUM)
