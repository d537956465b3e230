"""Lowering stage, pointwise math family: rounding, sign bits, logical ops, nan-aware min/max, tensor clamps,
exp/log variants and the elu / hardtanh / leaky_relu activations with their backward ops.

Input: an ATen FX node. Output: one ``ir.Pointwise`` (through ``emit_pointwise``) whose expression tree only uses
instructions that are exact or used inside their valid input ranges (nki-spec §1.5): rounding is fp32 ALU
arithmetic (the 2**23 trick) and bit operations, never an approximate activation; every ``log`` and
``reciprocal`` argument is kept inside its range by a select before the instruction.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.lowering.math_expressions import (
    INF,
    LN2,
    absolute,
    add,
    both,
    ceil,
    copysign,
    div,
    either,
    eq,
    exp,
    floor,
    ge,
    gt,
    le,
    lt,
    mul,
    ne,
    round_half_even,
    sign,
    sub,
    trunc,
    where,
)
from neuron_compile.lowering.pointwise import emit_pointwise, load_input, load_operand
from neuron_compile.lowering.registry import register_lowering
from neuron_compile.guarded_math import safe_log

aten = torch.ops.aten


def _arg(node: torch.fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _check_round_decimals(node: torch.fx.Node) -> str | None:
    decimals = _arg(node, 1, "decimals", 0)
    if decimals < 0:
        # eager divides by 10**-decimals before rounding; a reciprocal multiply is off by an ulp there and an ulp
        # across a .5 boundary moves the result by a whole 10**-decimals (2500 -> 3000 instead of 2000).
        return f"aten.round.decimals: decimals={decimals} (negative decimals need a correctly rounded division)"
    if 10.0**decimals > FP32_EXACT_INTEGER:
        return f"aten.round.decimals: decimals={decimals} (10**decimals is not an exact fp32)"
    return None


@register_lowering(aten.round.decimals, check=_check_round_decimals)
def lower_round_decimals(ctx, node):
    # eager: nearbyint(x * 10**d) / 10**d. The product is the same single fp32 multiply as eager's; the final
    # division is a reciprocal multiply (<= 1.5 ulp, the harness's stated division error).
    scale = 10.0 ** _arg(node, 1, "decimals", 0)
    x = load_input(ctx, node)
    if scale == 1.0:
        return emit_pointwise(ctx, node, round_half_even(x))
    return emit_pointwise(ctx, node, div(round_half_even(mul(x, scale)), scale))


@register_lowering(aten.signbit.default)
def lower_signbit(ctx, node):
    # The sign bit itself (signbit(-0.0) and signbit(-nan) are True): 1.0 carrying x's sign bit, compared to 0.
    return emit_pointwise(ctx, node, lt(copysign(1.0, load_input(ctx, node)), 0.0))


@register_lowering(aten.copysign.Tensor, aten.copysign.Scalar)
def lower_copysign(ctx, node):
    magnitude, sign_source = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, copysign(magnitude, sign_source))


# ---------------------------------------------------------------- logical ops, nan-aware min / max, clamps


def _truth(value):
    return ne(value, 0.0)  # nan is truthy, as eager's bool()


LOGICAL = {
    aten.logical_and.default: lambda a, b: both(_truth(a), _truth(b)),
    aten.logical_or.default: lambda a, b: either(_truth(a), _truth(b)),
    aten.logical_xor.default: lambda a, b: ne(_truth(a), _truth(b)),
}


@register_lowering(*LOGICAL)
def lower_logical(ctx, node):
    a, b = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, LOGICAL[node.target](a, b))


# On bool tensors the bitwise ops are the logical ones (0/1 operands); integer bit patterns are not lowered.
BITWISE_ON_BOOL = {
    aten.bitwise_and.Tensor: LOGICAL[aten.logical_and.default],
    aten.bitwise_or.Tensor: LOGICAL[aten.logical_or.default],
    aten.bitwise_xor.Tensor: LOGICAL[aten.logical_xor.default],
    aten.bitwise_not.default: lambda a: eq(a, 0.0),  # ~mask: a causal mask complemented
}


def _check_bool_operands(node: torch.fx.Node) -> str | None:
    for arg in node.args[:2]:
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype is not torch.bool:
            return f"{node.target}: only bool tensors (integer bit patterns are not lowered)"
    return None


@register_lowering(*BITWISE_ON_BOOL, check=_check_bool_operands)
def lower_bitwise_on_bool(ctx, node):
    operands = [load_operand(ctx, node, arg) for arg in node.args[:2]]
    return emit_pointwise(ctx, node, BITWISE_ON_BOOL[node.target](*operands))


@register_lowering(aten.fmax.default, aten.fmin.default)
def lower_fmax_fmin(ctx, node):
    # nan-ignoring: a nan operand yields the other one (nan only when both are); else the plain maximum/minimum.
    a, b = (load_operand(ctx, node, arg) for arg in node.args[:2])
    plain = ir.op("maximum" if node.target is aten.fmax.default else "minimum", a, b)
    return emit_pointwise(ctx, node, where(ne(a, a), b, where(ne(b, b), a, plain)))


def _clamp(x, low, high):
    # min(max(x, low), high): eager's order (low > high gives high); nl.maximum / nl.minimum propagate nan, so a
    # nan in x or in either bound gives nan, as eager's clamp.Tensor.
    if low is not None:
        x = ir.op("maximum", x, low)
    if high is not None:
        x = ir.op("minimum", x, high)
    return x


@register_lowering(aten.clamp.Tensor)
def lower_clamp_tensor(ctx, node):
    low, high = _arg(node, 1, "min", None), _arg(node, 2, "max", None)
    bounds = [None if bound is None else load_operand(ctx, node, bound) for bound in (low, high)]
    return emit_pointwise(ctx, node, _clamp(load_input(ctx, node), *bounds))


@register_lowering(aten.clamp_min.Tensor)
def lower_clamp_min_tensor(ctx, node):
    return emit_pointwise(ctx, node, _clamp(load_input(ctx, node), load_operand(ctx, node, node.args[1]), None))


@register_lowering(aten.clamp_max.Tensor)
def lower_clamp_max_tensor(ctx, node):
    return emit_pointwise(ctx, node, _clamp(load_input(ctx, node), None, load_operand(ctx, node, node.args[1])))


@register_lowering(aten.isinf.default)
def lower_isinf(ctx, node):
    x = load_input(ctx, node)
    return emit_pointwise(ctx, node, either(eq(x, INF), eq(x, -INF)))


# ---------------------------------------------------------------- exp / log variants


def expm1(x):
    """exp(x) - 1 without the cancellation near 0: Kahan's u = exp(x); (u - 1) * x / log(u) for |x| < 1/2
    (u - 1 is exact there by Sterbenz, u in [0.6, 1.65] is a valid log input, log(u) != 0 unless u == 1, where
    the answer is x itself); exp(x) - 1 elsewhere, which is accurate once |exp(x) - 1| >= 0.39."""
    near_zero = lt(absolute(x), 0.5)
    clamped = ir.op("minimum", ir.op("maximum", x, -0.5), 0.5)
    u = exp(clamped)
    log_u = ir.op("log_in_range", u)  # u in [0.6, 1.65]
    kahan = mul(sub(u, 1.0), div(clamped, where(eq(u, 1.0), 1.0, log_u)))
    return where(near_zero, where(eq(u, 1.0), clamped, kahan), sub(exp(x), 1.0))


def log1p(x):
    """log(1 + x) without losing x's low bits: u = 1 + x; log(u) * x / (u - 1) corrects u's rounding (exact
    u - 1 by Sterbenz near 1); u == 1 gives x. For |u| >= 2**24 the correction is 1 to an ulp and skipped, so
    the reciprocal of u - 1 stays inside ±[2**-24, 2**24]."""
    u = add(x, 1.0)
    u_minus_1 = sub(u, 1.0)
    moderate = lt(absolute(u), 2.0**24)  # false for nan and infinities
    ratio = where(moderate, div(x, where(eq(u_minus_1, 0.0), 1.0, u_minus_1)), 1.0)
    return where(eq(u, 1.0), x, mul(safe_log(u), ratio))


@register_lowering(aten.exp2.default)
def lower_exp2(ctx, node):
    # exp(x ln 2): the product's rounding (2**-24 relative) grows to |x| ln 2 * 2**-24 in the result, under
    # 5.3e-6 relative over |x| <= 128 (beyond, 2**x over- or underflows fp32 anyway).
    return emit_pointwise(ctx, node, exp(mul(load_input(ctx, node), LN2)))


@register_lowering(aten.log2.default, aten.log10.default)
def lower_log2_log10(ctx, node):
    base = 2.0 if node.target is aten.log2.default else 10.0
    return emit_pointwise(ctx, node, mul(safe_log(load_input(ctx, node)), 1.0 / math.log(base)))


# ---------------------------------------------------------------- activations and their backward ops


def _check_numbers(*positions):
    def check(node: torch.fx.Node) -> str | None:
        for index in positions:
            if index < len(node.args) and not isinstance(node.args[index], (int, float)):
                return f"{node.target}: argument {index} is {node.args[index]!r}, not a number"
        return None

    return check


def _elu_parameters(node, first):
    alpha, scale, input_scale = (float(_arg(node, first + i, name, 1.0))
                                 for i, name in enumerate(("alpha", "scale", "input_scale")))
    return alpha, scale, input_scale


@register_lowering(aten.elu.default, check=_check_numbers(1, 2, 3))
def lower_elu(ctx, node):
    # eager: x > 0 ? x * scale : expm1(x * input_scale) * alpha * scale (nan takes the expm1 side: nan).
    alpha, scale, input_scale = _elu_parameters(node, 1)
    x = load_input(ctx, node)
    negative = mul(expm1(mul(x, input_scale)), alpha * scale)
    return emit_pointwise(ctx, node, where(gt(x, 0.0), mul(x, scale), negative))


@register_lowering(aten.hardtanh.default, check=_check_numbers(1, 2))
def lower_hardtanh(ctx, node):
    low, high = float(_arg(node, 1, "min_val", -1.0)), float(_arg(node, 2, "max_val", 1.0))
    return emit_pointwise(ctx, node, _clamp(load_input(ctx, node), ir.Scalar(low), ir.Scalar(high)))


@register_lowering(aten.leaky_relu.default, check=_check_numbers(1))
def lower_leaky_relu(ctx, node):
    slope = float(_arg(node, 1, "negative_slope", 0.01))
    x = load_input(ctx, node)
    return emit_pointwise(ctx, node, where(gt(x, 0.0), x, mul(x, slope)))


# elu_backward and hardtanh_backward are left to their decompositions: eager's kernels give a nan input different
# gradients in vectorized lanes and in the scalar tail (nan vs grad), so no single formula equals eager.
@register_lowering(aten.leaky_relu_backward.default, check=_check_numbers(2))
def lower_leaky_relu_backward(ctx, node):
    grad, x = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, where(gt(x, 0.0), grad, mul(grad, float(node.args[2]))))


@register_lowering(aten.threshold_backward.default, check=_check_numbers(2))
def lower_threshold_backward(ctx, node):
    grad, x = (load_operand(ctx, node, arg) for arg in node.args[:2])
    return emit_pointwise(ctx, node, where(le(x, float(node.args[2])), 0.0, grad))


# ---------------------------------------------------------------- erfc, inverse and hyperbolic functions


@register_lowering(aten.erfc.default)
def lower_erfc(ctx, node):
    # 1 - erf(x): absolute error ~6e-8 (erf's rounding), inside the fp32 atol 1e-5 everywhere; erfc's relative
    # accuracy in the far tail (erfc(4) = 1.5e-8) is not kept, the tolerance's absolute term covers it.
    return emit_pointwise(ctx, node, sub(1.0, ir.op("erf", load_input(ctx, node))))


def arctan(x):
    """atan for every x with the arctan instruction fed only [-1, 1] (its valid range is [-pi/2, pi/2]): for
    |x| > 1, atan(x) = copysign(pi/2, x) - atan(1/x). Beyond 2**40, 1/x is below pi/2's half ulp: the reciprocal
    (valid to 2**42) sees a clamped 2**40 instead."""
    big = gt(absolute(x), 1.0)
    clamped = copysign(ir.op("minimum", absolute(x), 2.0**40), x)
    reduced = where(big, div(-1.0, where(big, clamped, 1.0)), x)
    return add(ir.op("arctan", reduced), where(big, copysign(math.pi / 2, x), 0.0))


@register_lowering(aten.atanh.default)
def lower_atanh(ctx, node):
    # atanh(a) = 0.5 * log1p(2a / (1 - a)) on a = |x| (odd: x's sign put back): no cancellation near 0 (log1p is
    # accurate there), 1 - a exact for a >= 0.5 (Sterbenz) so a near 1 keeps its digits (on the signed x,
    # 2x / (1 - x) near -1 rounds onto log1p's pole). |x| = 1 -> +-inf; |x| > 1 (and the infinities) -> nan, so
    # the reciprocal of 1 - a only sees (0, 1].
    x = load_input(ctx, node)
    magnitude = absolute(x)
    inside = lt(magnitude, 1.0)  # false for nan
    one_minus = where(inside, sub(1.0, magnitude), 1.0)
    core = mul(log1p(mul(div(magnitude, one_minus), 2.0)), 0.5)
    edge = where(eq(magnitude, 1.0), INF, math.nan)
    return emit_pointwise(ctx, node, copysign(where(inside, core, where(ne(x, x), x, edge)), x))


# ln 2 split so that |x| - LN2_HI is exact for 16 <= |x| < 128 (LN2_HI is a multiple of 2**-17, |x| of 2**-19).
LN2_HI = round(LN2 * 2**17) / 2**17
LN2_LO = LN2 - LN2_HI


def _half_exp(magnitude):
    """exp(m) / 2 for m >= 16 without overflowing where exp(m) would (m in (88.7, 89.4]): exp(m - ln 2), with the
    subtraction exact through the split constant and the small remainder as a multiply by exp(-LN2_LO).
    This is std::sinh / std::cosh's value, which eager returns for its scalar loop (tensors under 16 elements and
    the tail); eager's vectorized loop overflows to inf for |x| in (88.72, 89.42], a band where eager disagrees
    with itself."""
    return mul(exp(sub(magnitude, LN2_HI)), math.exp(-LN2_LO))


@register_lowering(aten.sinh.default)
def lower_sinh(ctx, node):
    # (expm1(x) - expm1(-x)) / 2: the two terms have opposite signs near 0, so no cancellation; |x| >= 20 is
    # copysign(exp(|x|) / 2, x) (exp(-|x|) is below its ulp there).
    x = load_input(ctx, node)
    small = mul(sub(expm1(x), expm1(ir.op("neg", x))), 0.5)
    return emit_pointwise(ctx, node, where(lt(absolute(x), 20.0), small, copysign(_half_exp(absolute(x)), x)))


@register_lowering(aten.cosh.default)
def lower_cosh(ctx, node):
    x = load_input(ctx, node)
    magnitude = absolute(x)
    small = mul(add(exp(magnitude), exp(ir.op("neg", magnitude))), 0.5)
    return emit_pointwise(ctx, node, where(lt(magnitude, 20.0), small, _half_exp(magnitude)))


def _sqrt_in_range(v):
    """sqrt(v) for 0 <= v <= 2**100 with the sqrt instruction fed only [2**-100, 2**100] (valid range [2**-116,
    2**118]): below 2**-100 the root (< 2**-50) is taken as 0, far under any result's ulp where it is added."""
    positive = gt(v, 2.0**-100)
    return where(positive, ir.op("sqrt_in_range", where(positive, ir.op("minimum", v, 2.0**100), 1.0)), 0.0)


