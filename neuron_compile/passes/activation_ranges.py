"""Pass (lowering -> fusion): keep every range-limited Scalar-engine function inside its valid input range.

Input: IR nodes from the lowering stage. Output: the same nodes in which every ``log``, ``sqrt``, ``rsqrt`` and
``reciprocal`` Op, and every division by a tensor, is an exact guarded expression: finite nonzero inputs are
brought into the instruction's valid range by power-of-two scalings (exact multiplies, undone on the result),
the special inputs (0, -0.0, inf, negatives, nan) select their IEEE results, and the bare instruction — the
``*_in_range`` op, which the codegen emits as the plain activation — only ever sees valid inputs.

Why: the hardware's activation functions are piecewise approximations valid on documented ranges only
(nki-spec §1.5); outside them the device returns invalid results where numpy would be right. The ranges, and
which functions are range-limited, are the op table's (neuron_compile/op_table.py: ``valid_range`` and
``in_range_form``); the guarded forms themselves are neuron_compile/guarded_math.py's, which proves at import
that every value reaching a bare instruction lies inside its range. The simulator refuses out-of-range inputs, so
a kernel that passes here cannot silently fail on the device. Lowerings that already guard their arguments
(pointwise_math's log1p, asin) build the ``*_in_range`` ops themselves; templates whose arguments are in range
by construction (softmax's row sum is in [1, row length], or nan) call the instruction.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir, kinds
from neuron_compile.guarded_math import EXPANSIONS, safe_reciprocal

_op = ir.op


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
