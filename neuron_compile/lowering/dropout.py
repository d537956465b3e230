"""Lowering stage, random family: ``aten.native_dropout`` (training graphs' dropout).

Input: an ATen FX node ``native_dropout(x, p, train)``. Output: one ``ir.Pointwise`` with two stores, eager's
``(x * mask * scale, mask)`` with ``scale = 1 / (1 - p)`` (0 when p is 1, as eager computes it), the mask bool.
With ``train`` False eager returns a copy of x and a mask of ones; p = 0 keeps every element and p = 1 drops
every one, without drawing. Otherwise the mask is an ``ir.RandomKeep`` drawn on chip from one seed of the region's
``ir.RANDOM_SEEDS`` buffer (one int32 per dropout node), which the region fills from torch's default generator on
every call (runtime/region.py): ``torch.manual_seed`` makes a run repeat, and two calls draw different masks.
Eager's random stream cannot be matched; the keep rate, the scaling and the mask the backward reads are eager's.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.lowering.registry import LoweringContext, TensorValue, load, register_lowering

aten = torch.ops.aten


def _check_dropout(node: torch.fx.Node) -> str | None:
    if node.args[0].meta["val"].dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtype {node.args[0].meta['val'].dtype}"
    if not 0.0 <= float(node.args[1]) <= 1.0:
        return f"{node.target}: p={node.args[1]} outside [0, 1]"
    return None


def seed_load(ctx: LoweringContext) -> ir.Load:
    """The next int32 of the region's seed buffer (the buffer grows by one element per random op)."""
    previous = ctx.buffers.get(ir.RANDOM_SEEDS)
    index = previous.numel if previous is not None else 0
    layout = ir.Layout((index + 1,), (1,), 0)
    ctx.buffers[ir.RANDOM_SEEDS] = ir.Buffer(ir.RANDOM_SEEDS, "int32", layout)
    return ir.Load(ir.RANDOM_SEEDS, ir.Layout((1,), (1,), index), "int32")


def keep_mask(ctx: LoweringContext, shape: tuple[int, ...], p: float, train: bool) -> ir.Expr:
    """1.0 where an element is kept: a random draw for 0 < p < 1 in training, a constant otherwise."""
    if not train or p == 0.0:
        return ir.Scalar(1.0)
    if p == 1.0:
        return ir.Scalar(0.0)
    return ir.RandomKeep(seed_load(ctx), ir.Layout(shape, ir.contiguous_strides(shape), 0), p)


@register_lowering(aten.native_dropout.default, check=_check_dropout, multi_output=True)
def lower_native_dropout(ctx, node):
    x, p = node.args[0], float(node.args[1])
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    train = train is None or bool(train)
    output_meta, mask_meta = node.meta["val"]
    shape = tuple(output_meta.shape)
    value = load(ctx, x, shape)
    keep = keep_mask(ctx, shape, p, train)
    output, mask = ctx.new_buffer(output_meta, "dropout"), ctx.new_buffer(mask_meta, "dropout_mask")
    stores = (ir.Store(output, _scaled(value, keep, p, train, output.dtype), output.layout),
              ir.Store(mask, keep, mask.layout))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), shape, stores))
    return tuple(TensorValue(buffer.name, buffer.layout, buffer.dtype) for buffer in (output, mask))


def _scaled(value: ir.Expr, keep: ir.Expr, p: float, train: bool, dtype: str) -> ir.Expr:
    """Eager's ``x * mask * scale`` (one rounding to bf16: the product by the mask is exact); x itself when
    nothing is dropped or scaled."""
    if not train or p == 0.0:
        return value
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    product = ir.op("mul", ir.op("mul", value, keep), scale)
    return ir.Op("cast", (product,), dtype="bfloat16") if dtype == "bfloat16" else product
