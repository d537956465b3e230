"""Lowering stage, scatter family: index_put, index_copy, index_add, index_reduce, scatter, scatter_add,
scatter_reduce and put as ``ir.Scatter`` (rendered by codegen/scatter.py).

Input: an ATen FX node with float32 / bfloat16 self and values and int32 / int64 indices (int32 kernel dtype,
registry.py). Output: a fresh buffer with eager's strides holding self with the scattered elements written.

Every op becomes an element scatter over an index domain: each element e of the domain has a target offset in
the output (the output's layout with the index-driven dims replaced by the index values) and a value (a load
over the domain or a number). ``reduce`` says how it is written: assign (index_put, index_copy, scatter), add
(accumulate, index_add, scatter_add, sum), multiply (prod), maximum / minimum (amax / amin). Mean is a sum, a
count scattered the same way, and a division (eager's order too). ``include_self=False`` first assigns the
reduction's identity to every target (eager does the same), then reduces. The kernel resolves duplicates
inside a tile and runs tiles in order, so duplicates give eager's CPU result: the last write wins, every
contribution is counted once. A sum of whole rows into a constant fill (the embedding gradient) puts the rows
on partitions and sums duplicates on TensorE (kinds/scatter_rows.py), one tile per 128 indices. Negative
indices wrap where eager wraps them (index_put, index_fill, put); an out-of-range index makes the kernel's DMA
fail, so the call runs eagerly and raises like eager.

index_put with a bool mask is lowered only when its values do not vary along the selected elements (x[mask] = v):
then it is a pointwise where(mask, v, self) (self + v with accumulate); otherwise the positions depend on the
mask's values and it runs eagerly, with that reason.

index_copy, index_add and index_fill stay whole in the ATen graph (passes/decompose.py): the decomposition of
the first two into index_put would wrap negative indices that eager rejects, and index_fill (which wraps them)
decomposes into index_copy.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.lowering.indexing import FLOAT_SOURCES, GATHER_FREE_BYTES, GATHER_MAX_ITERATIONS
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import (
    INTEGER_DTYPES,
    INTEGER_OPS,
    LoweringError,
    TensorValue,
    broadcast_layout,
    register_empty_input_lowering,
    register_lowering,
)

aten = torch.ops.aten

REDUCTIONS = {"sum": "add", "add": "add", "prod": "multiply", "multiply": "multiply", "amax": "maximum",
              "amin": "minimum", "mean": "mean"}
# What eager writes to every target first when include_self=False.
IDENTITIES = {"add": 0.0, "mean": 0.0, "multiply": 1.0, "maximum": -math.inf, "minimum": math.inf}


@dataclasses.dataclass
class Plan:
    """One op as an element scatter: the domain, how each index spreads over it, the values."""

    source: torch.fx.Node  # self
    domain: tuple[int, ...]
    # per index: (index node, its layout restated over the domain, the output dim it drives or None for a flat
    # index into a contiguous output (put), wrap negatives)
    indices: list
    index_dims: tuple[int, ...]  # output dims the indices drive (stride 0 in the target layout)
    values: object  # an fx.Node read through ``values_layout``, or a number
    values_layout: ir.Layout | None
    reduce: str  # assign | add | multiply | maximum | minimum | mean
    include_self: bool = True
    alpha: float = 1.0
    # domain dims along which two elements can hit the same place (the index's own dims)
    colliding: tuple[int, ...] = ()


def _meta_layout(node: torch.fx.Node) -> ir.Layout:
    value = node.meta["val"]
    return ir.Layout(tuple(value.shape), tuple(value.stride()), 0)


def _promote(layout: ir.Layout) -> ir.Layout:
    """A 0-d layout as one element of a 1-D one (0-d self, index or source: one element along dim 0)."""
    return layout if layout.shape else ir.Layout((1,), (0,), layout.offset)


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape) or (1,)


def _domain_layout(layout: ir.Layout, shape: tuple[int, ...]) -> ir.Layout:
    """``layout`` read over ``shape`` (same rank, each dim at most as large: index and src of scatter)."""
    return ir.Layout(shape, layout.strides, layout.offset)


def _along(index_layout: ir.Layout, domain: tuple[int, ...], dim: int) -> ir.Layout:
    """A 1-D index spread over ``domain`` along ``dim`` (index_copy, index_add, index_reduce)."""
    strides = tuple(index_layout.strides[0] if d == dim else 0 for d in range(len(domain)))
    return ir.Layout(domain, strides, index_layout.offset)


def _plan(node: torch.fx.Node, read_layout) -> Plan | str:
    """The element scatter of ``node`` (read_layout: fx node -> ir.Layout), or why it is not one."""
    target = node.target
    if target is aten.index_put.default:
        return _plan_index_put(node, read_layout)  # reads a 0-d tensor as 0-d: its dims broadcast away

    def layouts(arg):  # every op but index_put reads a 0-d tensor as one element
        return _promote(read_layout(arg))

    if target in (aten.index_copy.default, aten.index_add.default, aten.index_reduce.default):
        return _plan_along_dim(node, layouts)
    if target in (aten.index_fill.int_Scalar, aten.index_fill.int_Tensor):
        return _plan_index_fill(node, layouts)
    if target is aten.put.default:
        return _plan_put(node, layouts)
    return _plan_scatter(node, layouts)


def _accumulate(node: torch.fx.Node) -> bool:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)


def _include_self(node: torch.fx.Node) -> bool:
    return bool(node.kwargs.get("include_self", node.args[5] if len(node.args) > 5 else True))


def _plan_index_put(node: torch.fx.Node, layouts) -> Plan | str:
    """index_put(self, indices, values): adjacent index tensors broadcast together drive the dims they stand for."""
    target, (source, indices, values) = node.target, node.args[:3]
    positions = [k for k, item in enumerate(indices) if item is not None]
    if not positions:
        return f"{target}: no index tensor"
    if any(indices[k].meta["val"].dtype not in INTEGER_DTYPES for k in positions):
        return f"{target}: bool mask indices (the scattered positions depend on the mask's values)"
    if positions != list(range(positions[0], positions[0] + len(positions))):
        return f"{target}: index tensors on non-adjacent dims (the indexed dims move to the front)"
    first, count = positions[0], len(positions)
    shape = tuple(torch.broadcast_shapes(*[tuple(indices[k].meta["val"].shape) for k in positions]))
    shape = shape or (1,)  # 0-d indices: one element (its dim has size 1 in the domain)
    self_shape = tuple(source.meta["val"].shape)
    domain = self_shape[:first] + shape + self_shape[first + count:]
    after = len(self_shape) - first - count
    entries = []
    for k in positions:
        spread = broadcast_layout(layouts(indices[k]), shape)
        entries.append((indices[k], ir.Layout(domain, (0,) * first + spread.strides + (0,) * after,
                                              spread.offset), k, True))
    try:
        values_layout = broadcast_layout(layouts(values), domain)
    except LoweringError:
        return f"{target}: values of shape {list(values.meta['val'].shape)} do not broadcast to {list(domain)}"
    index_dims = tuple(range(first, first + count))
    return Plan(source, domain, entries, index_dims, values, values_layout, "add" if _accumulate(node) else "assign",
                colliding=tuple(range(first, first + len(shape))))


def _plan_along_dim(node: torch.fx.Node, layouts) -> Plan | str:
    """index_copy / index_add / index_reduce(self, dim, index, source): source's slices along dim go to index."""
    target, args = node.target, node.args
    source, dim, index, values = args[:4]
    domain = _shape(values)
    if len(domain) != len(_shape(source)) or index.meta["val"].dim() > 1:
        return f"{target}: source of rank {values.meta['val'].dim()} or index of rank > 1 for self of rank "\
            f"{source.meta['val'].dim()}"
    dim = dim % len(domain)
    entries = [(index, _along(layouts(index), domain, dim), dim, False)]
    plan = Plan(source, domain, entries, (dim,), values, layouts(values), "assign", colliding=(dim,))
    if target is aten.index_add.default:
        plan.reduce = "add"
        plan.alpha = float(node.kwargs.get("alpha", args[4] if len(args) > 4 else 1))
    elif target is aten.index_reduce.default:
        plan.reduce = REDUCTIONS[args[4]]
        plan.include_self = _include_self(node)
    return plan


