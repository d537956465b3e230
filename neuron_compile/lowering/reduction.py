"""Lowering stage, reduction family: sum, mean, amax, amin, prod, var over any dims; softmax and log_softmax.

Input: an ATen FX node. Output: an ``ir.Reduction`` over the input shape (its store layout has stride 0 on the
reduced dims, so the store is evaluated once per kept index), or an ``ir.RowNormalize`` for softmax.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.dims import collapse, reduced_dims_in_memory_order
from neuron_compile.hardware import Target
from neuron_compile.limits import SBUF_SHARE
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import (
    INTEGER_ARITHMETIC_OPS,
    LoweringContext,
    TensorValue,
    broadcast_layout,
    load,
    register_lowering,
)

aten = torch.ops.aten


def normalize_dims(dims, rank: int) -> tuple[int, ...]:
    """ATen's dim argument (None, int, list; negative allowed; empty = all) as sorted positive dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({d % rank if rank else 0 for d in dims}))


def store_layout_in_domain(out: ir.Layout, domain: tuple[int, ...], reduce_dims: tuple[int, ...]) -> ir.Layout:
    """The output layout restated over the input domain: kept dims keep their strides, reduced dims get 0.

    The output has either the input's rank (keepdim: size 1 on reduced dims) or the reduced dims dropped.
    """
    keepdim = len(out.shape) == len(domain)
    strides, out_dim = [], 0
    for dim in range(len(domain)):
        if dim in reduce_dims:
            strides.append(0)
            out_dim += keepdim
        else:
            strides.append(out.strides[out_dim])
            out_dim += 1
    return ir.Layout(domain, tuple(strides), out.offset)


def reduce_into(ctx: LoweringContext, buffer: ir.Buffer, domain, reduce_dims, op: str, prologue: ir.Expr,
                result: ir.Expr = ir.Result(), correction: float = 0.0) -> ir.Load:
    """Emit a Reduction of ``prologue`` over ``reduce_dims`` whose one store writes ``result`` (an expression of
    ``Result()``) into ``buffer``; return ``buffer`` read back over ``domain`` (stride 0 on the reduced dims)."""
    layout = store_layout_in_domain(buffer.layout, domain, reduce_dims)
    store = ir.Store(buffer, result, layout)
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, op, prologue, (store,), correction))
    return ir.Load(buffer.name, layout, buffer.dtype)


def emit_reduction(ctx: LoweringContext, node, source, dims, op: str, correction: float = 0.0) -> TensorValue:
    source_value = ctx.value(source)
    domain = source_value.layout.shape
    if not domain:
        return _reduce_0d(ctx, node, source, op, correction)
    reduce_dims = normalize_dims(dims, len(domain))
    buffer = ctx.output_buffer(node, op)
    reduce_into(ctx, buffer, domain, reduce_dims, op, load(ctx, source, domain), correction=correction)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _reduce_0d(ctx: LoweringContext, node, source, op: str, correction: float) -> TensorValue:
    """A reduction of a 0-d tensor reduces one element: an elementwise copy, with eager's edge cases.

    sum and mean add onto +0.0 (eager's sum of -0.0 is +0.0); max, min and prod return the element itself.
    var of one element divides (x - x)^2 by max(0, 1 - correction): 0 (nan for inf or nan) when that is
    positive, else 0 / 0 = nan whatever x is.
    """
    x = load(ctx, source, ())
    if op in ("sum", "mean"):
        expr = ir.Op("add", (x, ir.Scalar(0.0)))
    elif op == "var":
        expr = ir.Op("mul", (ir.Op("sub", (x, x)), ir.Scalar(0.0))) if 1.0 - correction > 0 else ir.Scalar(math.nan)
    else:
        expr = x
    return emit_pointwise(ctx, node, expr)


