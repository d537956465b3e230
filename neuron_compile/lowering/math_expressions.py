"""Lowering stage, expression builders shared by the pointwise families (pointwise, pointwise_math, special,
trigonometry, integer division): arithmetic, comparisons, selects and the exact fp32 roundings.

Input: IR expressions, or numbers (``ir.op`` makes them Scalars). Output: ``ir.Op`` expression trees. Builders
only, no lowerings: every family may import this module, and it imports none of them.
"""

from __future__ import annotations

import math

from neuron_compile import ir

# 2**23: every fp32 of magnitude >= 2**23 is an integer; below it, (a + 2**23) - 2**23 rounds a >= 0 to an
# integer half to even (the sum lies in [2**23, 2**24), where the fp32 spacing is exactly 1).
TWO_23 = 8388608.0
LN2 = math.log(2.0)
INF = math.inf


def add(a, b):
    return ir.op("add", a, b)


def sub(a, b):
    return ir.op("sub", a, b)


def mul(a, b):
    return ir.op("mul", a, b)


def div(a, b):
    return ir.op("div", a, b)


def where(condition, a, b):
    return ir.op("where", condition, a, b)


def minimum(a, b):
    return ir.op("minimum", a, b)


def maximum(a, b):
    return ir.op("maximum", a, b)


def both(a, b):  # logical and of two 0/1 predicates
    return ir.op("mul", a, b)


def either(a, b):  # logical or of two 0/1 predicates
    return ir.op("maximum", a, b)


def _compare(name):
    return lambda a, b: ir.op(name, a, b)


gt, lt, ge, le, eq, ne = (_compare(name) for name in ("gt", "lt", "ge", "le", "eq", "ne"))


def absolute(x):
    return ir.op("abs", x)


def copysign(magnitude, sign):
    return ir.op("copysign", magnitude, sign)


def exp(x):
    return ir.op("exp", x)


# ---------------------------------------------------------------- rounding and sign


def round_half_even(x):
    """torch.round: exact for every fp32. |x| < 2**23 rounds through the 2**23 trick on |x| and takes x's sign
    back (so -0.4 -> -0.0); |x| >= 2**23, inf and nan (the compare is false) are already their own rounding."""
    magnitude = absolute(x)
    rounded = sub(add(magnitude, TWO_23), TWO_23)
    return where(lt(magnitude, TWO_23), copysign(rounded, x), x)


def floor(x):
    # round(x) is within 1/2 of x: one step down where it rounded up. Signs: x >= +0 gives >= +0 (t - 0 keeps
    # +0); x <= -0 gives -0.0 - 0 = -0.0 or a negative integer, as eager.
    rounded = round_half_even(x)
    return where(lt(absolute(x), TWO_23), sub(rounded, gt(rounded, x)), x)


def ceil(x):
    # ceil(x) = -floor(-x): negation is exact and keeps signed zeros right (ceil(-0.3) = -0.0).
    return ir.op("neg", floor(ir.op("neg", x)))


def trunc(x):
    magnitude = absolute(x)
    rounded = sub(add(magnitude, TWO_23), TWO_23)
    toward_zero = sub(rounded, gt(rounded, magnitude))
    return where(lt(magnitude, TWO_23), copysign(toward_zero, x), x)


def sign(x):
    # (x > 0) - (x < 0), eager's formula: sign(nan) = 0, sign(-0.0) = +0.0.
    return sub(gt(x, 0.0), lt(x, 0.0))