def _asin_core(t):
    """asin(t) = atan(t / sqrt((1 - t)(1 + t))) for |t| <= 1/2, where the atan argument is at most 0.58 (the
    arctan instruction's range is [-pi/2, pi/2]); t is clamped to [-3/4, 3/4] first so that lanes a select
    discards stay in range too."""
    clamped = ir.op("minimum", ir.op("maximum", t, -0.75), 0.75)
    root = ir.op("sqrt_in_range", mul(sub(1.0, clamped), add(1.0, clamped)))  # in [0.66, 1]
    return ir.op("arctan", div(clamped, root))


@register_lowering(aten.asin.default)
def lower_asin(ctx, node):
    # |x| <= 1/2: the core form; |x| > 1/2: pi/2 - acos(|x|) = pi/2 - 2 asin(sqrt((1 - |x|) / 2)) with 1 - |x| exact
    # (Sterbenz), no cancellation near 1; x's sign put back (asin(-0.0) = -0.0). |x| > 1 and nan -> nan.
    x = load_input(ctx, node)
    magnitude = absolute(x)
    near_one = sub(math.pi / 2, mul(_asin_core(_sqrt_in_range(mul(sub(1.0, magnitude), 0.5))), 2.0))
    inside = copysign(where(le(magnitude, 0.5), _asin_core(magnitude), near_one), x)
    return emit_pointwise(ctx, node, where(le(magnitude, 1.0), inside, math.nan))