def _argument(node, index, name, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# Rows longer than this that cannot be walked in chunks (several reduced dims that do not merge) may not fit
# SBUF once fused; the tiling pass has the exact budget, this is the partitioner's conservative early answer.
UNCHUNKED_ROW_LIMIT = 2048


def _check_reduction(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta["val"]
    dtype = node.kwargs.get("dtype")
    integer_sum = node.target in (aten.sum.dim_IntList, aten.sum.default) and dtype in (torch.int32, torch.int64)
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16) and not integer_sum:
        return f"{node.target}: dtype={dtype}"
    if source.dim() == 0:
        return None  # one element: emit_reduction lowers it as a copy
    return row_shape_reason(node, source, normalize_dims(_argument(node, 1, "dim", None), source.dim()))


def row_shape_reason(node: torch.fx.Node, source: torch.Tensor, reduce_dims: tuple[int, ...]) -> str | None:
    """The shape-beyond-tiling reason for reducing ``source`` (a fake tensor) over ``reduce_dims``, if its rows
    cannot be walked: more than 3 access-pattern entries, or a long row over dims that do not merge."""
    shape = tuple(source.shape)
    layout = ir.Layout(shape, tuple(source.stride()))
    reduced = collapse(shape, reduced_dims_in_memory_order(reduce_dims, layout), [layout])
    row = math.prod(dim.size for dim in reduced)
    if len(reduced) > 3:
        return (f"{node.target}: shape beyond tiling: reduced dims merge into {len(reduced)} access-pattern "
                "entries (max 3)")
    if len(reduced) > 1 and row > UNCHUNKED_ROW_LIMIT:
        return (f"{node.target}: shape beyond tiling: a row of {row} elements over {len(reduced)} non-mergeable dims "
                f"(chunked walks need one reduced dim; limit {UNCHUNKED_ROW_LIMIT} otherwise)")
    return None


@register_lowering(aten.sum.dim_IntList, aten.sum.default, check=_check_reduction)
def lower_sum(ctx, node):
    return emit_reduction(ctx, node, node.args[0], _argument(node, 1, "dim", None), "sum")


@register_lowering(aten.mean.dim, aten.mean.default, check=_check_reduction)
def lower_mean(ctx, node):
    return emit_reduction(ctx, node, node.args[0], _argument(node, 1, "dim", None), "mean")


@register_lowering(aten.amax.default, aten.max.default, check=_check_reduction)
def lower_amax(ctx, node):
    return emit_reduction(ctx, node, node.args[0], _argument(node, 1, "dim", None), "max")


@register_lowering(aten.amin.default, aten.min.default, check=_check_reduction)
def lower_amin(ctx, node):
    return emit_reduction(ctx, node, node.args[0], _argument(node, 1, "dim", None), "min")


# Integer sums (a count of nonzeros) and extrema are exact in fp32 when the value-range pass proves the bounds.
INTEGER_ARITHMETIC_OPS.update((aten.sum.dim_IntList, aten.sum.default, aten.amax.default, aten.amin.default,
                               aten.max.default, aten.min.default))


@register_lowering(aten.any.default, aten.any.dim, aten.any.dims, check=_check_reduction)
def lower_any(ctx, node):
    # A truth test, then a max: any(x) = max(x != 0) (nan is truthy, as in eager); ``all`` reaches us as
    # not(any(not x)). The 0/1 maximum is exact; the bool store converts it.
    source = node.args[0]
    domain = ctx.value(source).layout.shape
    truth = ir.Op("ne", (load(ctx, source, domain), ir.Scalar(0.0)))
    if not domain:
        return emit_pointwise(ctx, node, truth)
    reduce_dims = normalize_dims(_argument(node, 1, "dim", None), len(domain))
    buffer = ctx.output_buffer(node, "any")
    store = ir.Store(buffer, ir.Result(), store_layout_in_domain(buffer.layout, domain, reduce_dims))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "max", truth, (store,), 0.0))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


@register_lowering(aten.prod.dim_int, aten.prod.default, check=_check_reduction)
def lower_prod(ctx, node):
    return emit_reduction(ctx, node, node.args[0], _argument(node, 1, "dim", None), "prod")


def _check_var(node: torch.fx.Node) -> str | None:
    correction = node.kwargs.get("correction", 1)
    if not isinstance(correction, (int, float)):
        return f"{node.target}: correction={correction!r}"
    return _check_reduction(node)


@register_lowering(aten.var.correction, check=_check_var)
def lower_var(ctx, node):
    correction = node.kwargs.get("correction", 1)
    correction = 1.0 if correction is None else float(correction)
    return emit_reduction(ctx, node, node.args[0], _argument(node, 1, "dim", None), "var", correction)


# A softmax row lives whole in SBUF: about 8 fp32 row tiles (input, exps, result, epilogue) per partition.
SOFTMAX_ROW_TILES = 8


