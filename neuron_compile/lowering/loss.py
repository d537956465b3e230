"""Lowering stage, loss family: nll_loss_forward and nll_loss_backward (cross_entropy = log_softmax + nll_loss).

Input: ATen FX nodes with ``self`` [N, C] or [C], an integer ``target`` [N] or 0-d, an optional ``weight`` [C],
``reduction`` (0 none, 1 mean, 2 sum) and ``ignore_index``. Output: IR nodes:

* forward: ``safe = where(target == ignore_index, 0, target)`` (an int32 buffer), an element Gather
  ``picked[i] = self[i, safe[i]]`` (an out-of-range target makes the gather fail, so the call runs eagerly and
  raises like eager), the weight ``w[safe[i]]`` by a second gather, ``term = where(valid, -picked * w, 0)``,
  then for sum / mean two Reductions (sum of terms, total weight) and for mean their quotient.
* backward: one Pointwise over [N, C]: ``where(valid[i] and c == target[i], -w[c] * g[i], 0)`` with ``g`` the
  output gradient (divided by the total weight for mean); ``w[c]`` at the one selected column is ``w[target]``,
  so no gather is needed. It does not re-check target bounds (its forward did).

Integers meet fp32 only where that is exact for every int32 value: ``target == ignore_index`` for a small
constant, and ``c == target`` for class positions below 2**24 (an int32 target rounds to a value of the same
magnitude, so no out-of-range target can land on a class).
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.lowering.indexing import FLOAT_SOURCES
from neuron_compile.lowering.reduction import reduce_into
from neuron_compile.lowering.registry import INTEGER_DTYPES, INTEGER_OPS, TensorValue, register_lowering

aten = torch.ops.aten

MAX_CLASSES = FP32_EXACT_INTEGER - 1  # class positions compared in fp32


def _check_nll_loss(node: torch.fx.Node) -> str | None:
    is_backward = node.target is aten.nll_loss_backward.default
    source, target, weight, reduction, ignore_index = node.args[1:6] if is_backward else node.args[:5]
    source_val, target_val = source.meta["val"], target.meta["val"]
    if source_val.dtype not in FLOAT_SOURCES:
        return f"{node.target}: dtype {source_val.dtype} (only float32, bfloat16)"
    if target_val.dtype not in INTEGER_DTYPES:
        return f"{node.target}: target dtype {target_val.dtype}"
    if source_val.dim() not in (1, 2) or source_val.shape[-1] == 0:
        return f"{node.target}: input of shape {list(source_val.shape)} (only [N, C] or [C], C > 0)"
    if source_val.shape[-1] > MAX_CLASSES or abs(ignore_index) > MAX_CLASSES:
        return f"{node.target}: {source_val.shape[-1]} classes or ignore_index {ignore_index} beyond 2**24"
    if reduction not in (0, 1, 2):
        return f"{node.target}: reduction {reduction}"
    if weight is not None and weight.meta["val"].dtype != source_val.dtype:
        return f"{node.target}: weight dtype {weight.meta['val'].dtype} differs from the input's"
    return None


def _as_rows(value: TensorValue) -> ir.Layout:
    """The layout of ``self`` (or its gradient) as [N, C]: a [C] tensor is one row."""
    layout = value.layout
    if len(layout.shape) == 1:
        return ir.Layout((1,) + layout.shape, (0,) + layout.strides, layout.offset)
    return layout


def _per_row(layout: ir.Layout, rows: int) -> ir.Layout:
    """A [N] (or 0-d, for one row) layout as [N]."""
    return layout if layout.shape else ir.Layout((rows,), (0,), layout.offset)


def _load(value: TensorValue, layout: ir.Layout) -> ir.Load:
    return ir.Load(value.buffer, layout, value.dtype)


@register_lowering(aten.nll_loss_forward.default, check=_check_nll_loss, multi_output=True)
def lower_nll_loss_forward(ctx, node):
    source_node, target_node, weight_node, reduction, ignore_index = node.args[:5]
    source, target = ctx.value(source_node), ctx.value(target_node)
    rows_layout = _as_rows(source)
    rows, classes = rows_layout.shape
    target_load = _load(target, _per_row(target.layout, rows))
    valid = ir.Op("ne", (target_load, ir.Scalar(float(ignore_index))))

    safe = ctx.scratch_buffer((rows,), "int32", "target")
    safe_expr = ir.Op("where", (valid, target_load, ir.Scalar(0.0)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (rows,), (ir.Store(safe, safe_expr, safe.layout),)))
    safe_column = ir.Load(safe.name, ir.Layout((rows, 1), (1, 0)), "int32")

    picked = ctx.scratch_buffer((rows, 1), source.dtype, "picked")
    base = ir.Load(source.buffer, ir.Layout((rows, 1), (rows_layout.strides[0], 0), rows_layout.offset), source.dtype)
    entry = (safe_column, rows_layout.strides[1], classes, False)
    ctx.emit(ir.Gather(ctx.fresh_name("kernel"), (rows, 1), 1, base, safe_column,
                       (ir.Store(picked, ir.Result(), picked.layout),), elements=True, indices=(entry,)))
    weight = ir.Scalar(1.0)
    if weight_node is not None:
        weights = ctx.value(weight_node)
        chosen = ctx.scratch_buffer((rows, 1), weights.dtype, "weight")
        base = ir.Load(weights.buffer, ir.Layout((rows, 1), (0, 0), weights.layout.offset), weights.dtype)
        entry = (safe_column, weights.layout.strides[0], classes, False)
        ctx.emit(ir.Gather(ctx.fresh_name("kernel"), (rows, 1), 1, base, safe_column,
                           (ir.Store(chosen, ir.Result(), chosen.layout),), elements=True, indices=(entry,)))
        weight = ir.Load(chosen.name, ir.Layout((rows,), (1,)), chosen.dtype)
    picked_load = ir.Load(picked.name, ir.Layout((rows,), (1,)), picked.dtype)
    term = ir.Op("where", (valid, ir.Op("neg", (ir.Op("mul", (picked_load, weight)),)), ir.Scalar(0.0)))

    output_meta, total_meta = node.meta["val"]
    output, total = ctx.new_buffer(output_meta, "nll_loss"), ctx.new_buffer(total_meta, "total_weight")
    if reduction == 0:
        store = ir.Store(output, _rounded(term, output), _per_row(output.layout, rows))
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (rows,), (store,)))
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (), (ir.Store(total, ir.Scalar(0.0), total.layout),)))
        return _value(output), _value(total)
    weight_sum = ir.Op("where", (valid, weight, ir.Scalar(0.0)))
    sums = []
    for expr, stem in ((term, "loss_sum"), (weight_sum, "weight_sum")):
        partial = ctx.scratch_buffer((), "float32", stem)
        reduce_into(ctx, partial, (rows,), (0,), "sum", expr)
        sums.append(ir.Load(partial.name, partial.layout, "float32"))
    loss = sums[0] if reduction == 2 else ir.Op("div", (sums[0], sums[1]))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), (), (ir.Store(output, _rounded(loss, output), output.layout),
                                                          ir.Store(total, _rounded(sums[1], total), total.layout))))
    return _value(output), _value(total)


def _rounded(expr: ir.Expr, buffer: ir.Buffer) -> ir.Expr:
    return ir.Op("cast", (expr,), dtype=buffer.dtype) if buffer.dtype == "bfloat16" else expr


def _value(buffer: ir.Buffer) -> TensorValue:
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


@register_lowering(aten.nll_loss_backward.default, check=_check_nll_loss)
def lower_nll_loss_backward(ctx, node):
    grad_node, source_node, target_node, weight_node, reduction, ignore_index, total_node = node.args[:7]
    source, target, grad = ctx.value(source_node), ctx.value(target_node), ctx.value(grad_node)
    rows, classes = _as_rows(source).shape
    domain = (rows, classes)
    per_row = _per_row(target.layout, rows)
    target_load = _load(target, ir.Layout(domain, (per_row.strides[0], 0), per_row.offset))
    column = ir.Iota(ir.Layout(domain, (0, 1), 0))
    selected = ir.Op("mul", (ir.Op("ne", (target_load, ir.Scalar(float(ignore_index)))),
                             ir.Op("eq", (column, target_load))))
    if reduction == 0:
        per_row_grad = _per_row(grad.layout, rows)
        scale = _load(grad, ir.Layout(domain, (per_row_grad.strides[0], 0), per_row_grad.offset))
    else:
        scale = _load(grad, ir.Layout(domain, (0, 0), grad.layout.offset))
        if reduction == 1:
            total = ctx.value(total_node)
            scale = ir.Op("div", (scale, _load(total, ir.Layout(domain, (0, 0), total.layout.offset))))
    if weight_node is not None:
        weights = ctx.value(weight_node)
        scale = ir.Op("mul", (scale, _load(weights, ir.Layout(domain, (0, weights.layout.strides[0]),
                                                             weights.layout.offset))))
    gradient = ir.Op("where", (selected, ir.Op("neg", (scale,)), ir.Scalar(0.0)))
    output = ctx.output_buffer(node, "nll_loss_grad")
    store = ir.Store(output, _rounded(gradient, output), _as_rows(_value(output)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (store,)))
    return _value(output)


INTEGER_OPS.update((aten.nll_loss_forward.default, aten.nll_loss_backward.default))
