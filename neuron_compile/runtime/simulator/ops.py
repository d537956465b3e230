"""Simulator stage: the ALU and activation operators (``nl.add``, ``nl.exp``, ...) as data.

Input: an operator object (or a legacy numpy ufunc such as ``np.add``). Output: its fp32 numpy implementation,
its kind (arithmetic, bitvec, unary) and its reduction ufunc. Plain data: ``language`` derives the callable
``nl.exp`` / ``nl.add`` objects from these (calling ``nl.exp(tile)`` runs the ``nl`` wrapper; passing
``op=nl.exp`` to an ISA instruction selects the operator), so this module imports nothing above it.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError

_SQRT2 = np.float32(np.sqrt(2.0))
_SQRT_2_OVER_PI = np.float32(np.sqrt(2.0 / np.pi))


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 is only good to 1.5e-7 absolute; this odd rational series (W. J. Cody style,
    # evaluated in float64) is accurate to fp32 rounding, which is what an fp32 engine result can be held to.
    x64 = x.astype(np.float64)
    sign = np.sign(x64)
    a = np.abs(x64)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    return (sign * (1.0 - t * np.exp(poly))).astype(np.float32)


def _sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / _SQRT2))


def _gelu_dx(x):
    pdf = np.exp(-0.5 * x * x) / np.float32(np.sqrt(2.0 * np.pi))
    return 0.5 * (1.0 + _erf(x / _SQRT2)) + x * pdf


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)))


def _softplus(x):
    return np.logaddexp(np.float32(0), x)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_sigmoid_dx(x):
    s = _sigmoid(np.float32(1.702) * x)
    return s + np.float32(1.702) * x * s * (1 - s)


# True while float errors are ignored already (float_errors_ignored): an operator then skips its own np.errstate,
# whose enter and exit cost more than the arithmetic of a small tile
_errors_ignored = contextvars.ContextVar("float_errors_ignored", default=False)


@contextlib.contextmanager
def float_errors_ignored():
    """Ignore numpy's float errors (nan and inf are values here, not errors) for a whole launch at once."""
    with np.errstate(all="ignore"):
        token = _errors_ignored.set(True)
        try:
            yield
        finally:
            _errors_ignored.reset(token)


def _nan_safe(fn):
    def run(*args):
        if _errors_ignored.get():
            return fn(*args)
        with np.errstate(all="ignore"):
            return fn(*args)

    return run


def _abs_max(a, b):
    return np.maximum(np.abs(a), np.abs(b))


def _abs_min(a, b):
    return np.minimum(np.abs(a), np.abs(b))


def _as_float(fn):
    return lambda a, b: fn(a, b).astype(np.float32)


def _shift_right(a, b):
    # logical shift (NKI has no arithmetic right shift): shift the unsigned bit pattern
    unsigned = a.astype(np.uint32) if a.dtype.kind == "i" else a
    return np.right_shift(unsigned, b.astype(unsigned.dtype) if hasattr(b, "astype") else b).astype(a.dtype)


class Op:
    """An NKI operator. ``kind``: "arith" (binary fp32), "bitvec" (binary, ints), "unary" (activation),
    "bypass" (a tensor-scalar stage that does nothing)."""

    __slots__ = ("name", "kind", "fn", "reduce_ufunc", "__weakref__")

    def __init__(self, name: str, kind: str, fn, reduce_ufunc=None):
        self.name = name
        self.kind = kind
        self.fn = _nan_safe(fn)
        self.reduce_ufunc = reduce_ufunc

    @property
    def __name__(self) -> str:  # the cost model reads op.__name__
        return self.name

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def derived(self, cls: type[Op]) -> Op:
        """This operator as an instance of the subclass ``cls`` (same name, kind, implementation, reduction)."""
        other = object.__new__(cls)
        other.name, other.kind, other.fn, other.reduce_ufunc = self.name, self.kind, self.fn, self.reduce_ufunc
        return other


BINARY = {
    "add": Op("add", "arith", np.add, np.add),
    "subtract": Op("subtract", "arith", np.subtract, np.subtract),
    "multiply": Op("multiply", "arith", np.multiply, np.multiply),
    "divide": Op("divide", "arith", np.divide),
    "maximum": Op("maximum", "arith", np.maximum, np.maximum),
    "minimum": Op("minimum", "arith", np.minimum, np.minimum),
    "abs_max": Op("abs_max", "arith", _abs_max),
    "abs_min": Op("abs_min", "arith", _abs_min),
    "power": Op("power", "arith", np.power),
    "equal": Op("equal", "arith", _as_float(np.equal)),
    "not_equal": Op("not_equal", "arith", _as_float(np.not_equal)),
    "less": Op("less", "arith", _as_float(np.less)),
    "less_equal": Op("less_equal", "arith", _as_float(np.less_equal)),
    "greater": Op("greater", "arith", _as_float(np.greater)),
    "greater_equal": Op("greater_equal", "arith", _as_float(np.greater_equal)),
    "logical_and": Op("logical_and", "arith", _as_float(np.logical_and), np.logical_and),
    "logical_or": Op("logical_or", "arith", _as_float(np.logical_or), np.logical_or),
    "logical_xor": Op("logical_xor", "arith", _as_float(np.logical_xor), np.logical_xor),
    "bitwise_and": Op("bitwise_and", "bitvec", np.bitwise_and, np.bitwise_and),
    "bitwise_or": Op("bitwise_or", "bitvec", np.bitwise_or, np.bitwise_or),
    "bitwise_xor": Op("bitwise_xor", "bitvec", np.bitwise_xor, np.bitwise_xor),
    "left_shift": Op("left_shift", "bitvec", np.left_shift),
    "right_shift": Op("right_shift", "bitvec", _shift_right),
    # "no operation" in a tensor-scalar stage (tensor_scalar's op1, activate2's op0/op1): the data passes through
    "bypass": Op("bypass", "bypass", lambda data, operand: data),
}