def softmax_row_reason(node: torch.fx.Node, row: int, target: Target) -> str | None:
    """The shape-beyond-tiling reason for a softmax row of ``row`` elements, if it cannot fit ``target``'s SBUF."""
    budget = int(target.sbuf_bytes_per_partition * SBUF_SHARE) // (SOFTMAX_ROW_TILES * 4)
    if row > budget:
        return f"{node.target}: shape beyond tiling: a softmax row of {row} elements exceeds {budget} per partition"
    return None


def _check_softmax(node: torch.fx.Node, target: Target) -> str | None:
    if node.args[2]:
        return f"{node.target}: half_to_float=True"
    source = node.args[0].meta["val"]
    if source.dim() == 0:
        return f"{node.target}: softmax of a 0-d tensor"
    return softmax_row_reason(node, source.shape[node.args[1] % source.dim()], target)


@register_lowering(aten._softmax.default, aten._log_softmax.default, target_check=_check_softmax)
def lower_softmax(ctx, node):
    source = node.args[0]
    domain = ctx.value(source).layout.shape
    dim = node.args[1] % len(domain)
    op = "softmax" if node.target is aten._softmax.default else "log_softmax"
    buffer = ctx.output_buffer(node, op)
    store = ir.Store(buffer, ir.Result(), buffer.layout)
    ctx.emit(ir.RowNormalize(ctx.fresh_name("kernel"), domain, dim, op, load(ctx, source, domain), (store,)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _check_safe_softmax(node: torch.fx.Node, target: Target) -> str | None:
    dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
    source = node.args[0].meta["val"]
    if dtype is not None and dtype != source.dtype:
        return f"{node.target}: dtype={dtype}"
    if source.dim() == 0:
        return f"{node.target}: softmax of a 0-d tensor"
    return softmax_row_reason(node, source.shape[node.args[1] % source.dim()], target)


@register_lowering(aten._safe_softmax.default, target_check=_check_safe_softmax)
def lower_safe_softmax(ctx, node):
    """softmax, with rows that are entirely -inf (fully masked attention rows) giving 0 instead of nan: the row
    maximum (a max Reduction kept along ``dim``) selects 0 where it is -inf."""
    source = node.args[0]
    domain = ctx.value(source).layout.shape
    dim = node.args[1] % len(domain)
    kept = tuple(1 if d == dim else size for d, size in enumerate(domain))
    row_max = ctx.scratch_buffer(kept, "float32", "row_max")
    row_max_load = reduce_into(ctx, row_max, domain, (dim,), "max", load(ctx, source, domain))
    masked_row = ir.Op("eq", (row_max_load, ir.Scalar(-math.inf)))
    buffer = ctx.output_buffer(node, "softmax")
    store = ir.Store(buffer, ir.Op("where", (masked_row, ir.Scalar(0.0), ir.Result())), buffer.layout)
    ctx.emit(ir.RowNormalize(ctx.fresh_name("kernel"), domain, dim, "softmax", load(ctx, source, domain), (store,)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _check_softmax_backward(node: torch.fx.Node) -> str | None:
    return None if node.args[1].meta["val"].dim() > 0 else f"{node.target}: 0-d tensors"


@register_lowering(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
                   check=_check_softmax_backward)
def lower_softmax_backward(ctx, node):
    """softmax: out * (grad - sum(grad * out)); log_softmax: grad - exp(out) * sum(grad), along ``dim``."""
    grad_arg, output_arg, dim = node.args[:3]
    domain = ctx.value(grad_arg).layout.shape
    dim %= len(domain)
    grad, output = load(ctx, grad_arg, domain), load(ctx, output_arg, domain)
    softmax = node.target is aten._softmax_backward_data.default
    # The row sums stay fp32 (eager accumulates bf16 rows in fp32 too); a fake tensor gives sizes and strides.
    row_meta = node.meta["val"].sum(dim, keepdim=True, dtype=torch.float32)
    row_sum = ctx.new_buffer(row_meta, "row_sum")
    prologue = ir.Op("mul", (grad, output)) if softmax else grad
    store = ir.Store(row_sum, ir.Result(), store_layout_in_domain(row_sum.layout, domain, (dim,)))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, (dim,), "sum", prologue, (store,)))
    row = ir.Load(row_sum.name, broadcast_layout(row_sum.layout, domain), row_sum.dtype)
    if softmax:
        expr = ir.Op("mul", (output, ir.Op("sub", (grad, row))))
    else:
        expr = ir.Op("sub", (grad, ir.Op("mul", (ir.Op("exp", (output,)), row))))
    return emit_pointwise(ctx, node, expr)


# ---------------------------------------------------------------- vector norms and var_mean


def _check_vector_norm(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta["val"]
    order = _argument(node, 1, "ord", 2)
    if not isinstance(order, (int, float)) or isinstance(order, bool):
        return f"{node.target}: ord={order!r}"
    if not (math.isinf(order) or order >= 0):
        # |x| ** p with p < 0 divides by zero on zero elements; eager's inf handling is not worth the risk here.
        return f"{node.target}: ord={order} (negative orders unsupported)"
    dtype = node.kwargs.get("dtype")
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtype={dtype}"
    if source.dim() == 0:
        return None
    return row_shape_reason(node, source, normalize_dims(_argument(node, 2, "dim", None), source.dim()))


@register_lowering(aten.linalg_vector_norm.default, check=_check_vector_norm)
def lower_vector_norm(ctx, node):
    """ord 2: sqrt(sum(x*x)); 1: sum|x|; inf / -inf: max / min |x|; 0: count of nonzeros; p: sum(|x|^p)^(1/p).

    The reduced value stays fp32 in a scratch buffer and the finishing root is a pointwise node (fused back
    by the fusion pass when it can be). Eager does not rescale against overflow either, so a plain sum of
    squares matches it. pow runs on GpSimd (nl.power), which has no restricted input range; sqrt's input is a
    sum of squares, >= 0.
    """
    source = node.args[0]
    order = float(_argument(node, 1, "ord", 2))
    domain = ctx.value(source).layout.shape
    reduce_dims = normalize_dims(_argument(node, 2, "dim", None), len(domain))
    x = load(ctx, source, domain)
    magnitude = ir.Op("abs", (x,))
    if order == 2:
        prologue, op, finish = ir.Op("mul", (x, x)), "sum", "sqrt"
    elif order == 1:
        prologue, op, finish = magnitude, "sum", None
    elif order == math.inf:
        prologue, op, finish = magnitude, "max", None
    elif order == -math.inf:
        prologue, op, finish = magnitude, "min", None
    elif order == 0:
        prologue, op, finish = ir.Op("ne", (x, ir.Scalar(0.0))), "sum", None
    else:
        prologue, op, finish = ir.Op("pow", (magnitude, ir.Scalar(order))), "sum", "root"
    out_shape = tuple(node.meta["val"].shape)
    if not domain:
        # A 0-d input is a one-element row: the reduction of one value is the value itself (same math as eager's
        # one-element reduction, overflow of x*x included).
        reduced = prologue
    else:
        partial = ctx.scratch_buffer(out_shape, "float32", "norm")
        store = ir.Store(partial, ir.Result(), store_layout_in_domain(partial.layout, domain, reduce_dims))
        ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, op, prologue, (store,)))
        reduced = ir.Load(partial.name, partial.layout, partial.dtype)
    if finish == "sqrt":
        reduced = ir.Op("sqrt", (reduced,))
    elif finish == "root":
        reduced = ir.Op("pow", (reduced, ir.Scalar(1.0 / order)))
    return emit_pointwise(ctx, node, reduced)


def _check_var_mean(node: torch.fx.Node) -> str | None:
    correction = node.kwargs.get("correction", 1)
    if correction is not None and not isinstance(correction, (int, float)):
        return f"{node.target}: correction={correction!r}"
    return _check_reduction(node)


@register_lowering(aten.var_mean.correction, check=_check_var_mean, multi_output=True)
def lower_var_mean(ctx, node):
    """Two reductions of the same rows: var (with its correction) and mean, each into eager's layout."""
    correction = node.kwargs.get("correction", 1)
    correction = 1.0 if correction is None else float(correction)
    source = node.args[0]
    domain = ctx.value(source).layout.shape
    reduce_dims = normalize_dims(_argument(node, 1, "dim", None), len(domain))
    results = []
    for meta, op in zip(node.meta["val"], ("var", "mean")):
        buffer = ctx.new_buffer(meta, op)
        store = ir.Store(buffer, ir.Result(), store_layout_in_domain(buffer.layout, domain, reduce_dims))
        prologue = load(ctx, source, domain)
        ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, op, prologue, (store,),
                              correction if op == "var" else 0.0))
        results.append(TensorValue(buffer.name, buffer.layout, buffer.dtype))
    return tuple(results)
