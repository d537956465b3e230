"""Lowering stage, movement family: views cost no kernel; cat becomes a copy kernel.

Input: an ATen FX node. Output: for view ops, a ``TensorValue`` that reads the producer's buffer through the
node's own sizes, strides and storage offset (from ``meta["val"]``: that is exactly an NKI access pattern);
clone is a pointwise copy (pointwise.py); cat is an ``ir.Concat``, one copy loop per input into its slice.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import (
    COMPLEX_INPUT_OPS,
    INTEGER_DTYPES,
    INTEGER_OPS,
    MAX_RANK,
    TensorValue,
    broadcast_layout,
    emit_strided_copy,
    register_empty_input_lowering,
    register_lowering,
)

aten = torch.ops.aten

VIEW_OPS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.alias.default,
)


RESHAPES = (aten.reshape.default, aten._unsafe_view.default)


def _check_view(node: torch.fx.Node) -> str | None:
    # A reshape of a non-contiguous tensor may copy; its result then owns new storage that we cannot view.
    source = node.args[0].meta.get("val")
    if source is None:
        return f"{node.target}: its input has no meta['val']"
    if node.target in RESHAPES and not source.is_contiguous():
        return f"{node.target}: a reshape of a non-contiguous tensor needs a copy"
    return None


def _offset_delta(node: torch.fx.Node, base: ir.Layout) -> int:
    """Elements a slice or select moves the start by (meta['val'] storage offsets are not reliable: tracing
    may fakeify every intermediate on its own storage)."""
    if node.target is aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        dim %= len(base.shape)
        start = 0 if start is None else start
        start = max(0, min(start + base.shape[dim] if start < 0 else start, base.shape[dim]))
        return start * base.strides[dim]
    if node.target is aten.select.int:
        dim, index = node.args[1] % len(base.shape), node.args[2]
        return (index % base.shape[dim]) * base.strides[dim]
    return 0


@register_lowering(*VIEW_OPS, check=_check_view)
def lower_view(ctx, node):
    base = ctx.value(node.args[0])
    result = node.meta["val"]
    if node.target not in RESHAPES:
        offset = base.layout.offset + _offset_delta(node, base.layout)
        return TensorValue(base.buffer, ir.Layout(tuple(result.shape), tuple(result.stride()), offset), base.dtype)
    # A reshape of a contiguous tensor: the same elements with contiguous strides, whatever storage tracing gave.
    layout = ir.Layout(tuple(result.shape), ir.contiguous_strides(tuple(result.shape)), base.layout.offset)
    return TensorValue(base.buffer, layout, base.dtype)


@register_lowering(aten.cat.default)
def lower_cat(ctx, node):
    tensors = node.args[0]
    output = ctx.output_buffer(node, "cat")
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(output.layout.shape)
    parts, starts, start = [], [], 0
    for tensor in tensors:
        value = ctx.value(tensor)
        shape = value.layout.shape
        if 0 in shape:  # contributes nothing (also the legacy 1-D empty tensor cat accepts)
            continue
        # The part's slice of the output: the output's strides, moved ``start`` along the cat dim.
        target = ir.Layout(shape, output.layout.strides, output.layout.offset + start * output.layout.strides[dim])
        source = ir.Load(value.buffer, value.layout, value.dtype)
        parts.append(ir.Pointwise(ctx.fresh_name("part"), shape, (ir.Store(output, source, target),)))
        starts.append(tuple(start if d == dim else 0 for d in range(len(shape))))
        start += shape[dim]
    if len(parts) == 1:  # one part covers the output (the others are empty, as a cache's first cat): a copy
        ctx.emit(parts[0])
    else:
        ctx.emit(ir.Concat(ctx.fresh_name("kernel"), output.layout.shape, tuple(parts), output, tuple(starts)))
    return TensorValue(output.name, output.layout, output.dtype)


@register_lowering(aten.split_with_sizes.default, aten.split.Tensor, multi_output=True)
def lower_split(ctx, node):
    """Each output is a slice of the input along ``dim``: the input's strides, the start moved along it."""
    base = ctx.value(node.args[0])
    rank = len(base.layout.shape)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % rank
    results, start = [], 0
    for meta in node.meta["val"]:
        shape = tuple(meta.shape)
        offset = base.layout.offset + start * base.layout.strides[dim]
        results.append(TensorValue(base.buffer, ir.Layout(shape, base.layout.strides, offset), base.dtype))
        start += shape[dim]
    return tuple(results)


