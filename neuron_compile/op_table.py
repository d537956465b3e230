"""The expression op table: every op an ``ir.Op`` may name, and what each one is on the hardware.

Input: nothing (definitions). Output: ``OPS``, name -> ``OpSpec``. ``ir.Op`` refuses a name that is not here;
codegen (codegen/expressions.py) renders an op from its ``form`` and NKI operator; the guarded forms
(guarded_math.py, used by the range-guard pass) read the valid input ranges and the ``*_in_range`` forms; the cost
model and value ranges can read the cost class and the integer exactness. This module imports neither the IR nor
codegen.

Per op:

* ``arity``: how many operands (``cast`` also carries a dtype).
* ``form``: how codegen renders it. ``binary``: ``tensor_tensor`` on two tiles, ``tensor_scalar`` when one operand
  is a number or a (P, 1) row vector (``number_first`` gives the stages for ``op(number, tile)``); ``tensor_scalar``:
  fixed ``stages`` on one tile; ``activation``: ``nisa.activation(op=nl_op)``; ``copy``: ``tensor_copy`` into a tile
  of the op's dtype; ``sequence``: several instructions, written by a named emitter in codegen.
* ``instructions``: the ``nisa`` instructions it renders to.
* ``valid_range``: the inputs on which the instruction it renders to is valid (nki-spec §1.5: the Scalar engine's
  functions are piecewise approximations); None: every input. ``in_range_form``: for a range-limited function,
  the op naming the bare instruction, which the range-guard pass feeds only inputs inside ``valid_range``.
* ``integer_exact``: with integer operands and an integer result within +-FP32_EXACT_INTEGER, the fp32 engines
  give the exact result (value ranges decide when integer math may run in a kernel).
* ``cost``: ``vector`` (one Vector-engine instruction per tile), ``scalar`` (one Scalar-engine activation per
  tile) or ``sequence`` (several instructions, on the Vector and GpSimd engines; see ``instructions``).
* ``fold``: how two numbers combine when every operand is a number (constant folding), or None.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable

FORMS = ("binary", "tensor_scalar", "activation", "copy", "sequence")
COST_CLASSES = ("vector", "scalar", "sequence")


class OpTableError(ValueError):
    """An expression op the table does not list, or one given the wrong number of operands (the message names it)."""


@dataclasses.dataclass(frozen=True)
class InputRange:
    """``low <= x <= high`` (``magnitude``: ``low <= |x| <= high``, either sign); nan is outside every range."""

    low: float
    high: float
    magnitude: bool = False
    text: str = ""  # as nki-spec §1.5 writes it

    def contains(self, x: float) -> bool:
        value = abs(x) if self.magnitude else x
        return self.low <= value <= self.high

    def contains_interval(self, low: float, high: float) -> bool:
        """Whether every x in [low, high] is inside (for a magnitude range, [low, high] of one sign)."""
        return self.contains(low) and self.contains(high)

    def __str__(self) -> str:
        return self.text or f"[{self.low}, {self.high}]"


# nki-spec §1.5: the ranges of the range-limited activation functions; the others take every input.
LOG_RANGE = InputRange(2.0**-64, 2.0**64, text="[2**-64, 2**64]")
SQRT_RANGE = InputRange(2.0**-116, 2.0**118, text="[2**-116, 2**118]")
RSQRT_RANGE = InputRange(2.0**-87, 2.0**97, text="[2**-87, 2**97]")
RECIPROCAL_RANGE = InputRange(2.0**-42, 2.0**42, magnitude=True, text="+-[2**-42, 2**42]")
SIN_RANGE = InputRange(-math.pi, math.pi, text="[-pi, pi]")
ARCTAN_RANGE = InputRange(-math.pi / 2, math.pi / 2, text="[-pi/2, pi/2]")

# A tensor_scalar stage: (nl operator, fixed operand); operand None stands for the op's number (or row vector).
Stage = tuple[str, "float | None"]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    arity: int
    form: str
    instructions: tuple[str, ...]
    nl_op: str | None = None
    number_first: tuple[Stage, ...] = ()  # binary: op(number, tile) as tensor_scalar stages on the tile
    stages: tuple[Stage, ...] = ()  # tensor_scalar: the stages on its one tile
    valid_range: InputRange | None = None
    in_range_form: str | None = None
    integer_exact: bool = False
    cost: str = "vector"
    fold: Callable | None = None


def _binary(name, nl_op, number_first, fold=None, exact=True) -> OpSpec:
    return OpSpec(name, 2, "binary", ("tensor_tensor", "tensor_scalar"), nl_op, number_first=number_first,
                  integer_exact=exact, fold=fold)


def _mirrored(name, nl_op, mirror_nl_op=None, fold=None) -> OpSpec:
    """A binary op with op(number, tile) == mirror(tile, number) (itself when commutative)."""
    return _binary(name, nl_op, ((mirror_nl_op or nl_op, None),), fold)


def _activation(name, nl_op, valid_range=None, in_range_form=None, exact=False) -> OpSpec:
    return OpSpec(name, 1, "activation", ("activation",), nl_op, valid_range=valid_range, in_range_form=in_range_form,
                  integer_exact=exact, cost="scalar")


def _sequence(name, arity, instructions, exact=False) -> OpSpec:
    return OpSpec(name, arity, "sequence", instructions, integer_exact=exact, cost="sequence")


# What a sequence may add to bring an operand to fp32 (a number memset, a row vector broadcast, a bf16 tile widened).
_WIDEN = ("memset", "tensor_scalar", "tensor_copy")

_SPECS = [
    _mirrored("add", "nl.add", fold=operator.add),
    _binary("sub", "nl.subtract", (("nl.multiply", -1.0), ("nl.add", None)), fold=operator.sub),  # -tile + number
    _mirrored("mul", "nl.multiply", fold=operator.mul),
    _mirrored("maximum", "nl.maximum", fold=max),
    _mirrored("minimum", "nl.minimum", fold=min),
    _mirrored("eq", "nl.equal"),
    _mirrored("ne", "nl.not_equal"),
    _mirrored("lt", "nl.less", "nl.greater"),
    _mirrored("le", "nl.less_equal", "nl.greater_equal"),
    _mirrored("gt", "nl.greater", "nl.less"),
    _mirrored("ge", "nl.greater_equal", "nl.less_equal"),
    OpSpec("neg", 1, "tensor_scalar", ("tensor_scalar",), stages=(("nl.multiply", -1.0),), integer_exact=True),
    OpSpec("cast", 1, "copy", ("tensor_copy", "memset"), integer_exact=True),
    _activation("exp", "nl.exp"),
    _activation("log", "nl.log", LOG_RANGE, "log_in_range"),
    _activation("sqrt", "nl.sqrt", SQRT_RANGE, "sqrt_in_range"),
    _activation("rsqrt", "nl.rsqrt", RSQRT_RANGE, "rsqrt_in_range"),
    _activation("reciprocal", "nl.reciprocal", RECIPROCAL_RANGE, "reciprocal_in_range"),
    # the bare instructions, for arguments already inside their valid ranges (guarded_math.py)
    _activation("log_in_range", "nl.log", LOG_RANGE),
    _activation("sqrt_in_range", "nl.sqrt", SQRT_RANGE),
    _activation("rsqrt_in_range", "nl.rsqrt", RSQRT_RANGE),
    _activation("reciprocal_in_range", "nl.reciprocal", RECIPROCAL_RANGE),
    _activation("sin", "nl.sin", SIN_RANGE),  # lowering/trigonometry.py reduces the argument
    _activation("arctan", "nl.arctan", ARCTAN_RANGE),  # lowering/pointwise_math.py reduces it to [-1, 1]
    _activation("tanh", "nl.tanh"),
    _activation("sigmoid", "nl.sigmoid"),
    _activation("relu", "nl.relu", exact=True),
    _activation("abs", "nl.abs", exact=True),
    _activation("silu", "nl.silu"),
    _activation("erf", "nl.erf"),
    _activation("gelu", "nl.gelu"),
    _activation("gelu_tanh", "nl.gelu_apprx_tanh"),
    _activation("gelu_dx", "nl.gelu_dx"),
    _activation("silu_dx", "nl.silu_dx"),
    _activation("softplus", "nl.softplus"),
    _activation("mish", "nl.mish"),
    # x / y: a multiply by a number's inverse, else reciprocal(y) times x (the range-guard pass rewrites a division
    # by a tensor into a guarded reciprocal first)
    _sequence("div", 2, ("tensor_scalar", "activation", "tensor_tensor")),
    # x ** number: multiply, copy or the ALU power; elementwise exponents: tensor_tensor power (GpSimd) on fp32
    # copies of the operands
    _sequence("pow", 2, ("tensor_tensor", "tensor_copy", *_WIDEN)),
    # exact selects and sign transfers on the fp32 bit patterns (int32 views)
    _sequence("where", 3, ("tensor_copy_predicated", *_WIDEN), exact=True),
    _sequence("copysign", 2, ("tensor_tensor", *_WIDEN), exact=True),
    # 2**(127 - E) for x's biased exponent E: the exact rescaling that keeps a reciprocal's input in range
    _sequence("inverse_power_of_two", 1, _WIDEN),
    # 1 / x by the ALU's reciprocal (nisa.reciprocal on VectorE, or tensor_scalar op0=nl.reciprocal on GpSimd): an
    # ALU operator, not a piecewise activation, documented without a valid range and at a higher precision than
    # ScalarE's, at 8x its cycles; fp32 over every input, IEEE special values (1 / +-0 = +-inf, 1 / +-inf = +-0)
    _sequence("reciprocal_alu", 1, ("reciprocal", "tensor_scalar", *_WIDEN)),
    # 1 / sqrt(x) by GpSimd's ALU rsqrt (tensor_scalar op0=nl.rsqrt): no valid range either, at a higher precision
    # than ScalarE's and 4x its cycles; rsqrt(+-0) = +-inf, rsqrt(inf) = 0, negatives and nan -> nan
    _sequence("rsqrt_alu", 1, ("tensor_scalar", *_WIDEN)),
    # sqrt(x) as x * rsqrt(x) on the ALU: GpSimd's rsqrt of min(x, fp32's largest), then one scalar_tensor_tensor
    # multiplying x by min(|rsqrt|, 2**100); no valid range, every special value IEEE's (guarded_math.safe_sqrt)
    _sequence("sqrt_alu", 1, ("tensor_scalar", "scalar_tensor_tensor", *_WIDEN)),
]

OPS: dict[str, OpSpec] = {spec.name: spec for spec in _SPECS}


def spec(name: str) -> OpSpec:
    """The table entry of ``name``; an unknown name raises ``OpTableError`` naming it."""
    try:
        return OPS[name]
    except KeyError:
        raise OpTableError(f"unknown expression op {name!r}: not in neuron_compile.op_table.OPS") from None


def check(name: str, arity: int) -> None:
    """Raise ``OpTableError`` unless ``name`` is a table op taking ``arity`` operands."""
    entry = OPS.get(name)
    if entry is None:
        spec(name)
    elif entry.arity != arity:
        raise OpTableError(f"expression op {name!r} takes {entry.arity} operands, got {arity}")


def range_limited() -> dict[str, OpSpec]:
    """The range-limited functions the range-guard pass rewrites (each has an ``in_range_form``)."""
    return {name: entry for name, entry in OPS.items() if entry.in_range_form is not None}
