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
from neuron_compile.lowering.reduction import _row_shape_reason, store_layout_in_domain
from neuron_compile.lowering.registry import TensorValue, register_lowering

aten = torch.ops.aten


def _expand(value, dims: int, default=None) -> list[int]:
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
    kernel = _expand(values["kernel_size"], dims)
    stride = _expand(values["stride"], dims, kernel)
    padding = _expand(values["padding"], dims)
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
        return _row_shape_reason(node, fake, tuple(range(len(window) - dims, len(window))))

    return check


def _windows(layout: ir.Layout, nlead: int, stride, outs, kernel) -> ir.Layout:
    """The unfold view: (*lead, *out, *kernel) over a (*lead, *pooled) layout."""
    lead_strides, pooled = layout.strides[:nlead], layout.strides[nlead:]
    return ir.Layout((*layout.shape[:nlead], *outs, *kernel),
                     (*lead_strides, *(s * st for s, st in zip(stride, pooled)), *pooled), layout.offset)


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
    out = ctx.output_buffer(node, "avg_pool")
    store = ir.Store(out, ir.Op("div", (ir.Result(), divisor)),
                     store_layout_in_domain(out.layout, domain, reduce_dims))
    ctx.emit(ir.Reduction(ctx.fresh_name("kernel"), domain, reduce_dims, "sum", window_load, (store,)))
    return TensorValue(out.name, out.layout, out.dtype)


@register_lowering(aten.avg_pool2d.default, check=_check_avg_pool(2))
def lower_avg_pool2d(ctx, node):
    return _lower_avg_pool(ctx, node, 2)


@register_lowering(aten.avg_pool3d.default, check=_check_avg_pool(3))
def lower_avg_pool3d(ctx, node):
    return _lower_avg_pool(ctx, node, 3)




# ---------------------------------------------------------------- adaptive average pooling


def _adaptive_windows(size: int, out: int) -> list[tuple[int, int]]:
    """ATen's adaptive windows: [floor(o * size / out), ceil((o + 1) * size / out)) for each output o."""
    return [((o * size) // out, -((-(o + 1) * size) // out)) for o in range(out)]


def _check_adaptive_avg_pool(dims: int):
    def check(node: torch.fx.Node) -> str | None:
        meta = node.args[0].meta["val"]
        if meta.dtype != torch.float32:
            # The pooling matrices hold 1 / window length in fp32; nc_matmul cannot mix them with bf16 data.
            return f"{node.target}: dtype {meta.dtype} (fp32 pooling matrices)"
        if meta.dim() not in (dims + 1, dims + 2):
            return f"{node.target}: rank {meta.dim()} input"
        sizes, outs = list(meta.shape[-dims:]), list(node.meta["val"].shape[-dims:])
        if max(outs) > 128:
            return f"{node.target}: output size {outs} (one pooling-matrix part per output row, limit 128)"
        return None

    return check


def _pooling_matrix(ctx, size: int, out: int) -> ir.Buffer:
    """(out, size) fp32: row o holds 1 / len over its window and 0 elsewhere, written by one Concat of constants."""
    matrix = ctx.scratch_buffer((out, size), "float32", "pooling_matrix")
    parts = []
    for o, (start, end) in enumerate(_adaptive_windows(size, out)):
        for lo, hi, value in ((0, start, 0.0), (start, end, 1.0 / (end - start)), (end, size, 0.0)):
            if hi > lo:
                target = ir.Layout((1, hi - lo), matrix.layout.strides, o * size + lo)
                parts.append(ir.Pointwise(ctx.fresh_name("part"), (1, hi - lo),
                                          (ir.Store(matrix, ir.Scalar(value), target),)))
    ctx.emit(ir.Concat(ctx.fresh_name("kernel"), (out, size), tuple(parts), matrix))
    return matrix


def _lower_adaptive_avg_pool(ctx, node, dims: int):
    """Separable: each pooled dim d is a matmul with its pooling matrix P_d (out_d, size_d), one dim at a time.
    For d before the last, P_d is the stationary operand (M = out_d, N = the last dim); for the last dim the data
    is (M = the dim before it, K = size_d) and P_d^T the moving operand. Intermediates are fp32 scratch."""
    source = ctx.value(node.args[0])
    rank = len(source.layout.shape)
    out = ctx.output_buffer(node, "adaptive_avg_pool")
    pooled = [d for d in range(rank - dims, rank) if source.layout.shape[d] != out.layout.shape[d]]
    current = ir.Load(source.buffer, source.layout, source.dtype)
    if not pooled:  # every window is one element: a copy
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), out.layout.shape, (ir.Store(out, current, out.layout),)))
    shape = list(source.layout.shape)
    for index, d in enumerate(pooled):
        size, target_size = shape[d], out.layout.shape[d]
        matrix = _pooling_matrix(ctx, size, target_size)
        shape[d] = target_size
        if index == len(pooled) - 1:
            result, result_layout = out, out.layout
        else:
            result = ctx.scratch_buffer(tuple(shape), "float32", "pooled")
            result_layout = result.layout
        last = rank - 1
        if d != last:
            m_dim, n_dim = d, last
        else:
            m_dim, n_dim = last - 1, d
        batch = [dim for dim in range(rank) if dim not in (m_dim, n_dim) and dim != d]
        if d != last:
            batch = [dim for dim in range(rank) if dim not in (d, last)]
        domain = (*(shape[dim] for dim in batch), shape[m_dim], shape[n_dim])
        zeros = (0,) * len(batch)
        data = current.layout.strides
        if d != last:
            a = ir.Load(matrix.name, ir.Layout((*domain[:-1], size), (*zeros, size, 1)), "float32")
            b = ir.Load(current.buffer, ir.Layout((*domain[:-2], size, domain[-1]),
                                                  (*(data[dim] for dim in batch), data[d], data[last]),
                                                  current.layout.offset), current.dtype)
        else:
            a = ir.Load(current.buffer, ir.Layout((*domain[:-1], size),
                                                  (*(data[dim] for dim in batch), data[m_dim], data[d]),
                                                  current.layout.offset), current.dtype)
            b = ir.Load(matrix.name, ir.Layout((*domain[:-2], size, domain[-1]), (*zeros, 1, size)), "float32")
        strides = result_layout.strides
        store_layout = ir.Layout(domain, (*(strides[dim] for dim in batch), strides[m_dim], strides[n_dim]),
                                 result_layout.offset)
        ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, size, a, b, (ir.Store(result, ir.Result(), store_layout),)))
        current = ir.Load(result.name, result_layout, result.dtype)
    return TensorValue(out.name, out.layout, out.dtype)


@register_lowering(aten._adaptive_avg_pool2d.default, check=_check_adaptive_avg_pool(2))
def lower_adaptive_avg_pool2d(ctx, node):
    return _lower_adaptive_avg_pool(ctx, node, 2)


@register_lowering(aten._adaptive_avg_pool3d.default, check=_check_adaptive_avg_pool(3))
def lower_adaptive_avg_pool3d(ctx, node):
    return _lower_adaptive_avg_pool(ctx, node, 3)