# Some of the pieces may be empty (split sizes of 0): they are views too, no instruction reads them.
register_empty_input_lowering(aten.split_with_sizes.default, aten.split.Tensor)(lower_split)


def _check_diagonal(node: torch.fx.Node) -> str | None:
    return None if node.args[0].meta["val"].dim() >= 2 else f"{node.target}: fewer than 2 dims"


@register_lowering(aten.diagonal.default, check=_check_diagonal)
def lower_diagonal(ctx, node):
    """A view: the two dims merge into one last dim with stride s1 + s2, starting ``offset`` off the corner."""
    base = ctx.value(node.args[0])
    rank = len(base.layout.shape)
    offset = node.args[1] if len(node.args) > 1 else node.kwargs.get("offset", 0)
    dim1 = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim1", 0)) % rank
    dim2 = (node.args[3] if len(node.args) > 3 else node.kwargs.get("dim2", 1)) % rank
    strides = base.layout.strides
    start = offset * strides[dim2] if offset >= 0 else -offset * strides[dim1]
    kept = [d for d in range(rank) if d not in (dim1, dim2)]
    shape = tuple(node.meta["val"].shape)
    new_strides = tuple(strides[d] for d in kept) + (strides[dim1] + strides[dim2],)
    if shape[-1] == 0:
        start = 0
    return TensorValue(base.buffer, ir.Layout(shape, new_strides, base.layout.offset + start), base.dtype)


def _unbind_dim(node: torch.fx.Node) -> int:
    rank = node.args[0].meta["val"].dim()
    return (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank


def _check_unbind(node: torch.fx.Node) -> str | None:
    return None if node.args[0].meta["val"].dim() >= 1 else f"{node.target}: a 0-d tensor"


@register_lowering(aten.unbind.int, check=_check_unbind, multi_output=True)
def lower_unbind(ctx, node):
    """Each output is a select along ``dim``: the input's strides without that dim, the start moved."""
    base = ctx.value(node.args[0])
    dim = _unbind_dim(node)
    keep = [d for d in range(len(base.layout.shape)) if d != dim]
    shape, strides = tuple(base.layout.shape[d] for d in keep), tuple(base.layout.strides[d] for d in keep)
    starts = [base.layout.offset + i * base.layout.strides[dim] for i in range(base.layout.shape[dim])]
    return tuple(TensorValue(base.buffer, ir.Layout(shape, strides, start), base.dtype) for start in starts)


@register_lowering(aten.unbind_copy.int, check=_check_unbind, multi_output=True)
def lower_unbind_copy(ctx, node):
    """unbind, then one copy kernel per slice into a fresh buffer with eager's layout."""
    views = lower_unbind(ctx, node)
    results = []
    for view, meta in zip(views, node.meta["val"]):
        buffer = ctx.new_buffer(meta, "unbind")
        source = ir.Load(view.buffer, view.layout, view.dtype)
        store = ir.Store(buffer, source, buffer.layout)
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), buffer.layout.shape, (store,)))
        results.append(TensorValue(buffer.name, buffer.layout, buffer.dtype))
    return tuple(results)