def _plan_index_fill(node: torch.fx.Node, layouts) -> Plan | str:
    """index_fill(self, dim, index, value): one value written to every element of the indexed slices."""
    target, (source, dim, index, value) = node.target, node.args[:4]
    self_shape = _shape(source)
    if index.meta["val"].dim() > 1:
        return f"{target}: an index of rank > 1"
    dim = dim % len(self_shape)
    index_layout = layouts(index)
    domain = self_shape[:dim] + index_layout.shape + self_shape[dim + 1:]
    values_layout = None
    if isinstance(value, torch.fx.Node):  # a 0-d value tensor, read at every element
        values_layout = ir.Layout(domain, (0,) * len(domain), layouts(value).offset)
    return Plan(source, domain, [(index, _along(index_layout, domain, dim), dim, True)], (dim,), value,
                values_layout, "assign", colliding=(dim,))


def _plan_put(node: torch.fx.Node, layouts) -> Plan | str:
    """put(self, index, source): flat indices into self's row-major order."""
    target, (source, index, values) = node.target, node.args[:3]
    self_value = source.meta["val"]
    if tuple(self_value.stride()) != ir.contiguous_strides(tuple(self_value.shape)):
        return f"{target}: non-contiguous self (put indexes self's row-major order)"
    if _shape(index) != _shape(values):
        return f"{target}: index and source shapes differ"
    domain = _shape(index)
    return Plan(source, domain, [(index, layouts(index), None, True)], (), values, layouts(values),
                "add" if _accumulate(node) else "assign", colliding=tuple(range(len(domain))))


