"""Lowering stage, normalization family: native_layer_norm (and its backward), native_group_norm.

Input: an ATen FX node. Output: three IR nodes — the row mean (a Reduction), the row rstd (a biased-variance
Reduction with ``rsqrt(var + eps)`` as its epilogue) and the normalize-and-affine Pointwise that reads both
broadcast along the normalized dims — and the (out, mean, rstd) tuple that getitem nodes pick from.

Group norm's statistics are the same two reductions over a regrouped domain: the channel dim C of the (N, C,
*spatial) input is split by the access pattern into (G, C / G) (strides ``C/G * stride_C`` and ``stride_C``), so
each (N, G) pair is one row over (C / G, *spatial); with few such rows, per channel first and then per group. The
statistics and the per-channel weight become a mean and a scale per (n, c), and the output is computed over the
input's own domain with every per-channel operand one value per row.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.reduction import row_shape_reason, store_layout_in_domain
from neuron_compile.lowering.registry import TensorValue, broadcast_layout, load, register_lowering

aten = torch.ops.aten


def _check_layer_norm(node: torch.fx.Node) -> str | None:
    if not isinstance(node.args[4] if len(node.args) > 4 else None, (int, float)):
        return f"{node.target}: eps is not a number"
    return None


def _emit_row_statistics(ctx, domain, reduce_dims, prologue, mean: ir.Buffer, rstd: ir.Buffer, eps,
                         row_shape) -> tuple[ir.Buffer, ir.Buffer]:
    """The mean and 1 / sqrt(var + eps) of ``prologue`` over ``reduce_dims``, stored into the op's ``mean`` and
    ``rstd`` outputs and into fp32 scratch copies of ``row_shape``, which the normalize step reads: with bf16
    outputs, x - round(mean) would cancel catastrophically on near-constant rows (eager keeps them in fp32)."""

    def row_store(buffer, expr):
        return ir.Store(buffer, expr, store_layout_in_domain(buffer.layout, domain, reduce_dims))

    mean_fp32, rstd_fp32 = (ctx.scratch_buffer(row_shape, "float32", stem) for stem in ("mean_fp32", "rstd_fp32"))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "mean", prologue,
                          (row_store(mean, ir.Result()), row_store(mean_fp32, ir.Result()))))
    inverse_std = ir.Op("rsqrt", (ir.Op("add", (ir.Result(), ir.Scalar(float(eps)))),))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "var", prologue,
                          (row_store(rstd, inverse_std), row_store(rstd_fp32, inverse_std)), correction=0.0))
    return mean_fp32, rstd_fp32


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

    row_shape = tuple(1 if dim in reduce_dims else size for dim, size in enumerate(domain))
    mean_fp32, rstd_fp32 = _emit_row_statistics(ctx, domain, reduce_dims, prologue, mean, rstd, eps, row_shape)

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


# rsqrt(var + eps) runs on the Scalar engine, valid on [2**-87, 2**97] (nki-spec 1.5): eps >= 2**-87 keeps the
# lower end; var + eps > 2**97 needs |x - mean| > 2**48, far beyond what a normalization layer sees.
MIN_EPS = 2.0**-87


def _group_domain(layout: ir.Layout, groups: int) -> ir.Layout:
    """The (N, C, *spatial) layout as (N, G, C / G, *spatial): the channel split is one more access-pattern dim."""
    size_n, channels, *spatial = layout.shape
    stride_n, stride_c, *spatial_strides = layout.strides
    per_group = channels // groups
    strides = (stride_n, per_group * stride_c, stride_c, *spatial_strides)
    return ir.Layout((size_n, groups, per_group, *spatial), strides, layout.offset)


def _check_group_norm(node: torch.fx.Node) -> str | None:
    source, weight, bias, _, channels, _, groups, eps = node.args[:8]
    meta = source.meta["val"]
    if not isinstance(eps, (int, float)) or eps < MIN_EPS:
        return f"{node.target}: eps={eps!r} (rsqrt(var + eps) needs eps >= 2**-87, its valid input range)"
    if meta.dim() < 2 or not isinstance(groups, int) or groups <= 0 or meta.shape[1] % groups:
        return f"{node.target}: input {list(meta.shape)} with {groups} groups"
    if meta.dim() + 1 > 6:
        return f"{node.target}: rank {meta.dim()} input regroups to rank {meta.dim() + 1} (5-D limit)"
    for arg in (weight, bias):
        if arg is not None and arg.meta["val"].dtype != meta.dtype:
            return f"{node.target}: weight/bias dtype {arg.meta['val'].dtype} differs from input {meta.dtype}"
    reason = _group_row_reason(node, ir.Layout(tuple(meta.shape), tuple(meta.stride())), groups)
    if reason is not None and _group_row_reason(node, _contiguous(meta.shape), groups) is None:
        return None  # walked from a contiguous copy (see _group_norm_source)
    return reason


def _contiguous(shape) -> ir.Layout:
    return ir.Layout(tuple(shape), ir.contiguous_strides(tuple(shape)))


def _group_row_reason(node: torch.fx.Node, layout: ir.Layout, groups: int) -> str | None:
    grouped = _group_domain(layout, groups)
    fake = torch.empty_strided(grouped.shape, grouped.strides, device="meta")
    return row_shape_reason(node, fake, tuple(range(2, len(grouped.shape))))


def _group_norm_source(ctx, node: torch.fx.Node, source: TensorValue, groups: int) -> TensorValue:
    """The input, or a contiguous copy of it when its group rows cannot be walked in place: channels last (a VAE
    decoder after its attention block) splits each group's row into channels (stride 1) and pixels (stride C),
    two dims that do not merge, and a row that long is walked in chunks along one dim only."""
    if _group_row_reason(node, source.layout, groups) is None:
        return source
    layout = _contiguous(source.layout.shape)
    copy = ctx.scratch_buffer(layout.shape, source.dtype, "contiguous")
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), layout.shape,
                          (ir.Store(copy, ir.Load(source.buffer, source.layout, source.dtype), copy.layout),)))
    return TensorValue(copy.name, copy.layout, copy.dtype)


# Fewer (N, G) rows than this leave partitions idle (a VAE's 32 groups use a quarter of them): the statistics are
# then taken per channel first, N * C rows, and combined per group.
FEW_GROUP_ROWS = 128


def _per_channel_first(domain: tuple[int, ...]) -> bool:
    """Whether group statistics over the (N, G, C / G, *spatial) ``domain`` go per channel first: few group rows,
    several channels per group, and spatial dims to reduce per channel."""
    return len(domain) > 3 and domain[2] > 1 and domain[0] * domain[1] < FEW_GROUP_ROWS


def _emit_group_statistics_by_channel(ctx, domain, prologue, mean: ir.Buffer, rstd: ir.Buffer, eps
                                      ) -> tuple[ir.Buffer, ir.Buffer]:
    """Group statistics in two steps: each channel's mean and biased variance over its spatial dims (N * C rows on
    partitions instead of N * G), then per group, over its C / G channels of equal counts, the mean of the channel
    means and the variance as the mean of the channel variances plus the variance of the channel means (the
    parallel form of the two-pass variance: no sum of squares that could cancel). Stores as
    ``_emit_row_statistics`` does."""
    spatial = tuple(range(3, len(domain)))
    channel_shape = domain[:3]

    def per_channel(op: str, stem: str) -> ir.Load:
        buffer = ctx.scratch_buffer(channel_shape, "float32", stem)
        store = ir.Store(buffer, ir.Result(), store_layout_in_domain(buffer.layout, domain, spatial))
        ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, spatial, op, prologue, (store,), correction=0.0))
        return ir.Load(buffer.name, buffer.layout, "float32")

    channel_mean, channel_var = per_channel("mean", "channel_mean"), per_channel("var", "channel_var")
    channels = (2,)

    def group_store(buffer, expr):
        return ir.Store(buffer, expr, store_layout_in_domain(buffer.layout, channel_shape, channels))

    mean_fp32, rstd_fp32 = (ctx.scratch_buffer(domain[:2], "float32", stem) for stem in ("mean_fp32", "rstd_fp32"))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), channel_shape, channels, "mean", channel_mean,
                          (group_store(mean, ir.Result()), group_store(mean_fp32, ir.Result()))))
    group_mean = ir.Load(mean_fp32.name, store_layout_in_domain(mean_fp32.layout, channel_shape, channels), "float32")
    spread = ir.Op("sub", (channel_mean, group_mean))
    inverse_std = ir.Op("rsqrt", (ir.Op("add", (ir.Result(), ir.Scalar(float(eps)))),))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), channel_shape, channels, "mean",
                          ir.Op("add", (channel_var, ir.Op("mul", (spread, spread)))),
                          (group_store(rstd, inverse_std), group_store(rstd_fp32, inverse_std))))
    return mean_fp32, rstd_fp32


def _channel_mean_and_scale(ctx, channel_shape, mean_fp32: ir.Buffer, rstd_fp32: ir.Buffer, weight
                            ) -> tuple[ir.Buffer, ir.Buffer]:
    """Per (n, c) over the (N, G, C / G) ``channel_shape``: its group's mean and scale = rstd * weight[c], in fp32
    [N, C] buffers, so the normalize step reads one value per row for each."""
    groups, per_group = channel_shape[1:]
    channels = (2,)
    per_group_row = [ir.Load(buffer.name, store_layout_in_domain(buffer.layout, channel_shape, channels), "float32")
                     for buffer in (mean_fp32, rstd_fp32)]
    scale_expr = per_group_row[1]
    if weight is not None:
        value = ctx.value(weight)
        (stride,) = value.layout.strides
        weights = ir.Load(value.buffer, ir.Layout(channel_shape, (0, per_group * stride, stride), value.layout.offset),
                          value.dtype)
        scale_expr = ir.Op("mul", (scale_expr, weights))
    per_sample_layout = ir.Layout(channel_shape, (groups * per_group, per_group, 1), 0)
    buffers = []
    for stem, expr in (("channel_mean", per_group_row[0]), ("channel_scale", scale_expr)):
        buffer = ctx.scratch_buffer((channel_shape[0], groups * per_group), "float32", stem)
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), channel_shape, (ir.Store(buffer, expr, per_sample_layout),)))
        buffers.append(buffer)
    return buffers[0], buffers[1]


def _per_sample_channel(buffer: ir.Buffer, shape: tuple[int, ...]) -> ir.Load:
    """An fp32 [N, C] buffer read over the (N, C, *spatial) ``shape``: constant along the spatial dims."""
    strides = buffer.layout.strides + (0,) * (len(shape) - 2)
    return ir.Load(buffer.name, ir.Layout(tuple(shape), strides, 0), "float32")


@register_lowering(aten.native_group_norm.default, check=_check_group_norm, multi_output=True)
def lower_group_norm(ctx, node):
    """out = (x - mean) * rstd * weight[c] + bias[c], mean and rstd = 1 / sqrt(var + eps) per (n, group), computed
    as (x - mean[n, c]) * scale[n, c] + bias[c] (``_channel_mean_and_scale``)."""
    source_arg, weight, bias, _, _, _, groups, eps = node.args[:8]
    original = ctx.value(source_arg)
    source = _group_norm_source(ctx, node, original, groups)
    grouped = _group_domain(source.layout, groups)
    domain = grouped.shape
    reduce_dims = tuple(range(2, len(domain)))
    out_meta, mean_meta, rstd_meta = node.meta["val"]
    out, mean, rstd = (ctx.new_buffer(meta, stem) for meta, stem in
                       ((out_meta, "group_norm"), (mean_meta, "mean"), (rstd_meta, "rstd")))
    prologue = ir.Load(source.buffer, grouped, source.dtype)

    if _per_channel_first(domain):
        mean_fp32, rstd_fp32 = _emit_group_statistics_by_channel(ctx, domain, prologue, mean, rstd, eps)
    else:
        mean_fp32, rstd_fp32 = _emit_row_statistics(ctx, domain, reduce_dims, prologue, mean, rstd, eps, domain[:2])

    mean_by_channel, scale = _channel_mean_and_scale(ctx, domain[:3], mean_fp32, rstd_fp32, weight)
    # out = (x - mean) * scale + bias per (n, c), over the input's own (N, C, *spatial) domain, where every
    # per-channel operand is one value per row (x - mean first: a constant group gives its bias exactly)
    shape = original.layout.shape  # the input as given: a pointwise kernel reads any strides
    centered = ir.Op("sub", (ir.Load(original.buffer, original.layout, original.dtype),
                             _per_sample_channel(mean_by_channel, shape)))
    normalized = ir.Op("mul", (centered, _per_sample_channel(scale, shape)))
    if bias is not None:
        value = ctx.value(bias)
        strides = (0, *value.layout.strides) + (0,) * (len(shape) - 2)
        normalized = ir.Op("add", (normalized, ir.Load(value.buffer, ir.Layout(shape, strides, value.layout.offset),
                                                       value.dtype)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), shape, (ir.Store(out, normalized, out.layout),)))
    return tuple(TensorValue(buffer.name, buffer.layout, buffer.dtype) for buffer in (out, mean, rstd))


def _check_batch_norm_training(node: torch.fx.Node) -> str | None:
    source, weight, bias, running_mean, running_var, training, momentum, eps = node.args[:8]
    meta = source.meta["val"]
    if training is not True:
        return f"{node.target}: training={training!r} (its statistic outputs are empty tensors)"
    if not isinstance(eps, (int, float)) or eps < MIN_EPS:
        return f"{node.target}: eps={eps!r} (rsqrt(var + eps) needs eps >= 2**-87, its valid input range)"
    if not isinstance(momentum, (int, float)):
        return f"{node.target}: momentum={momentum!r}"
    if meta.dim() < 2:
        return f"{node.target}: rank {meta.dim()} input"
    if meta.numel() // meta.shape[1] < 2:
        return f"{node.target}: one value per channel (the unbiased running variance divides by 0)"
    reduce_dims = tuple(dim for dim in range(meta.dim()) if dim != 1)
    return row_shape_reason(node, meta, reduce_dims)


@register_lowering(aten._native_batch_norm_legit_functional.default, check=_check_batch_norm_training,
                   multi_output=True)
def lower_batch_norm_training(ctx, node):
    """Per channel c over (N, *spatial): out = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps) with
    the biased var; the new running stats are (1 - momentum) * running + momentum * stat, the variance's unbiased
    (times n / (n - 1)) as in eager."""
    source_arg, weight, bias, mean_arg, var_arg, _, momentum, eps = node.args[:8]
    domain = ctx.value(source_arg).layout.shape
    reduce_dims = tuple(dim for dim in range(len(domain)) if dim != 1)
    count = math.prod(size for dim, size in enumerate(domain) if dim != 1)
    out_meta, save_mean_meta, save_rstd_meta, new_mean_meta, new_var_meta = node.meta["val"]
    out = ctx.new_buffer(out_meta, "batch_norm")
    save_mean, save_rstd = ctx.new_buffer(save_mean_meta, "save_mean"), ctx.new_buffer(save_rstd_meta, "save_rstd")
    new_mean, new_var = ctx.new_buffer(new_mean_meta, "running_mean"), ctx.new_buffer(new_var_meta, "running_var")
    prologue = load(ctx, source_arg, domain)

    def per_channel(layout):  # a (C,) layout restated over the domain: stride 0 on the reduced dims
        return store_layout_in_domain(layout, domain, reduce_dims)

    def channel_store(buffer, expr):
        return ir.Store(buffer, expr, per_channel(buffer.layout))

    def channel_load(arg):
        value = ctx.value(arg)
        return ir.Load(value.buffer, per_channel(value.layout), value.dtype)

    def running_update(arg, statistic):
        kept = ir.Op("mul", (channel_load(arg), ir.Scalar(1.0 - float(momentum))))
        return ir.Op("add", (kept, ir.Op("mul", (statistic, ir.Scalar(float(momentum))))))

    mean_fp32, rstd_fp32 = (ctx.scratch_buffer((domain[1],), "float32", stem) for stem in ("mean_fp32", "rstd_fp32"))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "mean", prologue,
                          (channel_store(save_mean, ir.Result()), channel_store(mean_fp32, ir.Result()),
                           channel_store(new_mean, running_update(mean_arg, ir.Result())))))
    inverse_std = ir.Op("rsqrt", (ir.Op("add", (ir.Result(), ir.Scalar(float(eps)))),))
    unbiased = ir.Op("mul", (ir.Result(), ir.Scalar(count / (count - 1))))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "var", prologue,
                          (channel_store(save_rstd, inverse_std), channel_store(rstd_fp32, inverse_std),
                           channel_store(new_var, running_update(var_arg, unbiased))), correction=0.0))
    normalized = ir.Op("mul", (ir.Op("sub", (prologue, ir.Load(mean_fp32.name, per_channel(mean_fp32.layout),
                                                                 "float32"))),
                               ir.Load(rstd_fp32.name, per_channel(rstd_fp32.layout), "float32")))
    if weight is not None:
        normalized = ir.Op("mul", (normalized, channel_load(weight)))
    if bias is not None:
        normalized = ir.Op("add", (normalized, channel_load(bias)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (ir.Store(out, normalized, out.layout),)))
    return tuple(TensorValue(b.name, b.layout, b.dtype) for b in (out, save_mean, save_rstd, new_mean, new_var))