def padded_copy(ctx, value: TensorValue | None, lead: tuple[int, ...], sizes, padding, totals, dtype: str,
                fill=None, band_value: float = 0.0, buffer: ir.Buffer | None = None) -> ir.Buffer:
    """``buffer`` (default: a fresh contiguous one) of shape (*lead, *totals): ``value`` (or the constant ``fill``)
    at offset ``padding`` in each padded dim, ``band_value`` elsewhere. Bands: for padded dim d, the slabs before
    and after the interior along d, over the interior of the dims before d and the whole extent of the dims after
    it, so every element is written exactly once (one Concat: the parts never overlap)."""
    shape = (*lead, *totals)
    buffer = buffer if buffer is not None else ctx.scratch_buffer(shape, dtype, "padded")
    strides = buffer.layout.strides
    nlead = len(lead)
    parts, boxes = [], []

    def part(starts, extents, expr):
        if 0 in extents:
            return
        offset = buffer.layout.offset + sum(start * stride for start, stride in zip(starts, strides))
        target = ir.Layout(tuple(extents), strides, offset)
        parts.append(ir.Pointwise(ctx.fresh_name("part"), tuple(extents), (ir.Store(buffer, expr, target),)))
        boxes.append(tuple(starts))

    interior_starts = [0] * nlead + list(padding)
    interior_extents = [*lead, *sizes]
    source = ir.Scalar(float(fill)) if fill is not None else ir.Load(value.buffer, value.layout, value.dtype)
    part(interior_starts, interior_extents, source)
    for d in range(len(sizes)):
        axis = nlead + d
        for start, extent in ((0, padding[d]), (padding[d] + sizes[d], totals[d] - padding[d] - sizes[d])):
            if extent <= 0:
                continue
            starts = interior_starts[:axis] + [start] + [0] * (len(shape) - axis - 1)
            extents = interior_extents[:axis] + [extent] + list(shape[axis + 1:])
            part(starts, extents, ir.Scalar(float(band_value)))
    ctx.emit(ir.Concat(ctx.fresh_name("kernel"), shape, tuple(parts), buffer, tuple(boxes)))
    return buffer


def _check_constant_pad(node: torch.fx.Node) -> str | None:
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if not isinstance(value, (int, float, bool)):
        return f"aten.constant_pad_nd: pad value {value!r} is not a number"
    if node.meta["val"].dtype in INTEGER_DTYPES and not (float(value).is_integer() and abs(value) < 2**31):
        return f"aten.constant_pad_nd: pad value {value!r} for an integer tensor"
    return None


# The interior is copied in the tensor's own dtype and the bands are memset: exact for every integer.
INTEGER_OPS.add(aten.constant_pad_nd.default)


@register_lowering(aten.constant_pad_nd.default, check=_check_constant_pad)
def lower_constant_pad_nd(ctx, node):
    # pad = (last dim low, last dim high, second-to-last low, ...); a negative pad cuts elements off that side:
    # slice the input's layout first, then write the (non-negative) bands and the interior into one buffer.
    value = ctx.value(node.args[0])
    pad = list(node.args[1])
    fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    rank = len(value.layout.shape)
    npadded = len(pad) // 2
    lead = value.layout.shape[: rank - npadded]
    sizes, offset = list(value.layout.shape), value.layout.offset
    low = [0] * rank
    high = [0] * rank
    for i in range(npadded):
        dim = rank - 1 - i
        low[dim], high[dim] = pad[2 * i], pad[2 * i + 1]
    for dim in range(rank):
        if low[dim] < 0:
            offset += -low[dim] * value.layout.strides[dim]
            sizes[dim] += low[dim]
        if high[dim] < 0:
            sizes[dim] += high[dim]
        sizes[dim] = max(sizes[dim], 0)
    interior = TensorValue(value.buffer, ir.Layout(tuple(sizes), value.layout.strides, offset), value.dtype)
    buffer = ctx.output_buffer(node, "pad")
    padded = list(range(rank - npadded, rank))
    padded_copy(ctx, interior, tuple(lead), [sizes[d] for d in padded], [max(low[d], 0) for d in padded],
                list(buffer.layout.shape[rank - npadded:]), buffer.dtype, band_value=fill, buffer=buffer)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


@register_lowering(aten.flip.default)
def lower_flip(ctx, node):
    """A copy that reads the input backwards on the flipped dims: a negative stride starting at the last element
    (access-pattern strides are signed int16 elements, nki-spec §1.6)."""
    base = ctx.value(node.args[0])
    rank = len(base.layout.shape)
    dims = {d % rank for d in node.args[1]} if rank else set()
    strides, offset = list(base.layout.strides), base.layout.offset
    for d in dims:
        offset += (base.layout.shape[d] - 1) * strides[d]
        strides[d] = -strides[d]
    source = ir.Load(base.buffer, ir.Layout(base.layout.shape, tuple(strides), offset), base.dtype)
    return emit_pointwise(ctx, node, source)


def _copy_of(ctx, node, layout: ir.Layout, base: TensorValue) -> TensorValue:
    """One copy kernel reading ``base`` through ``layout`` into a fresh buffer with eager's layout."""
    return emit_pointwise(ctx, node, ir.Load(base.buffer, layout, base.dtype))


