"""Lowering stage, indexing family: gathers through the indirect DMA (index_select, embedding, index.Tensor).

Input: an ATen FX node whose index operand is an int32/int64 tensor (int32 kernel dtype, registry.py). Output:
one ``ir.Gather`` writing a fresh buffer with eager's strides (rendered by codegen/gather.py). Negative indices
wrap as in eager (index.Tensor only; index_select and embedding reject them); an out-of-range index makes the kernel's DMA fail its bounds check, so the region falls back
to eager, which raises IndexError. Views of integer tensors are free like float views (they only change the
access pattern), so they join INTEGER_OPS here.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER, OUT_OF_RANGE_ROW
from neuron_compile.lowering.movement import VIEW_OPS
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import (
    INTEGER_ARITHMETIC_OPS,
    INTEGER_DTYPES,
    INTEGER_OPS,
    TensorValue,
    broadcast_layout,
    register_lowering,
)
from neuron_compile.lowering.repeated_indices import lower_repeated_index, repeat_factors

aten = torch.ops.aten

GATHER_FREE_BYTES = 64 * 1024  # one gathered row tile per partition: well inside the SBUF partition budget
GATHER_MAX_ITERATIONS = 4096  # outer loop iterations x index tiles (a long Python loop in the simulator)
FLOAT_SOURCES = (torch.float32, torch.bfloat16)

INTEGER_OPS.update(VIEW_OPS)


def _gather_operands(node: torch.fx.Node):
    """(source node, dim, index node) of a gather node, or a reason string."""
    if node.target is aten.index_select.default:
        source, dim, index = node.args[:3]
        return source, dim, index
    if node.target is aten.embedding.default:
        weight, index = node.args[:2]
        return weight, 0, index
    source, indices = node.args[:2]
    tensors = [(position, item) for position, item in enumerate(indices) if item is not None]
    if len(tensors) != 1:
        return f"{node.target}: {len(tensors)} index tensors"
    position, index = tensors[0]
    return source, position, index


def _check_gather(node: torch.fx.Node) -> str | None:
    if node.args[0].meta["val"].dtype in FLOAT_SOURCES and repeat_factors(node) is not None:
        return None  # nearest upsampling: a strided copy (repeated_indices.py), none of a gather's limits
    if _several_indices(node):
        return _check_multi_index(node)
    operands = _gather_operands(node)
    if isinstance(operands, str):
        return operands
    source, dim, index = operands
    if not isinstance(source, torch.fx.Node) or not isinstance(index, torch.fx.Node):
        return f"{node.target}: operands must be tensors"
    source_val, index_val = source.meta["val"], index.meta["val"]
    if source_val.dtype not in FLOAT_SOURCES:
        return f"{node.target}: source dtype {source_val.dtype} (only float32, bfloat16 sources)"
    if index_val.dtype not in INTEGER_DTYPES:
        return f"{node.target}: index dtype {index_val.dtype} (only int32, int64; bool masks are not gathers)"
    if source_val.dim() == 0:
        return f"{node.target}: 0-d source"
    if node.target is aten.embedding.default and source_val.dim() != 2:
        return f"{node.target}: weight of rank {source_val.dim()} (only 2-D)"
    dim = dim % source_val.dim()
    size, stride = source_val.shape[dim], source_val.stride()[dim]
    if size >= FP32_EXACT_INTEGER:
        return f"{node.target}: dim size {size} >= 2^24 (the index arithmetic runs in fp32)"
    if stride == 0 and size > 1:
        return f"{node.target}: gathered dim has stride 0 (an expanded source)"
    span = source_val.storage_offset() + 1 + sum((s - 1) * abs(t) for s, t in zip(source_val.shape, source_val.stride()))
    if span >= OUT_OF_RANGE_ROW:
        return f"{node.target}: source spans {span} elements (>= 2^30, out-of-range redirect would land inside)"
    trailing = source_val.shape[dim + 1:]
    if len(trailing) > 3:
        return f"{node.target}: {len(trailing)} dims after the gathered one (access pattern has 4 dims at most)"
    free_bytes = math.prod(trailing) * source_val.element_size()
    if free_bytes > GATHER_FREE_BYTES:
        return f"{node.target}: gathered rows of {free_bytes} bytes (> {GATHER_FREE_BYTES} per partition)"
    index_shape = tuple(index_val.shape) or (1,)
    iterations = math.prod(source_val.shape[:dim]) * math.prod(index_shape[:-1]) * math.ceil(index_shape[-1] / 128)
    if iterations > GATHER_MAX_ITERATIONS:
        return f"{node.target}: {iterations} gather tiles (> {GATHER_MAX_ITERATIONS})"
    return None


def _several_indices(node: torch.fx.Node) -> bool:
    return node.target is aten.index.Tensor and sum(item is not None for item in node.args[1]) > 1


@register_lowering(aten.index_select.default, aten.embedding.default, aten.index.Tensor, check=_check_gather)
def lower_gather(ctx, node):
    factors = repeat_factors(node) if node.args[0].meta["val"].dtype in FLOAT_SOURCES else None
    if factors is not None:
        return lower_repeated_index(ctx, node, factors)
    if _several_indices(node):
        return lower_multi_index(ctx, node)
    source_node, dim, index_node = _gather_operands(node)
    source, index = ctx.value(source_node), ctx.value(index_node)
    dim = dim % len(source.layout.shape)
    index_layout = index.layout
    if not index_layout.shape:  # a 0-d index is a one-element index dim
        index_layout = ir.Layout((1,), (0,), index_layout.offset)
    buffer = ctx.output_buffer(node, "gather")
    domain = source.layout.shape[:dim] + index_layout.shape + source.layout.shape[dim + 1:]
    out_layout = buffer.layout
    if out_layout.shape != domain:  # the 0-d index dropped its dim from the output: restate it with size 1
        out_layout = ir.Layout(domain, out_layout.strides[:dim] + (0,) + out_layout.strides[dim:], out_layout.offset)
    gather = ir.Gather(
        ctx.fresh_name("kernel"), domain, dim, ir.Load(source.buffer, source.layout, source.dtype),
        ir.Load(index.buffer, index_layout, index.dtype), (ir.Store(buffer, ir.Result(), out_layout),),
        wrap_negative=node.target is aten.index.Tensor,
    )
    ctx.emit(gather)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


INTEGER_OPS.update((aten.index_select.default, aten.embedding.default, aten.index.Tensor))


def _element_gather_limits(node: torch.fx.Node, source_val: torch.Tensor, out: torch.Tensor) -> str | None:
    """The element gather's limits: flat source offsets exact in fp32, and a bounded number of tiles."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(source_val.shape, source_val.stride()))
    span = source_val.storage_offset() + 1 + extent
    if span >= FP32_EXACT_INTEGER:
        return f"{node.target}: source spans {span} elements (>= 2^24: flat offsets are computed in fp32)"
    tiles = math.prod(out.shape[:-1]) * math.ceil(out.shape[-1] / 128)
    if tiles > GATHER_MAX_ITERATIONS:
        return f"{node.target}: {tiles} gather tiles (> {GATHER_MAX_ITERATIONS})"
    return None


