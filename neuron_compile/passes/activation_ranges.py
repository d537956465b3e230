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
from neuron_compile.expression_floors import Floors
from neuron_compile.guarded_math import EXPANSIONS, FLOORED, safe_reciprocal

_op = ir.op


def guard_expression(expr: ir.Expr, memo: dict | None = None, floors: Floors | None = None) -> ir.Expr:
    """``expr`` with every guarded function (and division by a non-number) in its exact guarded form; ``floors``
    (lower bounds of its subexpressions) lets sqrt of a value bounded away from zero skip the guards for
    tiny, zero and negative inputs."""
    memo = {} if memo is None else memo
    if not isinstance(expr, ir.Op):
        return expr
    if expr in memo:
        return memo[expr]
    args = tuple(guard_expression(arg, memo, floors) for arg in expr.args)
    if expr.op in FLOORED and floors is not None:
        result = EXPANSIONS[expr.op](*args, floor=floors.of(expr.args[0]))
    elif expr.op in EXPANSIONS:
        result = EXPANSIONS[expr.op](*args)
    elif expr.op == "div" and not isinstance(args[1], ir.Scalar):
        result = _op("mul", args[0], safe_reciprocal(args[1]))
    else:
        result = expr if args == expr.args else dataclasses.replace(expr, args=args)
    memo[expr] = result
    return result


def guard_node(node: ir.Node, buffer_floors: dict[str, float] | None = None) -> ir.Node:
    """``node`` with every expression guarded (its kernel kind knows where its expressions are). The floors of
    the buffers written before it (``buffer_floors``) and of its own results bound what sqrt sees; the
    floors of the buffers it writes are added to ``buffer_floors``."""
    buffer_floors = {} if buffer_floors is None else buffer_floors
    kind = kinds.kind_of(node)
    results = kind.result_floors(node, Floors(buffers=buffer_floors).of)
    floors = Floors(results, buffer_floors)
    memo: dict = {}  # one per node: ir.Result() means a different value in each
    guarded = kind.map_exprs(node, lambda expr: guard_expression(expr, memo, floors))
    for store in kind.stores(node):
        floor = floors.of(store.expr)
        if floor is not None:
            buffer_floors[store.buffer.name] = floor
    return guarded


def guard_activation_ranges(nodes: list[ir.Node]) -> list[ir.Node]:
    """The pass: every node with its range-limited functions guarded, in graph order (a buffer's floor is known
    before its readers are guarded)."""
    buffer_floors: dict[str, float] = {}
    return [guard_node(node, buffer_floors) for node in nodes]
