"""Pass (lowering -> fusion): keep every range-limited Scalar-engine function inside its valid input range.

Input: IR nodes from the lowering stage. Output: the same nodes in which every ``log``, ``sqrt``, ``rsqrt`` and
``reciprocal`` Op, and every division by a tensor, is an exact guarded expression: finite nonzero inputs are
brought into the instruction's valid range by power-of-two scalings (exact multiplies, undone on the result),
the special inputs (0, -0.0, inf, negatives, nan) select their IEEE results, and the bare instruction — the
``*_in_range`` op, which the codegen emits as the plain activation — only ever sees valid inputs.

Why: the hardware's activation functions are piecewise approximations valid on documented ranges only
(nki-spec §1.5: log [2**-64, 2**64], sqrt [2**-116, 2**118], rsqrt [2**-87, 2**97], reciprocal
+-[2**-42, 2**42]); outside them the device returns invalid results where numpy would be right. The simulator
refuses such inputs, so a kernel that passes here cannot silently fail on the device. Lowerings that already
guard their arguments (pointwise_math's log1p, asin) build the ``*_in_range`` ops themselves; templates whose
arguments are in range by construction (softmax's row sum is in [1, row length], or nan) call the instruction.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir, kinds

INF = math.inf
GUARDED = ("log", "sqrt", "rsqrt", "reciprocal")


_op = ir.op


def _finite_positive(x) -> ir.Op:
    return _op("mul", _op("gt", x, 0.0), _op("lt", x, INF))  # false for nan


def _scaled(x, threshold_big: float, threshold_small: float, big_scale: float, small_scale: float):
    """(x scaled into range, a 0/1 ``big`` flag, a 0/1 ``small`` flag) by exact powers of two."""
    big, small = _op("gt", x, threshold_big), _op("lt", x, threshold_small)
    scaled = _op("where", big, _op("mul", x, big_scale), _op("where", small, _op("mul", x, small_scale), x))
    return scaled, big, small


def safe_log(u) -> ir.Op:
    """log(u): large u scaled by 2**-64, small positive ones by 2**100 (2**-149 * 2**100 = 2**-49), the exponent
    added back as a multiple of ln 2; 0 -> -inf, inf -> inf, negatives and nan -> nan."""
    scaled, big, small = _scaled(u, 2.0**63, 2.0**-63, 2.0**-64, 2.0**100)
    offset = _op("where", big, 64 * math.log(2.0), _op("where", small, -100 * math.log(2.0), 0.0))
    positive = _finite_positive(u)
    core = _op("add", _op("log_in_range", _op("where", positive, scaled, 1.0)), offset)
    special = _op("where", _op("eq", u, 0.0), -INF, _op("where", _op("eq", u, INF), INF, math.nan))
    return _op("where", positive, core, special)


def safe_sqrt(v) -> ir.Op:
    """sqrt(v) = sqrt(v * 4**k) / 2**k; sqrt(+-0) = +-0, sqrt(inf) = inf, negatives and nan -> nan."""
    scaled, big, small = _scaled(v, 2.0**100, 2.0**-100, 2.0**-100, 2.0**100)
    factor = _op("where", big, 2.0**50, _op("where", small, 2.0**-50, 1.0))
    positive = _finite_positive(v)
    core = _op("mul", _op("sqrt_in_range", _op("where", positive, scaled, 1.0)), factor)
    special = _op("where", _op("eq", v, 0.0), v, _op("where", _op("eq", v, INF), INF, math.nan))
    return _op("where", positive, core, special)


def safe_rsqrt(v) -> ir.Op:
    """1/sqrt(v) = rsqrt(v * 4**k) * 2**k; rsqrt(+-0) = +-inf, rsqrt(inf) = 0, negatives and nan -> nan."""
    scaled, big, small = _scaled(v, 2.0**96, 2.0**-86, 2.0**-100, 2.0**100)
    factor = _op("where", big, 2.0**-50, _op("where", small, 2.0**50, 1.0))
    positive = _finite_positive(v)
    core = _op("mul", _op("rsqrt_in_range", _op("where", positive, scaled, 1.0)), factor)
    zero = _op("copysign", INF, v)
    special = _op("where", _op("eq", v, 0.0), zero, _op("where", _op("eq", v, INF), 0.0, math.nan))
    return _op("where", positive, core, special)


def safe_reciprocal(y) -> ir.Op:
    """1 / y: |y| >= 2**100 is first scaled by 2**-64; then y * 2**(127 - E) lies in [1, 2) (E the biased
    exponent; a subnormal lands in [2**-22, 1)), its reciprocal is in range, and the same power of two scales it
    back (overflow and underflow round as a single division would, to a subnormal ulp). 1/+-0 = +-inf,
    1/+-inf = +-0, nan -> nan."""
    magnitude = _op("abs", y)
    huge = _op("ge", magnitude, 2.0**100)
    reduced = _op("where", huge, _op("mul", magnitude, 2.0**-64), magnitude)
    power = _op("inverse_power_of_two", reduced)
    ordinary = _op("mul", _op("gt", magnitude, 0.0), _op("lt", magnitude, INF))
    inverse = _op("reciprocal_in_range", _op("where", ordinary, _op("mul", reduced, power), 1.0))
    core = _op("mul", _op("mul", inverse, power), _op("where", huge, 2.0**-64, 1.0))
    special = _op("where", _op("eq", magnitude, 0.0), INF, _op("where", _op("eq", magnitude, INF), 0.0, math.nan))
    return _op("copysign", _op("where", ordinary, core, special), y)


EXPANSIONS = {"log": safe_log, "sqrt": safe_sqrt, "rsqrt": safe_rsqrt, "reciprocal": safe_reciprocal}


def guard_expression(expr: ir.Expr, memo: dict | None = None) -> ir.Expr:
    """``expr`` with every guarded function (and division by a non-number) in its exact guarded form."""
    memo = {} if memo is None else memo
    if not isinstance(expr, ir.Op):
        return expr
    if expr in memo:
        return memo[expr]
    args = tuple(guard_expression(arg, memo) for arg in expr.args)
    if expr.op in EXPANSIONS:
        result = EXPANSIONS[expr.op](*args)
    elif expr.op == "div" and not isinstance(args[1], ir.Scalar):
        result = _op("mul", args[0], safe_reciprocal(args[1]))
    else:
        result = expr if args == expr.args else dataclasses.replace(expr, args=args)
    memo[expr] = result
    return result


def guard_node(node: ir.Node, memo: dict | None = None) -> ir.Node:
    """``node`` with every expression guarded (its kernel kind knows where its expressions are)."""
    memo = {} if memo is None else memo
    return kinds.map_exprs(node, lambda expr: guard_expression(expr, memo))


def guard_activation_ranges(nodes: list[ir.Node]) -> list[ir.Node]:
    """The pass: every node with its range-limited functions guarded (one memo: shared subexpressions once)."""
    memo: dict = {}
    return [guard_node(node, memo) for node in nodes]
