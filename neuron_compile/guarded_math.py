"""IR expression builders shared by lowering and the range-guard pass: exact guarded forms of the range-limited
Scalar-engine functions (log, sqrt), and the reciprocal, rsqrt and sqrt as ALU operators (VectorE's reciprocal,
GpSimd's rsqrt, sqrt as v * rsqrt(v)), which have no range.

Input: an IR expression ``x``. Output: an IR expression equal to ``f(x)`` for every fp32 ``x`` in which the bare
instruction (the op table's ``*_in_range`` op) only ever sees values inside its valid range: finite nonzero inputs
are brought into range by power-of-two scalings (exact multiplies, undone on the result) and the special inputs
(0, -0.0, inf, negatives, nan) select their IEEE results.

Why a module of its own: lowerings that build these forms directly (log1p, the special functions) and the
range-guard pass (passes/activation_ranges.py) both need them; ``check_scalings`` proves at import that every
value reaching a bare instruction lies inside the op table's range for it.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir, op_table

INF = math.inf
FP32_MAX = 2.0**128  # above every finite fp32 (the largest is just below it)
FP32_SMALLEST = 2.0**-149  # the smallest positive (subnormal) fp32

# The range-limited functions (log, sqrt, rsqrt, reciprocal), each with the op of its bare instruction.
RANGE_LIMITED = op_table.range_limited()
GUARDED = tuple(RANGE_LIMITED)


class RangeGuardError(RuntimeError):
    """A guarded expansion would feed its bare instruction a value outside the op table's valid range."""


@dataclasses.dataclass(frozen=True)
class Scaling:
    """Finite positive x above ``big`` is multiplied by ``big_scale``, below ``small`` by ``small_scale`` (exact
    powers of two, undone on the result); the rest goes to the instruction as it is."""

    big: float
    small: float
    big_scale: float
    small_scale: float

    def reaching(self) -> list[tuple[float, float]]:
        """The intervals of values the instruction sees (plus 1.0, which stands in for the special inputs)."""
        return [(self.small, self.big), (self.big * self.big_scale, FP32_MAX * self.big_scale),
                (FP32_SMALLEST * self.small_scale, self.small * self.small_scale), (1.0, 1.0)]


SCALINGS = {
    "log": Scaling(2.0**63, 2.0**-63, 2.0**-64, 2.0**100),  # 2**-149 * 2**100 = 2**-49
    "sqrt": Scaling(2.0**100, 2.0**-100, 2.0**-100, 2.0**100),  # even powers: sqrt halves them exactly
}
# reciprocal and rsqrt: their expansions are ALU operators, which have no valid range: ScalarE's bare instructions
# see nothing
UNRANGED_REACHING: dict[str, list[tuple[float, float]]] = {"reciprocal": [], "rsqrt": []}


def _in_range(name: str) -> str:
    """The op of ``name``'s bare instruction (``log_in_range`` for ``log``)."""
    return RANGE_LIMITED[name].in_range_form


_op = ir.op


def check_scalings() -> None:
    """Every value each guarded expansion feeds its bare instruction lies inside the op table's valid range of that
    instruction; raise ``RangeGuardError`` naming the function, the range and the values otherwise."""
    reaching = {name: scaling.reaching() for name, scaling in SCALINGS.items()} | UNRANGED_REACHING
    if set(reaching) != set(RANGE_LIMITED):
        raise RangeGuardError(f"range-limited functions {sorted(RANGE_LIMITED)}, expansions for {sorted(reaching)}")
    for name, intervals in reaching.items():
        valid = op_table.spec(_in_range(name)).valid_range
        for low, high in intervals:
            if valid is not None and not valid.contains_interval(low, high):
                raise RangeGuardError(f"{name}: [{low}, {high}] reaches {_in_range(name)}, valid on {valid} only")


def _finite_positive(x) -> ir.Op:
    return _op("mul", _op("gt", x, 0.0), _op("lt", x, INF))  # false for nan


def _scaled(x, scaling: Scaling):
    """(x scaled into range, a 0/1 ``big`` flag, a 0/1 ``small`` flag) by exact powers of two."""
    big, small = _op("gt", x, scaling.big), _op("lt", x, scaling.small)
    scaled = _op("where", big, _op("mul", x, scaling.big_scale),
                 _op("where", small, _op("mul", x, scaling.small_scale), x))
    return scaled, big, small


