"""Lowering stage, creation family: tensors whose contents eager leaves uninitialized (empty, empty_like, ...),
and the identities of ops whose non-empty result is computed from an empty input (mm with K = 0 is zeros).

Input: an ATen FX node (aten.empty.memory_format, aten.empty_permuted, aten.empty_strided, aten.new_empty,
aten.new_empty_strided). Output: a ``TensorValue`` over a fresh HBM buffer with exactly eager's sizes and strides
(from the node's fake value) and no instructions: eager's memory is uninitialized, and the region NaN-fills
buffers no kernel writes, as the simulator does for every new buffer. A later kernel that writes the buffer
(a copy or fill into it) is lowered as its own node.

Identities (``register_empty_input_lowering``; an ``ir.Pointwise`` of numbers over the result): a sum over no
elements is 0, a prod 1, a mean or var nan (0 / 0), mm / bmm with K = 0 zeros, addmm ``beta * bias`` (bias
ignored when beta is 0, as eager does). amax / amin of nothing raise in eager, so they never get here.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import (
    INTEGER_ARITHMETIC_OPS,
    INTEGER_OPS,
    TensorValue,
    broadcast_layout,
    dtype_name,
    load,
    register_empty_input_lowering,
    register_lowering,
)

aten = torch.ops.aten


def _check_empty(node: torch.fx.Node) -> str | None:
    meta = node.meta["val"]
    if meta.layout is not torch.strided:  # sparse or mkldnn layouts have no flat HBM form
        return f"{node.target}: layout {meta.layout}"
    return None


@register_lowering(
    aten.empty.memory_format,
    aten.empty_permuted.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    check=_check_empty,
)
def lower_empty(ctx, node):
    buffer = ctx.output_buffer(node, "empty")
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


# new_empty(_strided) read their input only for its dtype: an empty input changes nothing.
register_empty_input_lowering(aten.new_empty.default, aten.new_empty_strided.default, check=_check_empty)(lower_empty)

IDENTITY = {
    aten.sum.default: 0.0,
    aten.sum.dim_IntList: 0.0,
    aten.prod.default: 1.0,
    aten.prod.dim_int: 1.0,
    aten.mean.default: math.nan,
    aten.mean.dim: math.nan,
    aten.var.correction: math.nan,
    aten.mm.default: 0.0,
    aten.bmm.default: 0.0,
    aten.any.default: 0.0,  # any of nothing is False
    aten.any.dim: 0.0,
    aten.any.dims: 0.0,
}


def _check_identity(node) -> str | None:
    dtype = node.kwargs.get("dtype")
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtype={dtype}"
    return None


@register_empty_input_lowering(*IDENTITY, check=_check_identity)
def lower_identity(ctx, node):
    return emit_pointwise(ctx, node, ir.Scalar(IDENTITY[node.target]))


def _check_addmm(node) -> str | None:
    alpha = node.kwargs.get("alpha", 1)
    if not math.isfinite(float(alpha)):  # alpha * (a @ b) with an empty K: inf * 0 is not modelled
        return f"{node.target}: alpha={alpha} with K = 0"
    return None


@register_empty_input_lowering(aten.var_mean.correction)
def lower_var_mean_of_nothing(ctx, node):
    """var_mean over no elements: both results nan (0 / 0 for the mean, and eager gives nan for the variance
    whatever the correction)."""
    results = []
    for meta in node.meta["val"]:
        buffer = ctx.new_buffer(meta, "identity")
        store = ir.Store(buffer, ir.Scalar(math.nan), buffer.layout)
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), buffer.layout.shape, (store,)))
        results.append(TensorValue(buffer.name, buffer.layout, buffer.dtype))
    return tuple(results)


@register_empty_input_lowering(aten.addmm.default, check=_check_addmm)
def lower_addmm_k0(ctx, node):
    """addmm with K = 0: ``beta * bias`` broadcast to the result (zeros if beta is 0, even over nan bias)."""
    bias, beta = node.args[0], float(node.kwargs.get("beta", 1))
    shape = tuple(node.meta["val"].shape)
    if beta == 0:
        return emit_pointwise(ctx, node, ir.Scalar(0.0))
    value = ctx.value(bias)
    bias_load = ir.Load(value.buffer, broadcast_layout(value.layout, shape), value.dtype)
    return emit_pointwise(ctx, node, ir.Op("mul", (bias_load, ir.Scalar(beta))))


@register_lowering(aten.lift_fresh_copy.default)
def lower_fresh_copy(ctx, node):
    """A fresh copy of a constant tensor lifted into the graph (``torch.tensor(...)`` in the traced function)."""
    return emit_pointwise(ctx, node, load(ctx, node.args[0], tuple(node.meta["val"].shape)))


INTEGER_OPS.add(aten.lift_fresh_copy.default)  # a copy in the buffer's own dtype: exact for every integer


@register_lowering(aten.copy.default)
def lower_copy(ctx, node):
    """Functional copy(self, src): ``src`` broadcast to ``self``'s shape and cast to its dtype; self's values are
    not read. To bool is a truth test (nan -> True), as eager's copy does."""
    shape, dtype = tuple(node.meta["val"].shape), node.meta["val"].dtype
    source = load(ctx, node.args[1], shape)
    if dtype == torch.bool:
        return emit_pointwise(ctx, node, ir.Op("ne", (source, ir.Scalar(0.0))))
    return emit_pointwise(ctx, node, ir.Op("cast", (source,), dtype=dtype_name(dtype)))