def _plan_scatter(node: torch.fx.Node, layouts) -> Plan | str:
    """scatter.src / .value / .reduce / .value_reduce, scatter_add, scatter_reduce.two: out[.., index[e], ..] <- e."""
    target, args = node.target, node.args
    source, dim, index, values = args[:4]
    domain = _shape(index)
    rank = len(_shape(source))
    if len(domain) != rank:
        return f"{target}: index of rank {len(domain)} for self of rank {rank}"
    dim = dim % rank
    entries = [(index, layouts(index), dim, False)]
    values_layout = None
    if isinstance(values, torch.fx.Node):
        values_layout = _domain_layout(layouts(values), domain)
    plan = Plan(source, domain, entries, (dim,), values, values_layout, "assign", colliding=(dim,))
    if target is aten.scatter_add.default:
        plan.reduce = "add"
    elif target is aten.scatter_reduce.two:
        plan.reduce = REDUCTIONS[args[4]]
        plan.include_self = _include_self(node)
    elif target in (aten.scatter.reduce, aten.scatter.value_reduce):
        plan.reduce = REDUCTIONS[node.kwargs.get("reduce", args[4] if len(args) > 4 else None)]
    return plan


def _partition_dim(plan: Plan) -> int:
    """The largest domain dim that keeps eager's order among colliding elements on partitions: a dim along which
    no two elements collide, or the last colliding one (tiles then run in row-major order of the others)."""
    allowed = [d for d in range(len(plan.domain)) if d not in plan.colliding] + list(plan.colliding[-1:])
    return max(sorted(allowed), key=lambda d: (min(plan.domain[d], 128), d))