@register_lowering(aten.permute_copy.default)
def lower_permute_copy(ctx, node):
    base = ctx.value(node.args[0])
    rank = len(base.layout.shape)
    order = [d % rank for d in node.args[1]]
    layout = ir.Layout(tuple(base.layout.shape[d] for d in order), tuple(base.layout.strides[d] for d in order),
                       base.layout.offset)
    return _copy_of(ctx, node, layout, base)


def _check_view_copy(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta.get("val")
    if source is None or not source.is_contiguous():
        return f"{node.target}: a view_copy of a non-contiguous tensor"
    return None


@register_lowering(aten.view_copy.default, check=_check_view_copy)
def lower_view_copy(ctx, node):
    base = ctx.value(node.args[0])
    shape = tuple(node.meta["val"].shape)
    return _copy_of(ctx, node, ir.Layout(shape, ir.contiguous_strides(shape), base.layout.offset), base)


@register_lowering(aten.narrow_copy.default)
def lower_narrow_copy(ctx, node):
    base = ctx.value(node.args[0])
    dim = node.args[1] % len(base.layout.shape)
    start = node.args[2] % base.layout.shape[dim] if node.args[2] < 0 else node.args[2]
    layout = ir.Layout(tuple(node.meta["val"].shape), base.layout.strides,
                       base.layout.offset + start * base.layout.strides[dim])
    return _copy_of(ctx, node, layout, base)


@register_lowering(aten.unfold.default)
def lower_unfold(ctx, node):
    """A view: windows of ``size`` every ``step`` along ``dim`` (stride step * s), the window a new last dim (s)."""
    base = ctx.value(node.args[0])
    rank = len(base.layout.shape)
    dim, step = (node.args[1] % rank if rank else 0), node.args[3]
    strides = list(base.layout.strides) if rank else []
    window = strides[dim] if rank else 0
    if rank:
        strides[dim] = step * window
    shape = tuple(node.meta["val"].shape)
    return TensorValue(base.buffer, ir.Layout(shape, (*strides, window), base.layout.offset), base.dtype)


def _slice_bounds(node: torch.fx.Node):
    """(dim, start, end, step) of a slice_scatter, normalized like ATen's slice (clamped to the dim)."""
    meta = node.args[0].meta["val"]
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % max(meta.dim(), 1)
    size = meta.shape[dim]
    start = node.args[3] if len(node.args) > 3 else node.kwargs.get("start")
    end = node.args[4] if len(node.args) > 4 else node.kwargs.get("end")
    step = node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = min(max(start, 0), size), min(max(end, start), size)
    return dim, start, end, step


def _slice_scatter_runs(size: int, start: int, end: int, step: int):
    """The output positions along the scattered dim as runs (first position, count, from_src): each run is every
    ``step``-th position of one residue class, all read from the input or all from src. With step 1 these are the
    three boxes before, inside and after the slice; with a step, each residue class is one run, and the class the
    slice walks is split into before / src / after."""
    count = len(range(start, end, step))
    runs = []
    for residue in range(min(step, size)):
        total = len(range(residue, size, step))
        if count == 0 or residue != start % step:
            runs.append((residue, total, False))
            continue
        first = (start - residue) // step
        runs += [(residue, first, False), (start, count, True), (start + count * step, total - first - count, False)]
    return [run for run in runs if run[1] > 0]


def _strided_part(ctx, value, buffer, dim: int, run, step: int) -> ir.Pointwise:
    """One run of a slice_scatter: ``count`` positions ``step`` apart along ``dim``, copied from ``value``
    (src, read whole along the dim, or the input, read at the same positions) into ``buffer``."""
    position, count, from_src = run
    shape = buffer.layout.shape
    extents = tuple(count if d == dim else n for d, n in enumerate(shape))
    read_first, read_step = (0, 1) if from_src else (position, step)
    read = ir.Layout(extents, tuple(stride * read_step if d == dim else stride
                                    for d, stride in enumerate(value.layout.strides)),
                     value.layout.offset + read_first * value.layout.strides[dim])
    write = ir.Layout(extents, tuple(stride * step if d == dim else stride
                                     for d, stride in enumerate(buffer.layout.strides)),
                      buffer.layout.offset + position * buffer.layout.strides[dim])
    expr = ir.Load(value.buffer, broadcast_layout(read, extents), value.dtype)
    if value.dtype != buffer.dtype:
        expr = ir.Op("cast", (expr,), dtype=buffer.dtype)
    return ir.Pointwise(ctx.fresh_name("part"), extents, (ir.Store(buffer, expr, write),))


@register_lowering(aten.slice_scatter.default)
def lower_slice_scatter(ctx, node):
    # out = input with out[..., start:end:step, ...] = src along dim: non-overlapping runs of one Concat (the input
    # before the slice, src, the input after it; with a step, also the residue classes the slice skips), each
    # position written exactly once. Runs of a step are strided, not boxes: their places stay unknown (no epilogue
    # is distributed over them).
    dim, start, end, step = _slice_bounds(node)
    source, src = ctx.value(node.args[0]), ctx.value(node.args[1])
    buffer = ctx.output_buffer(node, "slice_scatter")
    shape = buffer.layout.shape
    runs = _slice_scatter_runs(shape[dim], start, end, step)
    parts = tuple(_strided_part(ctx, src if run[2] else source, buffer, dim, run, step) for run in runs)
    starts = tuple(tuple(run[0] if d == dim else 0 for d in range(len(shape))) for run in runs) if step == 1 else ()
    ctx.emit(ir.Concat(ctx.fresh_name("kernel"), shape, parts, buffer, starts))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _repeats(node: torch.fx.Node) -> list[int]:
    return list(node.args[1])


def _repeat_copy_rank(node: torch.fx.Node) -> int:
    """Dims of the copy's domain: two for a dim both repeated and longer than 1, one otherwise."""
    repeats = _repeats(node)
    sizes = (1,) * (len(repeats) - node.args[0].meta["val"].dim()) + tuple(node.args[0].meta["val"].shape)
    return sum(2 if repeat > 1 and size > 1 else 1 for repeat, size in zip(repeats, sizes))


def _check_repeat(node: torch.fx.Node) -> str | None:
    rank = _repeat_copy_rank(node)
    if rank > MAX_RANK:
        return (f"aten.repeat: the copy needs {rank} dims (two per dim both repeated and longer than 1; "
                f"limit {MAX_RANK})")
    return None


@register_lowering(aten.repeat.default, check=_check_repeat)
def lower_repeat(ctx, node):
    # Output dim k of size r_k * s_k is the pair (copy index, source index): the source read with stride 0 on
    # the copy index, the output written through its own strides split in two. One copy kernel, no index math.
    # A dim repeated once, or of size 1, needs no split (VAEs repeat one frame of a 5-D video: (1, 1, k, 1, 1)).
    value = ctx.value(node.args[0])
    repeats = _repeats(node)
    pad = len(repeats) - len(value.layout.shape)
    sizes = (1,) * pad + value.layout.shape
    strides = (0,) * pad + value.layout.strides
    buffer = ctx.output_buffer(node, "repeat")
    domain, read_strides, write_strides = [], [], []
    for repeat, size, stride, out_stride in zip(repeats, sizes, strides, buffer.layout.strides):
        if repeat == 1:
            domain, read_strides, write_strides = domain + [size], read_strides + [stride], write_strides + [out_stride]
        elif size == 1:
            domain, read_strides, write_strides = domain + [repeat], read_strides + [0], write_strides + [out_stride]
        else:
            domain += [repeat, size]
            read_strides += [0, stride]
            write_strides += [size * out_stride, out_stride]
    return emit_strided_copy(ctx, value, buffer, domain, read_strides, write_strides)


def _check_view_as_real(node: torch.fx.Node) -> str | None:
    source = node.args[0]
    if source.meta["val"].dtype is not torch.complex64 or source.op != "placeholder":
        return (f"{node.target}: only of a complex64 graph input (other complex values are pairs already, "
                "passes/complex_pairs.py)")
    return None


@register_lowering(aten.view_as_real.default, check=_check_view_as_real)
def lower_view_as_real(ctx, node):
    # The input's buffer already holds its fp32 pairs (registry.input_layout): the view is that buffer as it is.
    return ctx.value(node.args[0])


COMPLEX_INPUT_OPS.add(aten.view_as_real.default)