def safe_log(u) -> ir.Op:
    """log(u): large u scaled by 2**-64, small positive ones by 2**100 (2**-149 * 2**100 = 2**-49), the exponent
    added back as a multiple of ln 2; 0 -> -inf, inf -> inf, negatives and nan -> nan."""
    scaled, big, small = _scaled(u, SCALINGS["log"])
    offset = _op("where", big, 64 * math.log(2.0), _op("where", small, -100 * math.log(2.0), 0.0))
    positive = _finite_positive(u)
    core = _op("add", _op(_in_range("log"), _op("where", positive, scaled, 1.0)), offset)
    special = _op("where", _op("eq", u, 0.0), -INF, _op("where", _op("eq", u, INF), INF, math.nan))
    return _op("where", positive, core, special)


def _floored_sqrt(v, floor: float | None) -> ir.Op | None:
    """sqrt(v) for v whose every value but nan is at least ``floor``, when the floor is above the scaling's
    ``small``: only large values are scaled (by 2**-100, undone by 2**50), the tiny, zero and negative cases cannot
    occur; inf and nan are v itself (sqrt gives them back). None for a lower or no floor."""
    scaling = SCALINGS["sqrt"]
    if floor is None or floor < scaling.small:
        return None
    big, ordinary = _op("gt", v, scaling.big), _op("lt", v, INF)  # lt is false for nan
    scaled = _op("where", big, _op("mul", v, scaling.big_scale), v)
    core = _op("mul", _op(_in_range("sqrt"), _op("where", ordinary, scaled, 1.0)), _op("where", big, 2.0**50, 1.0))
    return _op("where", ordinary, core, v)


def safe_sqrt(v, floor: float | None = None) -> ir.Op:
    """sqrt(v); sqrt(+-0) = +-0, sqrt(inf) = inf, negatives and nan -> nan. With a ``floor`` above 2**-100:
    ScalarE's sqrt with only large values scaled (sqrt(v * 4**-k) * 2**k); without: v * rsqrt(v) on the ALU
    (``alu_sqrt``)."""
    floored = _floored_sqrt(v, floor)
    if floored is not None:
        return floored
    return alu_sqrt(v)


def alu_sqrt(v) -> ir.Op:
    """sqrt(v) for every fp32 v as ``v * min(|rsqrt(min(v, fp32 max))|, 2**100)``: GpSimd's ALU rsqrt (4 cycles
    per element) and one multiply, where 1 / rsqrt(v) took a second, 8-cycle ALU reciprocal. The clamps make the
    special values come out as torch's: v = +-0 gives rsqrt = +-inf, clamped to 2**100, so +-0 * 2**100 = +-0;
    v = inf reads rsqrt(fp32 max) = 2**-64, so inf * 2**-64 = inf; negatives, -inf and nan give a nan rsqrt, which
    the clamps and the product keep (the ALU's minimum propagates nan, as the clamp lowerings rely on). Finite
    positive v never meet the clamps: rsqrt(v) lies in [2**-64, 2**74.5]. Three roundings (the sqrt inside
    rsqrt, its reciprocal, the product), as many as 1 / rsqrt(v) had."""
    return _op("sqrt_alu", v)


def safe_rsqrt(v) -> ir.Op:
    """1/sqrt(v); rsqrt(+-0) = +-inf, rsqrt(inf) = 0, negatives and nan -> nan: GpSimd's ALU rsqrt, one instruction
    for every input. Also above a floor (RMSNorm's ``mean(x * x) + eps`` >= eps): the floor rules out only the small
    inputs, while nothing bounds the mean from above (squares of values over 2**49 pass ScalarE's range, 2**97, or
    overflow to inf), so ScalarE's rsqrt would still need its large-value scaling and the inf case, about 20
    instructions where the ALU takes one."""
    return _op("rsqrt_alu", v)


def safe_reciprocal(y) -> ir.Op:
    """1 / y for every fp32 y: VectorE's reciprocal, an ALU operator with no valid-range limit (op_table's
    ``reciprocal_alu``): 1/+-0 = +-inf, 1/+-inf = +-0, nan -> nan, subnormal results rounded once. One
    instruction at 8 cycles per element, against about 30 for ScalarE's ranged reciprocal behind exact
    power-of-two rescalings and selects of the special values."""
    return _op("reciprocal_alu", y)


EXPANSIONS = {"log": safe_log, "sqrt": safe_sqrt, "rsqrt": safe_rsqrt, "reciprocal": safe_reciprocal}
FLOORED = {"sqrt"}  # the expansions that take a ``floor``
if set(EXPANSIONS) != set(RANGE_LIMITED):
    raise RangeGuardError(f"range-limited functions {sorted(RANGE_LIMITED)}, expansions for {sorted(EXPANSIONS)}")
check_scalings()