def _tiling(plan: Plan, reduce: str) -> tuple[int, int]:
    """(partition dim, row dims) of one scatter pass. An assign whose trailing dims no index drives moves them
    whole as one row per partition (the last index-driven dim on partitions, or the widest dim when one index
    element drives them all), and so does a sum of values into a base that holds no -0.0 (kinds/scatter_rows.py:
    duplicates summed on TensorE); otherwise one element each."""
    if plan.colliding and (reduce == "assign" or _row_sum_applies(plan, reduce)):
        last = plan.colliding[-1]
        trailing = range(last + 1, len(plan.domain))
        driven = any(layout.strides[d] != 0 for _, layout, _, _ in plan.indices for d in trailing)
        free_bytes = 4 * math.prod(plan.domain[last + 1:])
        if trailing and not driven and len(trailing) <= 3 and free_bytes <= GATHER_FREE_BYTES:
            if reduce == "assign" and math.prod(plan.domain[d] for d in plan.colliding) == 1:
                # one index element (a static cache's position): no two rows collide, so the widest dim before
                # the row goes on partitions (kinds/scatter_distinct.py writes a tile of heads in one DMA)
                return max(range(last + 1), key=lambda d: (min(plan.domain[d], 128), d)), len(trailing)
            return last, len(trailing)
    return _partition_dim(plan), 0


def _row_sum_applies(plan: Plan, reduce: str) -> bool:
    """The accumulating row form sums a group's zeros to +0.0 where eager keeps -0.0 + -0.0 = -0.0: exact only
    over a base that holds no -0.0, which a constant fill (the embedding gradient's zeros) shows."""
    return reduce == plan.reduce == "add" and plan.include_self and isinstance(plan.values, torch.fx.Node) \
        and _fill_without_negative_zero(plan.source)


