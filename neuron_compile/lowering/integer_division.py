"""Lowering stage, integer division family: remainder, fmod and floor / trunc division of integer tensors by a
nonzero integer constant (the index arithmetic of roll, fftshift, cross: ``(arange + shift) % n``).

Input: an ATen FX node whose integer operand the value-range pass bounds. Output: one ``ir.Pointwise`` of exact
fp32 integer math. The quotient estimate ``floor(a * fl(1/m))`` is within one of ``floor(a / m)`` while
|a| < 2**24 (two roundings, each 2**-24 relative, of a quotient below 2**24 / m), so one correction step each way
makes ``r = a - q * m`` the exact remainder; every product and difference stays an integer below 2**24 when
|a| + 2|m| is (checked). Float operands are declined: their remainder needs a correctly rounded division.
"""

from __future__ import annotations

import torch

from neuron_compile.lowering.math_expressions import (
    absolute,
    add,
    floor,
    ge,
    gt,
    lt,
    mul,
    round_half_even,
    sub,
    where,
)
from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.registry import INTEGER_ARITHMETIC_OPS, INTEGER_DTYPES, load, register_lowering
from neuron_compile.passes.value_range import EXACT_INTEGER_BOUND, value_range

aten = torch.ops.aten


def _divisor(node: torch.fx.Node):
    return node.args[1]


def _check_integer_division(node: torch.fx.Node) -> str | None:
    dividend, divisor = node.args[0], _divisor(node)
    if not isinstance(dividend, torch.fx.Node) or dividend.meta["val"].dtype not in INTEGER_DTYPES:
        return f"{node.target}: float operands (their remainder needs a correctly rounded division)"
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor == 0:
        return f"{node.target}: divisor {divisor!r} (only a nonzero integer constant)"
    rounding = node.kwargs.get("rounding_mode", "floor")
    if rounding not in ("floor", "trunc"):
        return f"{node.target}: rounding_mode={rounding!r}"
    bounds = value_range(dividend)
    if bounds is None or max(-bounds.low, bounds.high) + 2 * abs(divisor) > EXACT_INTEGER_BOUND:
        return f"{node.target}: |dividend| + 2 |divisor| not proved within 2**24 (the quotient step runs in fp32)"
    return None


def _modulo(a, m: int):
    """a mod m in [0, m) for integer-valued a and m > 0 (see the module docstring)."""
    remainder = sub(a, mul(floor(mul(a, 1.0 / m)), float(m)))
    remainder = add(remainder, mul(lt(remainder, 0.0), float(m)))
    return sub(remainder, mul(ge(remainder, float(m)), float(m)))


def remainder(a, b: int):
    """Python's a % b: the sign of the divisor."""
    r = _modulo(a, abs(b))
    return r if b > 0 else where(gt(r, 0.0), sub(r, float(abs(b))), r)


def fmod(a, b: int):
    """C's fmod: the sign of the dividend."""
    r = _modulo(absolute(a), abs(b))
    return where(lt(a, 0.0), mul(r, -1.0), r)


@register_lowering(aten.remainder.Scalar, aten.fmod.Scalar, check=_check_integer_division)
def lower_remainder(ctx, node):
    a = load(ctx, node.args[0], tuple(node.meta["val"].shape))
    rule = remainder if node.target is aten.remainder.Scalar else fmod
    return emit_pointwise(ctx, node, rule(a, _divisor(node)))


@register_lowering(aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default,
                   check=_check_integer_division)
def lower_integer_divide(ctx, node):
    """(a - r) / b is an exact integer quotient; multiplying by fl(1/b) lands within 1/2 of it, so rounding
    recovers it. Floor division takes Python's remainder, trunc division C's."""
    a = load(ctx, node.args[0], tuple(node.meta["val"].shape))
    b = _divisor(node)
    r = fmod(a, b) if node.kwargs.get("rounding_mode") == "trunc" else remainder(a, b)
    return emit_pointwise(ctx, node, round_half_even(mul(sub(a, r), 1.0 / b)))


INTEGER_ARITHMETIC_OPS.update((aten.remainder.Scalar, aten.fmod.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
                               aten.floor_divide.default))
