"""Lowering stage, pointwise family: arithmetic, unary math, comparisons, where, clamp, casts, clone.

Input: an ATen FX node. Output: one ``ir.Pointwise`` node over the output shape, whose single store writes a
fresh buffer with eager's strides; operands are broadcast Loads (stride 0 on broadcast dims) or Scalars.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.math_expressions import trunc
from neuron_compile.lowering.registry import (
    INTEGER_ARITHMETIC_OPS,
    INTEGER_DTYPES,
    INTEGER_OPS,
    LoweringContext,
    TensorValue,
    dtype_name,
    load,
    register_lowering,
)

aten = torch.ops.aten
prims = torch.ops.prims


def emit_pointwise(ctx: LoweringContext, node: torch.fx.Node, expr: ir.Expr) -> TensorValue:
    """Emit a Pointwise node computing ``expr`` over ``node``'s output shape into a fresh buffer."""
    buffer = ctx.output_buffer(node, "pointwise")
    if buffer.dtype == "bfloat16" and not (isinstance(expr, ir.Op) and expr.op == "cast") and not isinstance(
        expr, ir.Load
    ):
        # Eager rounds every bf16 op's result; rounding here too keeps fused chains faithful to eager.
        expr = ir.Op("cast", (expr,), dtype="bfloat16")
    shape = buffer.layout.shape
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), shape, (ir.Store(buffer, expr, buffer.layout),)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def load_operand(ctx: LoweringContext, node: torch.fx.Node, arg) -> ir.Expr:
    """An argument of ``node`` as an expression over ``node``'s output shape (a broadcast Load, or a Scalar)."""
    return load(ctx, arg, _shape(node))


def load_input(ctx: LoweringContext, node: torch.fx.Node) -> ir.Expr:
    """``node``'s first argument over its output shape: the operand of a unary op."""
    return load_operand(ctx, node, node.args[0])


def _with_alpha(ctx, node, operand):
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    return operand if alpha == 1 else ir.Op("mul", (operand, ir.Scalar(float(alpha))))


BINARY = {
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
    aten.pow.Tensor_Scalar: "pow",
    aten.eq.Tensor: "eq",
    aten.eq.Scalar: "eq",
    aten.ne.Tensor: "ne",
    aten.ne.Scalar: "ne",
    aten.lt.Tensor: "lt",
    aten.lt.Scalar: "lt",
    aten.le.Tensor: "le",
    aten.le.Scalar: "le",
    aten.gt.Tensor: "gt",
    aten.gt.Scalar: "gt",
    aten.ge.Tensor: "ge",
    aten.ge.Scalar: "ge",
}

UNARY = {
    aten.neg.default: "neg",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid",
    aten.relu.default: "relu",
    aten.abs.default: "abs",
    aten.reciprocal.default: "reciprocal",
    aten.silu.default: "silu",
    aten.erf.default: "erf",
}


def _check_scalars(node: torch.fx.Node) -> str | None:
    for arg in node.args:
        if isinstance(arg, (complex, str)) or (isinstance(arg, torch.fx.Node) and arg.meta.get("val") is None):
            return f"{node.target}: unsupported operand {arg!r}"
    return None


def _check_div(node: torch.fx.Node) -> str | None:
    if node.kwargs.get("rounding_mode") is not None:
        return f"{node.target}: rounding_mode={node.kwargs['rounding_mode']!r} (only true division)"
    return _check_scalars(node)


def _check_pow(node: torch.fx.Node) -> str | None:
    exponent = node.args[1]
    if not isinstance(exponent, (int, float)):
        return f"{node.target}: exponent {exponent!r} is not a number"
    return None


@register_lowering(*BINARY, check=_check_scalars)
def lower_binary(ctx, node):
    a, b = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, ir.Op(BINARY[node.target], (a, b)))


register_lowering(aten.div.Tensor, aten.div.Scalar, check=_check_div)(lower_binary)
register_lowering(aten.pow.Tensor_Scalar, check=_check_pow)(lower_binary)


@register_lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar, check=_check_scalars)
def lower_pow_elementwise(ctx, node):
    """base ** exponent with a tensor exponent (x ** y, 2 ** x): the ALU's power instruction per element."""
    base, exponent = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, ir.Op("pow", (base, exponent)))


@register_lowering(aten.add.Tensor, aten.add.Scalar, check=_check_scalars)
def lower_add(ctx, node):
    a = load_operand(ctx, node, node.args[0])
    b = _with_alpha(ctx, node, load_operand(ctx, node, node.args[1]))
    return emit_pointwise(ctx, node, ir.Op("add", (a, b)))