def _fill_without_negative_zero(node) -> bool:
    """``node`` is ``aten.full`` of a number other than -0.0."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.full.default:
        return False
    fill = node.args[1]
    return isinstance(fill, (int, float)) and not (fill == 0 and math.copysign(1.0, fill) < 0)


def _mask_index(node: torch.fx.Node):
    """index_put with one bool mask whose values broadcast along the selected elements (x[mask] = v, v constant
    along the selection): (mask position, mask node, values layout over self) with ``layouts``, else a reason.
    Then the result is where(mask, v, self) (accumulate: where(mask, self + v, self)), whatever the mask holds."""
    source, indices, values = node.args[:3]
    tensors = [(k, item) for k, item in enumerate(indices) if item is not None]
    if len(tensors) != 1 or tensors[0][1].meta["val"].dtype != torch.bool:
        return f"{node.target}: bool mask indices with other indices (the scattered positions depend on the values)"
    first, mask = tensors[0]
    self_shape, mask_shape = tuple(source.meta["val"].shape), tuple(mask.meta["val"].shape)
    if self_shape[first:first + len(mask_shape)] != mask_shape:
        return f"{node.target}: mask of shape {list(mask_shape)} for dims {list(self_shape[first:])}"
    rest = self_shape[first + len(mask_shape):]
    selected = self_shape[:first] + (None,) + rest  # None: the selected elements, however many
    values_shape = tuple(values.meta["val"].shape)
    if len(values_shape) > len(selected):
        return f"{node.target}: values of rank {len(values_shape)} for a masked index_put"
    aligned = (None,) * (len(selected) - len(values_shape)) + values_shape
    if any(size is not None and size != 1 and want is None for size, want in zip(aligned, selected)):
        return f"{node.target}: bool mask indices with values that vary along the selected elements (the "\
            "scattered positions depend on the mask's values)"
    return first, mask


def _check_scatter(node: torch.fx.Node) -> str | None:
    out = node.meta["val"]
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.meta["val"].dtype not in FLOAT_SOURCES:
        return f"{node.target}: self dtype (only float32, bfloat16)"
    if node.target is aten.index_put.default and any(
        isinstance(item, torch.fx.Node) and item.meta["val"].dtype == torch.bool for item in node.args[1]
    ):
        masked = _mask_index(node)
        return masked if isinstance(masked, str) else None
    plan = _plan(node, _meta_layout)
    if isinstance(plan, str):
        return plan
    if isinstance(plan.values, torch.fx.Node) and plan.values.meta["val"].dtype not in FLOAT_SOURCES:
        return f"{node.target}: values dtype {plan.values.meta['val'].dtype} (only float32, bfloat16)"
    if any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride())):
        return f"{node.target}: the result has overlapping elements (stride 0)"
    span = ir.Layout(tuple(out.shape), tuple(out.stride())).span()
    if span >= FP32_EXACT_INTEGER:
        # (and an out-of-range index's redirect, limits.OUT_OF_RANGE_ROW = 2^30, lies beyond it)
        return f"{node.target}: result spans {span} elements (>= 2^24: target offsets are computed in fp32)"
    copies = math.prod(out.shape[:-2])
    part, row_dims = _tiling(plan, plan.reduce)
    lines = math.prod(plan.domain[:len(plan.domain) - row_dims]) // plan.domain[part]
    tiles = lines * math.ceil(plan.domain[part] / 128)
    passes = 1 if plan.include_self else 2
    if plan.reduce == "mean":
        passes += 1
    if passes * (copies + tiles) > GATHER_MAX_ITERATIONS:
        return f"{node.target}: {passes * (copies + tiles)} copy and scatter tiles (> {GATHER_MAX_ITERATIONS})"
    return None


def _emit_scatter(ctx, plan: Plan, base: TensorValue, buffer: ir.Buffer, values, reduce: str) -> TensorValue:
    """One ir.Scatter: ``buffer`` = ``base`` with ``values`` (a Load over the domain or a Scalar) scattered."""
    out = buffer.layout if buffer.layout.shape else ir.Layout((1,), (1,), buffer.layout.offset)
    if plan.indices[0][2] is None:  # put: a flat index into the contiguous output
        strides = (0,) * len(plan.domain)
    elif len(plan.domain) != len(out.shape):  # index_put: the broadcast index dims replace the indexed ones
        first, count = plan.index_dims[0], len(plan.index_dims)
        extra = len(plan.domain) - len(out.shape) + count
        strides = out.strides[:first] + (0,) * extra + out.strides[first + count:]
    else:
        strides = tuple(0 if d in plan.index_dims else stride for d, stride in enumerate(out.strides))
    entries = []
    for index_node, layout, dim, wrap in plan.indices:
        index = ctx.value(index_node)
        stride, size = (1, math.prod(out.shape)) if dim is None else (out.strides[dim], out.shape[dim])
        entries.append((ir.Load(index.buffer, layout, index.dtype), stride, size, wrap))
    tiling = _tiling(plan, reduce)
    # the row sum applies over a constant fill only: the kernel stores that number, no copy of the filled buffer
    base_expr = ir.Scalar(float(plan.source.args[1])) if tiling[1] and _row_sum_applies(plan, reduce) else \
        ir.Load(base.buffer, _promote(base.layout), base.dtype)
    node = ir.Scatter(ctx.fresh_name("kernel"), plan.domain, base_expr, ir.Layout(plan.domain, strides, out.offset),
                      values, tuple(entries), (ir.Store(buffer, ir.Result(), out),), reduce, *tiling)
    ctx.emit(node)
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _values(ctx, plan: Plan):
    if not isinstance(plan.values, torch.fx.Node):
        return ir.Scalar(float(plan.values))
    value = ctx.value(plan.values)
    load = ir.Load(value.buffer, plan.values_layout, value.dtype)
    if plan.alpha == 1.0:
        return load
    # index_add's alpha: source * alpha in an fp32 scratch buffer (eager adds alpha * source in fp32 too).
    scratch = ctx.scratch_buffer(plan.domain, "float32", "scaled")
    product = ir.Op("mul", (ir.Load(value.buffer, plan.values_layout, value.dtype), ir.Scalar(plan.alpha)))
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), plan.domain, (ir.Store(scratch, product, scratch.layout),)))
    return ir.Load(scratch.name, scratch.layout, "float32")


SCATTER_OPS = (
    aten.index_put.default, aten.index_copy.default, aten.index_add.default, aten.index_reduce.default,
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_add.default,
    aten.scatter_reduce.two, aten.put.default, aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
)


@register_lowering(*SCATTER_OPS, check=_check_scatter)
def lower_scatter(ctx, node):
    if node.target is aten.index_put.default and any(
        isinstance(item, torch.fx.Node) and item.meta["val"].dtype == torch.bool for item in node.args[1]
    ):
        return _lower_masked_put(ctx, node)
    plan = _plan(node, lambda arg: ctx.value(arg).layout)
    base = ctx.value(plan.source)
    values = _values(ctx, plan)
    shape = tuple(node.meta["val"].shape)
    # bf16 sums and products accumulate in an fp32 copy, rounded once at the end (eager rounds every step)
    wide = base.dtype == "bfloat16" and plan.reduce in ("add", "multiply", "mean")

    def intermediate() -> ir.Buffer:
        return ctx.scratch_buffer(shape, "float32", "scatter") if wide else ctx.new_buffer(node.meta["val"], "scatter")

    last = intermediate() if wide or plan.reduce == "mean" else ctx.output_buffer(node, "scatter")
    if not plan.include_self:
        # eager first writes the reduction's identity to every target, then reduces into it
        base = _emit_scatter(ctx, plan, base, intermediate(), ir.Scalar(IDENTITIES[plan.reduce]), "assign")
    total = _emit_scatter(ctx, plan, base, last, values, "add" if plan.reduce == "mean" else plan.reduce)
    result = ir.Load(total.buffer, total.layout, total.dtype)
    if plan.reduce == "mean":
        # count = include_self + contributions, as eager (then 0 -> 1: untouched elements keep self)
        start = ctx.scratch_buffer(shape, "float32", "count")
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), shape,
                              (ir.Store(start, ir.Scalar(1.0 if plan.include_self else 0.0), start.layout),)))
        counted = _emit_scatter(ctx, plan, TensorValue(start.name, start.layout, start.dtype),
                                ctx.scratch_buffer(shape, "float32", "count"), ir.Scalar(1.0), "add")
        count = ir.Op("maximum", (ir.Load(counted.buffer, counted.layout, "float32"), ir.Scalar(1.0)))
        return emit_pointwise(ctx, node, ir.Op("div", (result, count)))
    return emit_pointwise(ctx, node, result) if wide else total


def _lower_masked_put(ctx, node):
    """x[mask] = v with v constant along the selection: one pointwise where over self's shape (no scatter)."""
    first, mask_node = _mask_index(node)
    source, values_node = ctx.value(node.args[0]), node.args[2]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    shape = source.layout.shape
    mask = ctx.value(mask_node)
    count = len(mask.layout.shape)
    rest = len(shape) - first - count
    condition = ir.Load(mask.buffer, ir.Layout(shape, (0,) * first + mask.layout.strides + (0,) * rest,
                                               mask.layout.offset), mask.dtype)
    values = ctx.value(values_node)
    # values broadcast to (self[:first], selected, rest): size 1 (stride 0) along the selection, so restate it
    # over self's shape with the mask's dims at stride 0
    spread = broadcast_layout(values.layout, shape[:first] + (1,) + shape[first + count:])
    strides = spread.strides[:first] + (0,) * count + spread.strides[first + 1:]
    value = ir.Load(values.buffer, ir.Layout(shape, strides, spread.offset), values.dtype)
    old = ir.Load(source.buffer, source.layout, source.dtype)
    new = ir.Op("add", (old, value)) if accumulate else value
    return emit_pointwise(ctx, node, ir.Op("where", (condition, new, old)))


def _check_empty(node: torch.fx.Node) -> str | None:
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.meta["val"].dtype not in FLOAT_SOURCES:
        return f"{node.target}: self dtype (only float32, bfloat16)"
    return None


@register_empty_input_lowering(*SCATTER_OPS, check=_check_empty)
def lower_empty_scatter(ctx, node):
    """Nothing to scatter (an empty index or source): the result is a copy of self."""
    source = ctx.value(node.args[0])
    return emit_pointwise(ctx, node, ir.Load(source.buffer, source.layout, source.dtype))


INTEGER_OPS.update(SCATTER_OPS)
