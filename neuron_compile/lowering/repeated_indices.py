"""Lowering stage, indexing family: ``aten.index.Tensor`` whose indices are compile-time constants that repeat each
source element ``k`` times in a row, as nearest-neighbour upsampling by an integer factor is traced
(``F.interpolate(x, scale_factor=2, mode="nearest")``: ``index(x, [None, None, (arange(2H) * 0.5).long()[:, None],
(arange(2W) * 0.5).long()])``).

Input: the index node. Output: one copy kernel, no gather: each indexed output dim of size ``k * n`` is the pair
(source index, copy) read with strides (source stride, 0) and written with (k * out stride, out stride), the way
``repeat`` splits its dims. The index tensors depend on no graph input (arange and arithmetic on constants), so they
are evaluated here, on the CPU, and the pattern is read off their values; anything else is an ordinary gather. Why:
a VAE decoder's upsampler, gathered, needs one indirect DMA per 128 output rows (beyond the gather's tile limit at a
512-pixel image) where this is one strided copy.
"""

from __future__ import annotations

import torch

from neuron_compile.lowering.registry import MAX_RANK, TensorValue, emit_strided_copy

aten = torch.ops.aten

# Index tensors evaluated at compile time stay small: one index per output row or column.
MAX_CONSTANT_INDEX_ELEMENTS = 1 << 16


def constant_tensor(node, budget: int = 64) -> torch.Tensor | None:
    """The value of ``node`` when it depends on no graph input (evaluated on real CPU tensors: call it outside any
    fake mode), else None; ``budget`` bounds the depth of the computation followed."""
    if not isinstance(node, torch.fx.Node):
        return node
    if node.op != "call_function" or budget <= 0:
        return None
    meta = node.meta.get("val")
    if not isinstance(meta, torch.Tensor) or meta.numel() > MAX_CONSTANT_INDEX_ELEMENTS:
        return None
    operands = [*node.args, *node.kwargs.values()]
    if any(isinstance(arg, (list, tuple)) and any(isinstance(item, torch.fx.Node) for item in arg)
           for arg in operands):
        return None
    values = {}
    for arg in node.all_input_nodes:
        value = constant_tensor(arg, budget - 1)
        if value is None:
            return None
        values[arg] = value
    args = torch.fx.node.map_arg(node.args, values.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
    return node.target(*args, **kwargs)


def repeat_factors(node: torch.fx.Node) -> dict[int, int] | None:
    """{source dim: k} when ``node`` (aten.index.Tensor) picks source element ``o // k`` at output index ``o`` along
    each indexed dim (adjacent dims, indices an outer product), with every output size a multiple of its ``k``;
    else None."""
    if node.target is not aten.index.Tensor:
        return None
    # Real tensors even when a caller traces under a fake mode (the constants are computed, not traced).
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        return _repeat_factors(node)


def _repeat_factors(node: torch.fx.Node) -> dict[int, int] | None:
    source, indices = node.args[:2]
    positions = [position for position, item in enumerate(indices) if item is not None]
    if not positions or positions != list(range(positions[0], positions[-1] + 1)):
        return None
    values = [constant_tensor(indices[position]) for position in positions]
    if any(value is None or value.dtype not in (torch.int32, torch.int64) for value in values):
        return None
    shape = torch.broadcast_shapes(*(value.shape for value in values))
    if len(shape) != len(positions):
        return None
    factors = {}
    for axis, (position, value) in enumerate(zip(positions, values)):
        size, source_size = shape[axis], source.meta["val"].shape[position]
        factor = _factor(value.expand(shape), axis, size, source_size)
        if factor is None:
            return None
        factors[position] = factor
    rank = source.meta["val"].dim() + sum(1 for factor in factors.values() if factor > 1)
    return factors if rank <= MAX_RANK else None


def _factor(index: torch.Tensor, axis: int, size: int, source_size: int) -> int | None:
    """k when ``index`` is ``o // k`` along ``axis`` (and constant along the others), ``size`` a multiple of k."""
    line = index.movedim(axis, -1).reshape(-1, size)
    if size == 0 or not bool((line == line[:1]).all()):
        return None
    line = line[0]
    factor = int((line == line[0]).sum())  # how often the first source element repeats
    if factor < 1 or size % factor or size // factor > source_size:
        return None
    expected = torch.arange(size) // factor
    return factor if bool((line == expected).all()) else None


def lower_repeated_index(ctx, node: torch.fx.Node, factors: dict[int, int]) -> TensorValue:
    """One copy kernel over the output split into (source index, copy) pairs on the repeated dims."""
    value = ctx.value(node.args[0])
    buffer = ctx.output_buffer(node, "upsample")
    domain, read_strides, write_strides = [], [], []
    for dim, (size, stride, out_stride) in enumerate(zip(buffer.layout.shape, value.layout.strides,
                                                          buffer.layout.strides)):
        factor = factors.get(dim, 1)
        if factor == 1:
            domain, read_strides, write_strides = domain + [size], read_strides + [stride], write_strides + [out_stride]
            continue
        domain += [size // factor, factor]
        read_strides += [stride, 0]
        write_strides += [factor * out_stride, out_stride]
    return emit_strided_copy(ctx, value, buffer, domain, read_strides, write_strides)