def _check_element_gather(node: torch.fx.Node) -> str | None:
    source, dim, index = node.args[:3]
    if node.kwargs.get("sparse_grad", False) or (len(node.args) > 3 and node.args[3]):
        return f"{node.target}: sparse_grad"
    source_val, index_val, out = source.meta["val"], index.meta["val"], node.meta["val"]
    if source_val.dtype not in FLOAT_SOURCES:
        return f"{node.target}: source dtype {source_val.dtype} (only float32, bfloat16 sources)"
    if index_val.dtype not in INTEGER_DTYPES:
        return f"{node.target}: index dtype {index_val.dtype} (only int32, int64)"
    if out.dim() == 0 or source_val.dim() != out.dim():
        return f"{node.target}: 0-d operands (only tensors of rank >= 1)"
    return _element_gather_limits(node, source_val, out)


@register_lowering(aten.gather.default, check=_check_element_gather)
def lower_element_gather(ctx, node):
    source, dim, index = node.args[:3]
    source, index = ctx.value(source), ctx.value(index)
    buffer = ctx.output_buffer(node, "gather")
    domain = buffer.layout.shape
    dim = dim % len(domain)
    # The output coordinates address the source directly on every dim but ``dim``, which the index drives.
    strides = tuple(0 if d == dim else stride for d, stride in enumerate(source.layout.strides))
    base = ir.Load(source.buffer, ir.Layout(domain, strides, source.layout.offset), source.dtype)
    index_load = ir.Load(index.buffer, index.layout, index.dtype)
    entry = (index_load, source.layout.strides[dim], source.layout.shape[dim], False)
    gather = ir.Gather(ctx.fresh_name("kernel"), domain, dim, base, index_load,
                       (ir.Store(buffer, ir.Result(), buffer.layout),), elements=True, indices=(entry,))
    ctx.emit(gather)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _multi_index(node: torch.fx.Node):
    """(position of the first index, index nodes, broadcast shape) of index.Tensor with adjacent indices."""
    source, indices = node.args[:2]
    positions = [position for position, item in enumerate(indices) if item is not None]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        return f"{node.target}: index tensors on non-adjacent dims (the result's dims move to the front)"
    shapes = [tuple(indices[position].meta["val"].shape) for position in positions]
    return positions[0], [indices[position] for position in positions], tuple(torch.broadcast_shapes(*shapes))