def _check_copy_into_input(node: torch.fx.Node) -> str | None:
    """copy_(self, src) is lowered only as aot_autograd emits input mutations: self is a graph input, nothing
    uses the copy_'s result, and every other reader of self comes before it (so it reads the old value, as
    the region's kernels do: the input is written after all of them)."""
    destination = node.args[0]
    if not isinstance(destination, torch.fx.Node) or destination.op != "placeholder":
        return f"{node.target}: the destination is not a graph input"
    if node.users:
        return f"{node.target}: its result is used"
    order = {n: index for index, n in enumerate(node.graph.nodes)}
    if any(order[user] > order[node] for user in destination.users if user is not node):
        return f"{node.target}: the input is read after it is written"
    if sum(1 for user in destination.users if user.target is aten.copy_.default) > 1:
        return f"{node.target}: the input is written twice"
    return None


@register_lowering(aten.copy_.default, check=_check_copy_into_input)
def lower_copy_into_input(ctx, node):
    """The copied value as a kernel output with the input's layout; the region writes it into the input. A source
    the region's kernels compute, of the input's dtype and shape, is written into the input as it is (the region
    reads a mutation through its layout): no copy, which stored AdamW's new bf16 moments twice, as the value the
    update reads and as the state's copy."""
    destination = ctx.value(node.args[0])
    value = _computed_as_is(ctx, node) or lower_copy(ctx, node)
    ctx.mutations.append((destination.buffer, value))
    return value


def _computed_as_is(ctx, node: torch.fx.Node):
    """The value of copy_(self, src)'s ``src`` when copying it changes nothing but where the values are: a buffer
    the region's kernels write (not a graph input, nor a view of one), with self's dtype and shape; else None."""
    source, destination = node.args[1], ctx.value(node.args[0])
    if not isinstance(source, torch.fx.Node) or source.op != "call_function":
        return None
    value = ctx.value(source)
    inputs = {other.name for other in node.graph.nodes if other.op == "placeholder"}
    if value.buffer in inputs or value.dtype != destination.dtype or value.layout.shape != destination.layout.shape:
        return None
    return value


# An integer copy casts in fp32 tiles: exact when value ranges prove the source (and the destination it replaces)
# within +-2**24, as for every integer op (a decode step's ``cache_position.copy_(cache_position + 1)``).
INTEGER_ARITHMETIC_OPS.update((aten.copy.default, aten.copy_.default))
