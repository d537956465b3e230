"""Analysis used by the range-guard pass: lower bounds on the values an IR expression takes.

Input: an IR expression, the floors of the ``ir.Result`` values it reads (from its node's kernel kind) and of the
buffers it loads (from the nodes that wrote them). Output: ``floor(expr)``, a float that every value of ``expr``
other than nan is at least, or None when nothing is known.

Why: the guarded form of sqrt (guarded_math.py) spends most of its instructions on inputs that are zero, negative
or tiny. ``sqrt(mean(x * x) + eps)`` (a root mean square) has a floor of eps: it needs only the large-input scaling.
(rsqrt, RMSNorm's, is GpSimd's ALU rsqrt with or without a floor: one instruction.)

Soundness: a floor only ever moves down. fp32 rounding of a sum or a product of non-negative values can lower it
by half an ulp, a bf16 cast by half a bf16 ulp: positive floors are shrunk by more than that.
"""

from __future__ import annotations

import math

from neuron_compile import ir

# shrink a positive floor computed in double precision below any fp32 (bf16) rounding of the same value
FP32_SLACK = 1.0 - 2.0**-20
BF16_SLACK = 1.0 - 2.0**-7
NON_NEGATIVE_OPS = {"abs", "exp", "sqrt", "sigmoid"}


class Floors:
    """Floors of the expressions of one node: ``results[i]`` is the floor of ``ir.Result(i)`` (None: unknown),
    ``buffers`` the floors of the buffers written so far, by name."""

    def __init__(self, results: tuple[float | None, ...] = (), buffers: dict[str, float] | None = None):
        self.results, self.buffers = results, {} if buffers is None else buffers
        self.memo: dict[ir.Expr, float | None] = {}

    def of(self, expr: ir.Expr) -> float | None:
        if expr not in self.memo:
            self.memo[expr] = self._compute(expr)
        return self.memo[expr]

    def _compute(self, expr: ir.Expr) -> float | None:
        if isinstance(expr, ir.Scalar):
            value = float(expr.value)
            return None if math.isnan(value) else value
        if isinstance(expr, ir.Result):
            return self.results[expr.operand] if expr.operand < len(self.results) else None
        if isinstance(expr, ir.Load):
            return self.buffers.get(expr.buffer)
        if not isinstance(expr, ir.Op):
            return None
        return self._op_floor(expr)

    def _op_floor(self, expr: ir.Op) -> float | None:
        op, args = expr.op, expr.args
        if ir.is_square(expr) or op in NON_NEGATIVE_OPS:
            return 0.0
        floors = [self.of(arg) for arg in args]
        if op == "cast":
            return _cast_floor(floors[0], expr.dtype)
        if op == "add" and None not in floors:
            return _shrunk(floors[0] + floors[1], FP32_SLACK)
        if op == "mul" and None not in floors and min(floors) >= 0:
            return _shrunk(floors[0] * floors[1], FP32_SLACK)
        if op == "maximum" and any(f is not None for f in floors):
            return max(f for f in floors if f is not None)
        if op == "where" and None not in floors[1:]:
            return min(floors[1:])
        return None


def _shrunk(floor: float | None, slack: float) -> float | None:
    """``floor`` lowered past a rounding (a positive floor by the relative ``slack``; zero and below stay)."""
    if floor is None or floor <= 0:
        return floor
    return floor * slack


def _cast_floor(floor: float | None, dtype: str) -> float | None:
    if floor is None or dtype == "float32":
        return floor
    if dtype in ("bfloat16", "float16"):
        return _shrunk(floor, BF16_SLACK)
    return 0.0 if dtype == "bool" else float(math.floor(floor))  # integers truncate toward zero: at least floor()