@register_lowering(aten.acos.default)
def lower_acos(ctx, node):
    # |x| <= 1/2: pi/2 - asin(x) (|asin| <= pi/6, no cancellation); x > 1/2: 2 asin(sqrt((1 - x) / 2)); x < -1/2:
    # pi - 2 asin(sqrt((1 + x) / 2)); 1 -+ x exact there (Sterbenz). |x| > 1 and nan -> nan.
    x = load_input(ctx, node)
    magnitude = absolute(x)
    positive = mul(_asin_core(_sqrt_in_range(mul(sub(1.0, x), 0.5))), 2.0)
    negative = sub(math.pi, mul(_asin_core(_sqrt_in_range(mul(add(1.0, x), 0.5))), 2.0))
    middle = sub(math.pi / 2, _asin_core(x))
    inside = where(le(magnitude, 0.5), middle, where(gt(x, 0.0), positive, negative))
    return emit_pointwise(ctx, node, where(le(magnitude, 1.0), inside, math.nan))


BIG_ARGUMENT = 4096.0  # beyond, asinh(x) = log(2x) and acosh(x) = log(2x) to below an ulp (error ~ 1 / (4x**2))


@register_lowering(aten.asinh.default)
def lower_asinh(ctx, node):
    # asinh(a) = log1p(a + a**2 / (1 + sqrt(1 + a**2))) (no cancellation near 0), log(a) + ln 2 for a >= 4096;
    # odd, so x's sign is put back. The small form sees a clamped to 4096 (a**2 stays finite, sqrt in range).
    x = load_input(ctx, node)
    magnitude = absolute(x)
    clamped = ir.op("minimum", magnitude, BIG_ARGUMENT)
    square = mul(clamped, clamped)
    small = log1p(add(clamped, div(square, add(1.0, ir.op("sqrt", add(1.0, square))))))
    result = where(lt(magnitude, BIG_ARGUMENT), small, add(safe_log(magnitude), LN2))
    return emit_pointwise(ctx, node, copysign(result, x))


