"""Lowering family: torch.distributed functional collectives -> ``ir.Collective`` (kernels calling nki.collectives).

Input: ``_c10d_functional`` nodes of an ATen graph (what Dynamo traces from DTensor, tensor parallelism, FSDP2 and
``torch.distributed._functional_collectives``): all_reduce (sum, avg, max, min), all_gather_into_tensor,
reduce_scatter_tensor (sum, avg, max, min), all_to_all_single with even splits, and wait_tensor. Output: one
``ir.Collective`` per collective over its process group's ranks (read from torch.distributed at compile time),
preceded by a copy when its input is not a whole contiguous buffer, and followed by a division for avg (NKI
reduces with add, maximum or minimum only); over a group of one rank, a pointwise copy instead. ``wait_tensor`` of
a lowered collective is the value it waits on: our kernels run synchronously, so a collective's result is complete
when its kernel returns; the wait of an eager collective stays eager with it.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir, process_groups
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import LoweringContext, TensorValue, load, register_lowering, unsupported_reason

functional = torch.ops._c10d_functional
REDUCE_OPS = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum"}


def _reduce_name(node: torch.fx.Node) -> str:
    return str(node.args[1]).lower()


def _group_reason(node: torch.fx.Node) -> str | None:
    if not process_groups.initialized():
        return f"{node.target}: torch.distributed is not initialized in this process"
    if node.meta.get("val") is None or not node.meta["val"].is_contiguous():
        return f"{node.target}: a non-contiguous result"
    return None


def _check_reducing(node: torch.fx.Node) -> str | None:
    if _reduce_name(node) not in REDUCE_OPS:
        return f"{node.target}: reduce op {node.args[1]!r} (supported: {sorted(REDUCE_OPS)})"
    return _group_reason(node)


def _check_all_to_all(node: torch.fx.Node) -> str | None:
    reason = _group_reason(node)
    if reason is not None:
        return reason
    ranks = len(process_groups.group_ranks(process_groups.group_name_of(node)))
    rows = node.args[0].meta["val"].shape[0] if node.args[0].meta["val"].dim() else 0
    for splits in (node.args[1], node.args[2]):
        if splits and (len(set(splits)) != 1 or len(splits) != ranks):
            return f"{node.target}: uneven splits {list(splits)} (even splits only)"
    if rows % ranks:
        return f"{node.target}: {rows} rows do not split evenly over {ranks} ranks"
    return None


def _whole_buffer(ctx: LoweringContext, node: torch.fx.Node) -> TensorValue:
    """The collective's input as a whole contiguous buffer: the value itself when it is one, else a copy."""
    value = ctx.value(node.args[0])
    layout = value.layout
    contiguous = layout.offset == 0 and layout.strides == ir.contiguous_strides(layout.shape)
    if contiguous and ctx.buffers[value.buffer].layout.span() == math.prod(layout.shape):
        return value
    meta = node.args[0].meta["val"]
    buffer = ctx.scratch_buffer(tuple(meta.shape), value.dtype, "staged")
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), buffer.layout.shape,
                          (ir.Store(buffer, load(ctx, node.args[0], buffer.layout.shape), buffer.layout),)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _emit_collective(ctx: LoweringContext, node: torch.fx.Node, collective: str, reduce: str = "add") -> TensorValue:
    ranks = process_groups.group_ranks(process_groups.group_name_of(node))
    if len(ranks) == 1:
        # A group of one rank (a mesh dim of size 1, a one-process run): every collective is the identity, and avg
        # divides by 1. A pointwise copy fuses with its neighbours; a collective kernel would stage through HBM.
        return emit_pointwise(ctx, node, load(ctx, node.args[0], tuple(node.meta["val"].shape)))
    source = _whole_buffer(ctx, node)
    output = ctx.output_buffer(node, "collective")
    ctx.emit(ir.Collective(
        ctx.fresh_name("kernel"), output.layout.shape, collective, ir.Load(source.buffer, source.layout, source.dtype),
        (tuple(ranks),), (ir.Store(output, ir.Result(), output.layout),), reduce,
    ))
    value = TensorValue(output.name, output.layout, output.dtype)
    if _reduce_name(node) != "avg" or collective not in ("all_reduce", "reduce_scatter"):
        return value
    ctx.values[node] = value  # the division reads the collective's sum as this node's value
    return emit_pointwise(ctx, node, ir.Op("div", (load(ctx, node, output.layout.shape), ir.Scalar(float(len(ranks))))))


@register_lowering(functional.all_reduce.default, check=_check_reducing)
def lower_all_reduce(ctx, node):
    return _emit_collective(ctx, node, "all_reduce", REDUCE_OPS[_reduce_name(node)])


@register_lowering(functional.all_gather_into_tensor.default, check=_group_reason)
def lower_all_gather(ctx, node):
    return _emit_collective(ctx, node, "all_gather")


@register_lowering(functional.reduce_scatter_tensor.default, check=_check_reducing)
def lower_reduce_scatter(ctx, node):
    return _emit_collective(ctx, node, "reduce_scatter", REDUCE_OPS[_reduce_name(node)])


@register_lowering(functional.all_to_all_single.default, check=_check_all_to_all)
def lower_all_to_all(ctx, node):
    return _emit_collective(ctx, node, "all_to_all")


def _check_wait(node: torch.fx.Node, target) -> str | None:
    """A wait is lowered only on a collective that is: an eager collective returns before its data arrives, and
    only the eager wait_tensor completes it (a kernel reading the tensor without it reads unfinished data)."""
    waited = node.args[0]
    if not isinstance(waited, torch.fx.Node) or not process_groups.is_collective(waited):
        return f"{node.target}: waits on {getattr(waited, 'target', waited)}, not a functional collective"
    reason = unsupported_reason(waited, target)
    if reason is not None:
        return f"{node.target}: its collective runs eagerly ({reason}), so must its wait"
    return None


@register_lowering(functional.wait_tensor.default, target_check=_check_wait)
def lower_wait_tensor(ctx, node):
    return ctx.value(node.args[0])