def _check_multi_index(node: torch.fx.Node) -> str | None:
    source = node.args[0]
    source_val, out = source.meta["val"], node.meta["val"]
    indexed = _multi_index(node)
    if isinstance(indexed, str):
        return indexed
    position, indices, shape = indexed
    if source_val.dtype not in FLOAT_SOURCES:
        return f"{node.target}: source dtype {source_val.dtype} (only float32, bfloat16 sources)"
    if any(index.meta["val"].dtype not in INTEGER_DTYPES for index in indices):
        return f"{node.target}: index dtypes (only int32, int64; bool masks are not gathers)"
    expected = tuple(source_val.shape[:position]) + shape + tuple(source_val.shape[position + len(indices):])
    if out.dim() == 0 or tuple(out.shape) != expected:
        return f"{node.target}: result shape {list(out.shape)} (only rank >= 1 results of adjacent indices)"
    return _element_gather_limits(node, source_val, out)


def lower_multi_index(ctx, node):
    position, indices, shape = _multi_index(node)
    source = ctx.value(node.args[0])
    buffer = ctx.output_buffer(node, "gather")
    domain = buffer.layout.shape
    count, after = len(indices), len(source.layout.shape) - position - len(indices)
    strides = source.layout.strides[:position] + (0,) * len(shape) + source.layout.strides[position + count:]
    base = ir.Load(source.buffer, ir.Layout(domain, strides, source.layout.offset), source.dtype)
    entries = []
    for k, index_node in enumerate(indices):
        index = ctx.value(index_node)
        spread = broadcast_layout(index.layout, shape)
        layout = ir.Layout(domain, (0,) * position + spread.strides + (0,) * after, spread.offset)
        d = position + k
        entries.append((ir.Load(index.buffer, layout, index.dtype), source.layout.strides[d], source.layout.shape[d],
                        True))
    gather = ir.Gather(ctx.fresh_name("kernel"), domain, position, base, entries[0][0],
                       (ir.Store(buffer, ir.Result(), buffer.layout),), elements=True, indices=tuple(entries))
    ctx.emit(gather)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


INTEGER_OPS.add(aten.gather.default)


ARANGE_MAX = 2**20  # elements checked against eager at compile time (and far below 2^24, exact as fp32)


def _arange_args(node: torch.fx.Node):
    if node.target is aten.arange.default:
        return 0, node.args[0], 1
    start, end = node.args[:2]
    return start, end, node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)


def _check_arange(node: torch.fx.Node) -> str | None:
    out = node.meta["val"]
    start, _, step = _arange_args(node)
    if not all(isinstance(value, (int, float)) for value in (start, step)):
        return f"{node.target}: symbolic bounds"
    if out.dtype in INTEGER_DTYPES:
        # iota * step + start in fp32 is exact for integer start and step while the values stay within +-2**24
        # (the registry's value-range check, INTEGER_ARITHMETIC_OPS); a fractional step truncates in eager.
        if not all(float(value).is_integer() for value in (start, step)):
            return f"{node.target}: integer result with a fractional start {start} or step {step}"
        return None
    if out.dtype not in FLOAT_SOURCES:
        return f"{node.target}: dtype {out.dtype} (only float32, bfloat16 and integer results)"
    count = out.numel()
    if count > ARANGE_MAX:
        return f"{node.target}: {count} elements (> {ARANGE_MAX})"
    # The kernel computes float32(i) * step + start in fp32 (i exact from the int32 iota). Claim it only when
    # that equals eager bit for bit on every element (eager computes in higher precision, then rounds).
    index = np.arange(count, dtype=np.float32)
    ours = index * np.float32(step) + np.float32(start)
    eager = torch.arange(count, dtype=torch.float64).mul(step).add(start).to(torch.float32).numpy()
    reference = torch.arange(*_arange_args(node), dtype=torch.float32).numpy()
    rounded = torch.from_numpy(ours).to(out.dtype)  # a bf16 result is the exact fp32 value rounded once
    if ours.shape != reference.shape or not (np.array_equal(ours, reference) and np.array_equal(ours, eager)) or (
        not torch.equal(rounded, torch.arange(*_arange_args(node), dtype=out.dtype))
    ):
        return f"{node.target}: start {start}, step {step} not exact (iota * step + start in fp32 differs from eager)"
    return None


INTEGER_ARITHMETIC_OPS.update((aten.arange.default, aten.arange.start_step))


@register_lowering(aten.arange.default, aten.arange.start_step, check=_check_arange)
def lower_arange(ctx, node):
    start, _, step = _arange_args(node)
    shape = tuple(node.meta["val"].shape)
    index = ir.Iota(ir.Layout(shape, ir.contiguous_strides(shape), 0))
    expr = index if step == 1 else ir.Op("mul", (index, ir.Scalar(float(step))))
    expr = expr if start == 0 else ir.Op("add", (expr, ir.Scalar(float(start))))
    return emit_pointwise(ctx, node, expr)
