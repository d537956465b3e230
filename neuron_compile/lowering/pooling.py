"""Lowering stage, pooling family: avg_pool2d and avg_pool3d (avg_pool1d arrives as avg_pool2d of an unsqueeze).

Input: an ATen FX node. Output: up to four IR nodes —

* with padding (or a ceil_mode window running past the input), a zero-padded copy of the input: an
  ``ir.Concat`` whose parts are the interior copy and zero bands around it (no load ever leaves the input);
* when the divisor differs between windows (padding not counted, or a ceil_mode overhang), the per-window
  element count, as the same window sum over a padded 0/1 mask (the count is separable, so the mask needs only
  the pooled dims);
* the window sum: an ``ir.Reduction`` over the domain (*leading, *out, *kernel) whose load walks the padded
  input through an unfold access pattern (out dim stride = pool stride * input stride, kernel dim stride =
  input stride), its store dividing by the count (or the constant divisor) as eager does.

The divisor follows ATen's CPU kernel: a window clipped to the padded extent [-pad, size + pad) when padding
counts, to the input [0, size) when it does not, or ``divisor_override``.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.movement import padded_copy
from neuron_compile.lowering.reduction import row_shape_reason, store_layout_in_domain
from neuron_compile.lowering.registry import TensorValue, register_lowering

aten = torch.ops.aten


def expand_per_dim(value, dims: int, default=None) -> list[int]:
    """A pooling argument (an int, a 1-list or one entry per dim; None or [] means ``default``) as ``dims`` ints."""
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        value = default
    if isinstance(value, int):
        return [value] * dims
    value = list(value)
    return value * dims if len(value) == 1 else value


def _pool_arguments(node: torch.fx.Node, dims: int) -> dict:
    """ATen's avg_pool{2,3}d arguments, with the output sizes from the node's meta and per-dim window counts."""
    names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    defaults = (None, None, None, 0, False, True, None)
    values = {name: node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
              for i, (name, default) in enumerate(zip(names, defaults))}
    kernel = expand_per_dim(values["kernel_size"], dims)
    stride = expand_per_dim(values["stride"], dims, kernel)
    padding = expand_per_dim(values["padding"], dims)
    sizes = list(node.args[0].meta["val"].shape[-dims:])
    outs = list(node.meta["val"].shape[-dims:])
    # Padded extent each dim needs: the left padding, the input, and whatever the last window reaches.
    totals = [max(p + n, (o - 1) * s + k) for p, n, o, s, k in zip(padding, sizes, outs, stride, kernel)]
    counted = []  # per dim, the padded-coordinate range whose elements the divisor counts
    for p, n, total in zip(padding, sizes, totals):
        counted.append((0, min(total, n + 2 * p)) if values["count_include_pad"] else (p, p + n))
    counts = [[max(0, min(o * s + k, hi) - max(o * s, lo)) for o in range(out)]
              for out, s, k, (lo, hi) in zip(outs, stride, kernel, counted)]
    inside = [[max(0, min(o * s + k, p + n) - max(o * s, p)) for o in range(out)]
              for out, s, k, p, n in zip(outs, stride, kernel, padding, sizes)]
    return dict(values, kernel=kernel, stride=stride, padding=padding, sizes=sizes, outs=outs, totals=totals,
                counted=counted, counts=counts, inside=inside)


def _check_avg_pool(dims: int):
    def check(node: torch.fx.Node) -> str | None:
        meta = node.args[0].meta["val"]
        if meta.dim() not in (dims + 1, dims + 2):
            return f"{node.target}: rank {meta.dim()} input"
        args = _pool_arguments(node, dims)
        if not all(len(args[key]) == dims for key in ("kernel", "stride", "padding")):
            return f"{node.target}: kernel/stride/padding do not have {dims} entries"
        override = args["divisor_override"]
        if override is not None and (not isinstance(override, int) or override == 0):
            return f"{node.target}: divisor_override={override!r}"
        if any(count == 0 for per_dim in args["inside"] for count in per_dim):
            # ATen writes 0 for a window that holds no input element; we would divide a zero sum instead.
            return f"{node.target}: a window lies wholly in the padding"
        window = (*meta.shape[:-dims], *args["outs"], *args["kernel"])
        fake = torch.empty(window, device="meta")
        return row_shape_reason(node, fake, tuple(range(len(window) - dims, len(window))))

    return check


def _windows(layout: ir.Layout, nlead: int, stride, outs, kernel) -> ir.Layout:
    """The unfold view: (*lead, *out, *kernel) over a (*lead, *pooled) layout."""
    lead_strides, pooled = layout.strides[:nlead], layout.strides[nlead:]
    return ir.Layout((*layout.shape[:nlead], *outs, *kernel),
                     (*lead_strides, *(s * st for s, st in zip(stride, pooled)), *pooled), layout.offset)


def _window_mean(ctx, out: ir.Buffer, domain, reduce_dims, window_load: ir.Load, divisor: ir.Expr) -> TensorValue:
    """The window sum of ``window_load`` over ``reduce_dims``, divided by ``divisor`` on the way out."""
    store = ir.Store(out, ir.Op("div", (ir.Result(), divisor)), store_layout_in_domain(out.layout, domain, reduce_dims))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "sum", window_load, (store,)))
    return TensorValue(out.name, out.layout, out.dtype)


def _lower_avg_pool(ctx, node, dims: int):
    args = _pool_arguments(node, dims)
    source = ctx.value(node.args[0])
    lead = source.layout.shape[:-dims]
    nlead = len(lead)
    kernel, stride, padding, sizes, outs, totals = (args[key] for key in
                                                    ("kernel", "stride", "padding", "sizes", "outs", "totals"))
    needs_padding = any(padding) or any(t > n for t, n in zip(totals, sizes))
    if needs_padding:
        padded = padded_copy(ctx, source, lead, sizes, padding, totals, source.dtype)
        data = ir.Layout(padded.layout.shape, padded.layout.strides, 0)
        data_buffer, data_dtype = padded.name, padded.dtype
    else:
        data, data_buffer, data_dtype = source.layout, source.buffer, source.dtype
    domain = (*lead, *outs, *kernel)
    reduce_dims = tuple(range(nlead + dims, len(domain)))
    window_load = ir.Load(data_buffer, _windows(data, nlead, stride, outs, kernel), data_dtype)

    if args["divisor_override"] is not None:
        divisor = ir.Scalar(float(args["divisor_override"]))
    elif all(len(set(per_dim)) == 1 for per_dim in args["counts"]):
        divisor = ir.Scalar(float(math.prod(per_dim[0] for per_dim in args["counts"])))
    else:
        # Per-window counts: the window sum of a 0/1 mask over the pooled dims that marks the counted range.
        starts = [lo for lo, _ in args["counted"]]
        extents = [hi - lo for lo, hi in args["counted"]]
        mask = padded_copy(ctx, None, (), extents, starts, totals, "float32", fill=1.0)
        count_domain = (*outs, *kernel)
        count = ctx.scratch_buffer(tuple(outs), "float32", "window_count")
        store = ir.Store(count, ir.Result(), store_layout_in_domain(count.layout, count_domain,
                                                                    tuple(range(dims, 2 * dims))))
        ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), count_domain, tuple(range(dims, 2 * dims)), "sum",
                              ir.Load(mask.name, _windows(mask.layout, 0, stride, outs, kernel), "float32"), (store,)))
        count_layout = ir.Layout(domain, (0,) * nlead + count.layout.strides + (0,) * dims)
        divisor = ir.Load(count.name, count_layout, "float32")
    return _window_mean(ctx, ctx.output_buffer(node, "avg_pool"), domain, reduce_dims, window_load, divisor)


@register_lowering(aten.avg_pool2d.default, check=_check_avg_pool(2))
def lower_avg_pool2d(ctx, node):
    return _lower_avg_pool(ctx, node, 2)


@register_lowering(aten.avg_pool3d.default, check=_check_avg_pool(3))
def lower_avg_pool3d(ctx, node):
    return _lower_avg_pool(ctx, node, 3)




# ---------------------------------------------------------------- adaptive average pooling


def _check_adaptive_avg_pool(dims: int):
    def check(node: torch.fx.Node) -> str | None:
        meta = node.args[0].meta["val"]
        if meta.dim() not in (dims + 1, dims + 2):
            return f"{node.target}: rank {meta.dim()} input"
        sizes, outs = list(meta.shape[-dims:]), list(node.meta["val"].shape[-dims:])
        if any(size % out for size, out in zip(sizes, outs)):
            # Uneven windows (ATen's [floor(o * I / O), ceil((o + 1) * I / O))) have no single unfold view. A
            # matmul with a 0 / (1 / len) pooling matrix would cover them, but 0 * inf = nan leaks a non-finite
            # input into every output of its row (eager keeps the other windows finite): not claimed.
            return f"{node.target}: input {sizes} not a multiple of output {outs} (uneven windows)"
        return None

    return check


def _lower_adaptive_avg_pool(ctx, node, dims: int):
    """Even windows (each pooled size a multiple of its output size): avg_pool with kernel = stride = size / out,
    no padding — the window sum of an unfold view, divided by the window's element count (uneven windows are
    declined by the check)."""
    source = ctx.value(node.args[0])
    out = ctx.output_buffer(node, "adaptive_avg_pool")
    lead = source.layout.shape[:-dims]
    nlead = len(lead)
    sizes, outs = source.layout.shape[-dims:], out.layout.shape[-dims:]
    kernel = tuple(size // o for size, o in zip(sizes, outs))
    domain = (*lead, *outs, *kernel)
    reduce_dims = tuple(range(nlead + dims, len(domain)))
    window_load = ir.Load(source.buffer, _windows(source.layout, nlead, kernel, outs, kernel), source.dtype)
    return _window_mean(ctx, out, domain, reduce_dims, window_load, ir.Scalar(float(math.prod(kernel))))


@register_lowering(aten._adaptive_avg_pool2d.default, check=_check_adaptive_avg_pool(2))
def lower_adaptive_avg_pool2d(ctx, node):
    return _lower_adaptive_avg_pool(ctx, node, 2)


@register_lowering(aten._adaptive_avg_pool3d.default, check=_check_adaptive_avg_pool(3))
def lower_adaptive_avg_pool3d(ctx, node):
    return _lower_adaptive_avg_pool(ctx, node, 3)