@register_lowering(aten.sub.Tensor, aten.sub.Scalar, check=_check_scalars)
def lower_sub(ctx, node):
    a = load_operand(ctx, node, node.args[0])
    b = _with_alpha(ctx, node, load_operand(ctx, node, node.args[1]))
    return emit_pointwise(ctx, node, ir.Op("sub", (a, b)))


@register_lowering(torch.ops.prims.fma.default, check=_check_scalars)
def lower_fma(ctx, node):
    """Inductor's ``prims.fma(a, b, c)``, which Dynamo emits for ``addcmul_(t1, t2, value=v)`` and ``add_(x,
    alpha=tensor)`` (compiled optimizers): ``a * b + c``, rounded after the product as the prim's own eager
    implementation rounds, so it equals what the eager fallback gave."""
    a, b, c = (load_operand(ctx, node, arg) for arg in node.args[:3])
    return emit_pointwise(ctx, node, ir.Op("add", (ir.Op("mul", (a, b)), c)))


@register_lowering(aten.rsub.Scalar, aten.rsub.Tensor, check=_check_scalars)
def lower_rsub(ctx, node):
    a = load_operand(ctx, node, node.args[0])
    b = load_operand(ctx, node, node.args[1])
    return emit_pointwise(ctx, node, ir.Op("sub", (b, _with_alpha(ctx, node, a))))


@register_lowering(*UNARY)
def lower_unary(ctx, node):
    return emit_pointwise(ctx, node, ir.Op(UNARY[node.target], (load_operand(ctx, node, node.args[0]),)))


def _check_gelu(node: torch.fx.Node) -> str | None:
    approximate = node.kwargs.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"aten.gelu: approximate={approximate!r}"


@register_lowering(aten.gelu.default, check=_check_gelu)
def lower_gelu(ctx, node):
    op = "gelu_tanh" if node.kwargs.get("approximate", "none") == "tanh" else "gelu"
    return emit_pointwise(ctx, node, ir.Op(op, (load_operand(ctx, node, node.args[0]),)))


def _clamp_expr(expr, low, high):
    if low is not None:
        expr = ir.Op("maximum", (expr, ir.Scalar(float(low))))
    if high is not None:
        expr = ir.Op("minimum", (expr, ir.Scalar(float(high))))
    return expr


def _check_clamp(node: torch.fx.Node) -> str | None:
    bounds = list(node.args[1:]) + list(node.kwargs.values())
    if any(isinstance(bound, torch.fx.Node) for bound in bounds):
        return f"{node.target}: tensor bounds (only number bounds)"
    return None


@register_lowering(aten.clamp.default, check=_check_clamp)
def lower_clamp(ctx, node):
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    return emit_pointwise(ctx, node, _clamp_expr(load_operand(ctx, node, node.args[0]), low, high))


@register_lowering(aten.clamp_min.default, check=_check_clamp)
def lower_clamp_min(ctx, node):
    return emit_pointwise(ctx, node, _clamp_expr(load_operand(ctx, node, node.args[0]), node.args[1], None))


@register_lowering(aten.clamp_max.default, check=_check_clamp)
def lower_clamp_max(ctx, node):
    return emit_pointwise(ctx, node, _clamp_expr(load_operand(ctx, node, node.args[0]), None, node.args[1]))


@register_lowering(aten.where.self, check=_check_scalars)
def lower_where(ctx, node):
    # An exact select on the bit patterns (codegen/expressions.py): masked -inf and nan pass through.
    condition, a, b = (load_operand(ctx, node, arg) for arg in node.args[:3])
    return emit_pointwise(ctx, node, ir.Op("where", (condition, a, b)))


def _check_to_copy(node: torch.fx.Node) -> str | None:
    allowed = {"dtype", "layout", "device", "memory_format", "non_blocking", "pin_memory"}
    extra = set(node.kwargs) - allowed
    if extra:
        return f"{node.target}: unsupported arguments {sorted(extra)}"
    return None


@register_lowering(aten._to_copy.default, prims.convert_element_type.default, check=_check_to_copy)
def lower_cast(ctx, node):
    out_dtype = dtype_name(node.meta["val"].dtype)
    source = load_operand(ctx, node, node.args[0])
    if node.meta["val"].dtype == torch.bool:
        # To bool is a truth test, not a numeric conversion: 0.3 -> True and nan -> True, as eager does.
        return emit_pointwise(ctx, node, ir.Op("ne", (source, ir.Scalar(0.0))))
    if node.meta["val"].dtype in INTEGER_DTYPES and node.args[0].meta["val"].is_floating_point():
        # Float to integer truncates toward zero (eager's C cast); the value-range check proved |x| < 2**24, so
        # the exact fp32 trunc is an integer the conversion keeps whatever its rounding mode.
        source = trunc(source)
    return emit_pointwise(ctx, node, ir.Op("cast", (source,), dtype=out_dtype))