UNARY = {
    "copy": Op("copy", "unary", lambda x: x),
    "exp": Op("exp", "unary", np.exp),
    "log": Op("log", "unary", np.log),
    "sqrt": Op("sqrt", "unary", np.sqrt),
    "rsqrt": Op("rsqrt", "unary", lambda x: 1 / np.sqrt(x)),
    "reciprocal": Op("reciprocal", "unary", lambda x: 1 / x),
    "tanh": Op("tanh", "unary", np.tanh),
    "sigmoid": Op("sigmoid", "unary", _sigmoid),
    "relu": Op("relu", "unary", lambda x: np.maximum(x, np.float32(0))),
    "prelu": Op("prelu", "unary", lambda x: np.maximum(x, np.float32(0))),  # slope 0 unless activate2's relu_param
    "gelu": Op("gelu", "unary", _gelu),
    "gelu_dx": Op("gelu_dx", "unary", _gelu_dx),
    "gelu_apprx_tanh": Op("gelu_apprx_tanh", "unary", _gelu_tanh),
    "gelu_apprx_sigmoid": Op("gelu_apprx_sigmoid", "unary", lambda x: x * _sigmoid(np.float32(1.702) * x)),
    "gelu_apprx_sigmoid_dx": Op("gelu_apprx_sigmoid_dx", "unary", _gelu_sigmoid_dx),
    "silu": Op("silu", "unary", lambda x: x * _sigmoid(x)),
    "silu_dx": Op("silu_dx", "unary", _silu_dx),
    "softplus": Op("softplus", "unary", _softplus),
    "mish": Op("mish", "unary", lambda x: x * np.tanh(_softplus(x))),
    "erf": Op("erf", "unary", _erf),
    "erf_dx": Op("erf_dx", "unary", lambda x: np.float32(2 / np.sqrt(np.pi)) * np.exp(-x * x)),
    "sin": Op("sin", "unary", np.sin),
    "cos": Op("cos", "unary", np.cos),
    "tan": Op("tan", "unary", np.tan),
    "arctan": Op("arctan", "unary", np.arctan),
    "ceil": Op("ceil", "unary", np.ceil),
    "floor": Op("floor", "unary", np.floor),
    "trunc": Op("trunc", "unary", np.trunc),
    "negative": Op("negative", "unary", np.negative),
    "sign": Op("sign", "unary", np.sign),
    "abs": Op("abs", "unary", np.abs),
    "square": Op("square", "unary", np.square),
    "invert": Op("invert", "bitvec_unary", np.invert),
    "logical_not": Op("logical_not", "unary", lambda x: np.logical_not(x).astype(np.float32)),
}
UNARY["identity"] = UNARY["copy"]

ALL_OPS = {**BINARY, **UNARY}

_UFUNC_NAMES = {  # legacy kernels pass numpy ufuncs
    np.add: "add", np.subtract: "subtract", np.multiply: "multiply", np.divide: "divide", np.maximum: "maximum",
    np.minimum: "minimum", np.power: "power", np.equal: "equal", np.not_equal: "not_equal", np.less: "less",
    np.less_equal: "less_equal", np.greater: "greater", np.greater_equal: "greater_equal",
    np.bitwise_and: "bitwise_and", np.bitwise_or: "bitwise_or", np.bitwise_xor: "bitwise_xor",
    np.left_shift: "left_shift", np.right_shift: "right_shift", np.logical_and: "logical_and",
    np.logical_or: "logical_or", np.logical_xor: "logical_xor", np.exp: "exp", np.log: "log", np.sqrt: "sqrt",
    np.tanh: "tanh", np.abs: "abs", np.square: "square", np.negative: "negative", np.sign: "sign",
    np.sin: "sin", np.cos: "cos", np.reciprocal: "reciprocal",
}


# nl.max / nl.min (the reductions) stand for the maximum / minimum operators where an instruction takes an op
REDUCTION_ALIASES = {"max": "maximum", "min": "minimum"}


def resolve(op, instruction: str, role: str = "op") -> Op:
    """The Op for ``op`` (an Op, a numpy ufunc or an op name)."""
    if isinstance(op, Op):
        return op
    name = _UFUNC_NAMES.get(op) if not isinstance(op, str) else op
    if name is None and callable(op):
        name = getattr(op, "__name__", None)
    name = REDUCTION_ALIASES.get(name, name)
    if name in ALL_OPS:
        return ALL_OPS[name]
    raise NkiValidationError("err_unsupported_op", f"{role}={op!r} is not an NKI ALU/activation operator", instruction)