@register_lowering(aten.acosh.default)
def lower_acosh(ctx, node):
    # acosh(x) = log1p((x - 1) + sqrt((x - 1)(x + 1))) (x - 1 exact near 1), log(x) + ln 2 for x >= 4096;
    # x < 1 and nan -> nan. The small form sees x clamped to [1, 4096].
    x = load_input(ctx, node)
    clamped = ir.op("minimum", ir.op("maximum", x, 1.0), BIG_ARGUMENT)
    below = sub(clamped, 1.0)
    small = log1p(add(below, _sqrt_in_range(mul(below, add(clamped, 1.0)))))
    result = where(lt(x, BIG_ARGUMENT), small, add(safe_log(x), LN2))
    return emit_pointwise(ctx, node, where(ge(x, 1.0), result, math.nan))


@register_lowering(aten.atan2.default)
def lower_atan2(ctx, node):
    """atan2(y, x) from theta = atan(min / max) of the magnitudes (in [0, 1], the arctan instruction's range),
    then pi/2 - theta where |y| > |x|, pi - theta where x's sign bit is set, and y's sign. Both magnitudes are
    rescaled by one exact power of two (max into [1, 2)) so the reciprocal sees its valid range; max = 0 gives
    theta = 0 (atan2(+-0, -0) = +-pi), two infinities theta = pi/4; a nan in either operand gives nan."""
    y, x = (load_operand(ctx, node, arg) for arg in node.args[:2])
    a, b = absolute(y), absolute(x)
    larger, smaller = ir.op("maximum", a, b), ir.op("minimum", a, b)
    scale = ir.op("inverse_power_of_two", ir.op("minimum", larger, 2.0**126))
    both_infinite = both(eq(a, INF), eq(b, INF))
    ordinary = both(gt(larger, 0.0), lt(larger, INF))
    ratio = where(ordinary, div(mul(smaller, scale), where(ordinary, mul(larger, scale), 1.0)),
                  where(both_infinite, 1.0, 0.0))
    theta = ir.op("arctan", ratio)
    theta = where(gt(a, b), sub(math.pi / 2, theta), theta)
    theta = where(lt(copysign(1.0, x), 0.0), sub(math.pi, theta), theta)
    result = copysign(theta, y)
    either_nan = either(ne(x, x), ne(y, y))
    return emit_pointwise(ctx, node, where(either_nan, math.nan, result))


# Unary ops whose whole lowering is one expression form above, applied to the operand.
UNARY_FORMS = {
    aten.round.default: round_half_even,
    aten.floor.default: floor,
    aten.ceil.default: ceil,
    aten.trunc.default: trunc,
    aten.sign.default: sign,
    aten.sgn.default: sign,
    aten.expm1.default: expm1,
    aten.log1p.default: log1p,
    aten.atan.default: arctan,
}


@register_lowering(*UNARY_FORMS)
def lower_unary_form(ctx, node):
    return emit_pointwise(ctx, node, UNARY_FORMS[node.target](load_input(ctx, node)))