@register_lowering(aten.isnan.default)
def lower_isnan(ctx, node):
    # nan is the only value not equal to itself (IEEE compare on the Vector engine): exact, no range limits.
    x = load_operand(ctx, node, node.args[0])
    return emit_pointwise(ctx, node, ir.Op("ne", (x, x)))


@register_lowering(aten.logical_not.default)
def lower_logical_not(ctx, node):
    # A truth test inverted: x == 0 (nan is truthy, so logical_not(nan) is False, as eager gives).
    return emit_pointwise(ctx, node, ir.Op("eq", (load_operand(ctx, node, node.args[0]), ir.Scalar(0.0))))


@register_lowering(aten.clone.default)
def lower_clone(ctx, node):
    return emit_pointwise(ctx, node, load_operand(ctx, node, node.args[0]))


# A copy loads and stores tiles of the buffer's own dtype (no fp32 pass): exact for every integer.
INTEGER_OPS.add(aten.clone.default)


def _check_gelu_backward(node: torch.fx.Node) -> str | None:
    approximate = node.kwargs.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"aten.gelu_backward: approximate={approximate!r}"


GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715


def _gelu_tanh_derivative(x: ir.Expr) -> ir.Expr:
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx (the
    Scalar engine has the exact gelu's derivative, gelu_dx, but none for the tanh form)."""
    op = ir.op
    square = op("mul", x, x)
    t = op("tanh", op("mul", op("add", x, op("mul", op("mul", square, x), GELU_TANH_CUBIC)), GELU_TANH_SCALE))
    du_dx = op("mul", op("add", op("mul", square, 3 * GELU_TANH_CUBIC), 1.0), GELU_TANH_SCALE)
    return op("add", op("mul", op("add", t, 1.0), 0.5), op("mul", op("mul", op("mul", x, 0.5),
                                                                      op("sub", 1.0, op("mul", t, t))), du_dx))


@register_lowering(aten.gelu_backward.default, check=_check_gelu_backward)
def lower_gelu_backward(ctx, node):
    grad, x = (load_operand(ctx, node, arg) for arg in node.args[:2])
    tanh_form = node.kwargs.get("approximate", "none") == "tanh"
    derivative = _gelu_tanh_derivative(x) if tanh_form else ir.Op("gelu_dx", (x,))
    return emit_pointwise(ctx, node, ir.Op("mul", (grad, derivative)))


@register_lowering(aten.silu_backward.default)
def lower_silu_backward(ctx, node):
    grad, x = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, ir.Op("mul", (grad, ir.Op("silu_dx", (x,)))))


def _check_softplus(node: torch.fx.Node) -> str | None:
    beta = node.args[1] if len(node.args) > 1 else node.kwargs.get("beta", 1)
    threshold = node.args[2] if len(node.args) > 2 else node.kwargs.get("threshold", 20)
    # log(1 + exp(x)) equals x in fp32 beyond 20, so only the default beta / threshold match eager exactly.
    if beta != 1 or threshold < 20:
        return f"aten.softplus: beta={beta}, threshold={threshold} (only beta=1, threshold>=20)"
    return None


@register_lowering(aten.softplus.default, check=_check_softplus)
def lower_softplus(ctx, node):
    return emit_pointwise(ctx, node, ir.Op("softplus", (load_operand(ctx, node, node.args[0]),)))


@register_lowering(aten.mish.default)
def lower_mish(ctx, node):
    return emit_pointwise(ctx, node, ir.Op("mish", (load_operand(ctx, node, node.args[0]),)))


def _check_full(node: torch.fx.Node) -> str | None:
    value = _fill_value(node)
    if not isinstance(value, (int, float)):
        return f"{node.target}: fill value {value!r}"
    return None  # integer fills: the value-range check (INTEGER_ARITHMETIC_OPS) bounds the value


def _fill_value(node: torch.fx.Node):
    return node.args[0] if node.target is aten.scalar_tensor.default else node.args[1]


@register_lowering(aten.full.default, aten.full_like.default, aten.scalar_tensor.default, check=_check_full)
def lower_full(ctx, node):
    # full_like's meta['val'] already has the strides eager gives it (it follows its input's layout).
    return emit_pointwise(ctx, node, ir.Scalar(float(_fill_value(node))))


# Integer operands and results compute in fp32 tiles: exact when passes/value_range.py proves every value within
# +-2**24 (the registry checks it per node). pow stays out: nl.power is not exact on integers.
INTEGER_ARITHMETIC_OPS.update((
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.maximum.default, aten.minimum.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor,
    aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.where.self,
    aten._to_copy.default, prims.convert_element_type.default, aten.full.default,
    aten.full_like.default, aten.scalar_tensor.default,
))
