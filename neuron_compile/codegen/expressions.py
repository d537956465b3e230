"""Codegen stage helper: IR expression trees -> NKI instruction lines on SBUF tiles.

Input: an ``ir.Expr`` and a ``TileScope`` (which tile slice the kernel is working on and how each operand is
loaded). Output: lines of NKI source (``nisa.*`` calls, dst first), plus the tile allocations they need.
Every value is computed in an fp32 tile (the engines compute in fp32 anyway); ``cast`` rounds into a tile of
its dtype; a store stages through a tile of the buffer's dtype when they differ. Equal subexpressions are
computed once per scope.
"""

from __future__ import annotations

import dataclasses
import math
import struct

from neuron_compile import ir

NL_DTYPES = {"float32": "nl.float32", "bfloat16": "nl.bfloat16", "bool": "nl.uint8", "int32": "nl.int32"}

TENSOR_TENSOR_OPS = {
    "add": "nl.add",
    "sub": "nl.subtract",
    "mul": "nl.multiply",
    "maximum": "nl.maximum",
    "minimum": "nl.minimum",
    "eq": "nl.equal",
    "ne": "nl.not_equal",
    "lt": "nl.less",
    "le": "nl.less_equal",
    "gt": "nl.greater",
    "ge": "nl.greater_equal",
}
# op(scalar, tile) == MIRRORED[op](tile, scalar)
MIRRORED = {"add": "add", "mul": "mul", "maximum": "maximum", "minimum": "minimum", "eq": "eq", "ne": "ne",
            "lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
ACTIVATIONS = {
    "exp": "nl.exp",
    "log": "nl.log",
    "sqrt": "nl.sqrt",
    "rsqrt": "nl.rsqrt",
    "tanh": "nl.tanh",
    "sigmoid": "nl.sigmoid",
    "relu": "nl.relu",
    "abs": "nl.abs",
    "silu": "nl.silu",
    "erf": "nl.erf",
    "gelu": "nl.gelu",
    "gelu_tanh": "nl.gelu_apprx_tanh",
    "reciprocal": "nl.reciprocal",
    "gelu_dx": "nl.gelu_dx",
    "silu_dx": "nl.silu_dx",
    "softplus": "nl.softplus",
    "mish": "nl.mish",
    "arctan": "nl.arctan",  # valid on [-pi/2, pi/2] only: lowering/pointwise_math.py reduces to [-1, 1]
    # the bare instructions, for arguments already inside their valid ranges (passes/activation_ranges.py)
    "log_in_range": "nl.log",
    "sqrt_in_range": "nl.sqrt",
    "rsqrt_in_range": "nl.rsqrt",
    "reciprocal_in_range": "nl.reciprocal",
    "sin": "nl.sin",  # valid on [-pi, pi] only: lowering/trigonometry.py reduces the argument
}
SCALAR_FOLDS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "maximum": max,
    "minimum": min,
}


def number(value: float) -> str:
    """A float literal that is valid Python source (nan and inf have no literal)."""
    return f"float('{value}')" if math.isnan(value) or math.isinf(value) else repr(float(value))


class ExpressionError(RuntimeError):
    """An expression the codegen cannot emit (the message names the op)."""


@dataclasses.dataclass
class TileAllocator:
    """Kernel-level SBUF tile declarations, each allocated once at the top of the kernel."""

    partitions: int
    lines: list[str] = dataclasses.field(default_factory=list)
    count: int = 0

    def new_psum(self, stem: str, free: int) -> str:
        """A one-partition fp32 PSUM row (cross-partition results land there)."""
        self.count += 1
        name = f"{stem}_{self.count}"
        self.lines.append(f"{name} = nl.ndarray((1, {free}), dtype=nl.float32, buffer=nl.psum)")
        return name

    def new(self, stem: str, free: int, dtype: str = "float32") -> str:
        self.count += 1
        name = f"{stem}_{self.count}"
        self.lines.append(f"{name} = nl.ndarray(({self.partitions}, {free}), dtype={NL_DTYPES[dtype]}, buffer=nl.sbuf)")
        return name


@dataclasses.dataclass(frozen=True)
class Ref:
    """An operand during emission: a tile (name, dtype) or a Python float."""

    tile: str | None = None
    dtype: str = "float32"
    value: float | None = None
    vector: bool = False  # a (P, 1) per-row value (a reduction result) rather than a full tile


class TileScope:
    """One tile-shaped working set: ``slice_text`` like ``[0:rows, 0:cols]`` over tiles of ``free`` elements.

    ``load_source(load)`` returns the HBM access pattern text for a load in this scope and, for loads with more
    than one free dim, the SBUF destination pattern; ``result`` is the Ref that ``ir.Result()`` stands for.
    """

    def __init__(self, allocator: TileAllocator, free: int, slice_text: str, load_pattern, result: Ref | None = None,
                 vector_pattern=None):
        self.allocator, self.free, self.slice_text = allocator, free, slice_text
        self.load_pattern, self.result = load_pattern, result
        # vector_pattern(load, tile) -> (dst, src) for loads constant along the free axis, else None
        self.vector_pattern = vector_pattern
        self.memo: dict = {}
        self.tiles: dict[tuple, str] = {}

    def tile(self, dtype: str = "float32", key=None, vector: bool = False) -> str:
        # One tile per (scope, expression): loop iterations overwrite it, the code stays straight-line.
        if key is not None and key in self.tiles:
            return self.tiles[key]
        name = self.allocator.new("t" if dtype == "float32" else f"t_{dtype}", 1 if vector else self.free, dtype)
        if key is not None:
            self.tiles[key] = name
        return name

    def ref_text(self, ref: Ref) -> str:
        return f"{ref.tile}[0:rows, 0:1]" if ref.vector else f"{ref.tile}{self.slice_text}"

    def operand_text(self, ref: Ref) -> str:
        """A tensor_scalar operand: a number literal or a (P, 1) row-vector slice."""
        return number(ref.value) if ref.value is not None else self.ref_text(ref)


def emit(expr: ir.Expr, scope: TileScope, lines: list[str]) -> Ref:
    """Append the instructions computing ``expr`` to ``lines``; return where the value is."""
    if expr in scope.memo:
        return scope.memo[expr]
    ref = _emit_uncached(expr, scope, lines)
    scope.memo[expr] = ref
    return ref


def _emit_uncached(expr, scope, lines) -> Ref:
    if isinstance(expr, ir.Scalar):
        return Ref(value=float(expr.value))
    if isinstance(expr, ir.Result):
        if scope.result is None:
            raise ExpressionError("result() used outside a kernel that produces one")
        return scope.result
    if isinstance(expr, getattr(ir, "Iota", ())):  # ir.Iota arrives with the arange lowering's ir.py change
        return _emit_iota(expr, scope, lines)
    if isinstance(expr, ir.Load):
        dtype = expr.dtype
        if scope.vector_pattern is not None and dtype != "bool":
            # Constant along the free axis (a per-row statistic): one element per partition, not a broadcast
            # DMA that moves every repeated element; ops take it as a (P, 1) operand. Kept fp32 for them.
            name = scope.tile(key=("vector", expr), vector=True)
            patterns = scope.vector_pattern(expr, name)
            if patterns is not None:
                lines.append(f"nisa.dma_copy(dst={patterns[0]}, src={patterns[1]})")
                return Ref(tile=name, vector=True)
        name = scope.tile(dtype, key=("load", expr))
        dst, src = scope.load_pattern(expr, name)
        lines.append(f"nisa.dma_copy(dst={dst}, src={src})")
        return Ref(tile=name, dtype=dtype)
    args = [emit(arg, scope, lines) for arg in expr.args]
    return _emit_op(expr, args, scope, lines)


def _fold(op: str, args: list[Ref]) -> Ref | None:
    if all(arg.value is not None for arg in args) and op in SCALAR_FOLDS:
        return Ref(value=float(SCALAR_FOLDS[op](*(arg.value for arg in args))))
    return None


def _is_constant(ref: Ref, other: Ref) -> bool:
    """Whether ``ref`` can be a tensor_scalar operand next to ``other``: a number, or a (P, 1) row vector
    beside a full tile."""
    return ref.value is not None or (ref.vector and other.tile is not None and not other.vector)


def _emit_op(expr: ir.Op, args: list[Ref], scope: TileScope, lines: list[str]) -> Ref:
    op = expr.op
    folded = _fold(op, args)
    if folded is not None:
        return folded
    tiles = [arg for arg in args if arg.tile is not None]
    if not tiles and op != "cast":
        # Every operand is a number and the op does not fold (abs of full()'s value, say): the instruction
        # needs a tile to read, so the first number is memset into one.
        first = Ref(tile=scope.tile())
        lines.append(f"nisa.memset(dst={scope.ref_text(first)}, value={number(args[0].value)})")
        args = [first, *args[1:]]
        tiles = [first]
    # Only (P, 1) row vectors (a reduction's result, before it meets a full tile): compute on [rows, 1].
    vector = bool(tiles) and all(arg.vector for arg in tiles)
    text = scope.ref_text
    operand = scope.operand_text
    if op == "cast" and vector and expr.dtype != "float32":
        # Round the row vector to the dtype, then keep it fp32: tensor_scalar operands must be fp32.
        rounded, widened = scope.tile(expr.dtype, vector=True), scope.tile(vector=True)
        lines.append(f"nisa.tensor_copy(dst={rounded}[0:rows, 0:1], src={text(args[0])})")
        lines.append(f"nisa.tensor_copy(dst={widened}[0:rows, 0:1], src={rounded}[0:rows, 0:1])")
        return Ref(tile=widened, vector=True)
    if op == "cast":
        (source,) = args
        dst = scope.tile(expr.dtype, vector=vector)
        dst_text = scope.ref_text(Ref(tile=dst, vector=vector))
        if source.value is not None:
            lines.append(f"nisa.memset(dst={dst_text}, value={number(source.value)})")
        else:
            lines.append(f"nisa.tensor_copy(dst={dst_text}, src={text(source)})")
        return Ref(tile=dst, dtype=expr.dtype, vector=vector)
    dst = scope.tile(vector=vector)
    out = Ref(tile=dst, vector=vector)
    dst_text = text(out)
    if op in ACTIVATIONS:
        lines.append(f"nisa.activation(dst={dst_text}, op={ACTIVATIONS[op]}, data={text(args[0])})")
    elif op == "neg":
        lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(args[0])}, op0=nl.multiply, operand0=-1.0)")
    elif op == "div":
        numerator, denominator = args
        if denominator.value is not None:
            # x / 0 is x * inf in IEEE arithmetic (inf with the sign of x, nan for 0 / 0), as eager gives.
            factor = 1.0 / denominator.value if denominator.value else math.copysign(math.inf, denominator.value)
            lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(numerator)}, op0=nl.multiply, "
                         f"operand0={number(factor)})")
        elif _is_constant(denominator, numerator):  # tile / row vector: multiply by the vector's reciprocal
            inverse = Ref(tile=scope.tile(vector=True), vector=True)
            lines.append(f"nisa.activation(dst={text(inverse)}, op=nl.reciprocal, data={text(denominator)})")
            lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(numerator)}, op0=nl.multiply, "
                         f"operand0={text(inverse)})")
        else:
            lines.append(f"nisa.activation(dst={dst_text}, op=nl.reciprocal, data={text(denominator)})")
            if _is_constant(numerator, denominator):
                lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={dst_text}, op0=nl.multiply, "
                             f"operand0={operand(numerator)})")
            else:
                lines.append(f"nisa.tensor_tensor(dst={dst_text}, data1={text(numerator)}, data2={dst_text}, "
                             "op=nl.multiply)")
    elif op == "pow" and args[1].tile is not None:
        # Elementwise exponents: the ALU power (C pow semantics, on GpSimd); a number base is memset first.
        base, exponent = (_fp32_text(arg, vector, scope, lines, role) for arg, role in zip(args, ("true", "false")))
        lines.append(f"nisa.tensor_tensor(dst={dst_text}, data1={base}, data2={exponent}, op=nl.power)")
    elif op == "pow":
        base, exponent = args
        if base.value is not None or exponent.value is None:
            raise ExpressionError("pow needs a tensor base and a number exponent")
        if exponent.value == 2.0:
            lines.append(f"nisa.tensor_tensor(dst={dst_text}, data1={text(base)}, data2={text(base)}, op=nl.multiply)")
        elif exponent.value == 1.0:
            lines.append(f"nisa.tensor_copy(dst={dst_text}, src={text(base)})")
        else:
            lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(base)}, op0=nl.power, "
                         f"operand0={number(exponent.value)})")
    elif op == "where":
        _emit_where(args, dst_text, vector, scope, lines)
    elif op == "copysign":
        _emit_copysign(args, dst_text, vector, scope, lines)
    elif op == "inverse_power_of_two":
        _emit_inverse_power_of_two(args[0], dst_text, vector, scope, lines)
    elif op in TENSOR_TENSOR_OPS:
        a, b = args
        if _is_constant(b, a):
            lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(a)}, op0={TENSOR_TENSOR_OPS[op]}, "
                         f"operand0={operand(b)})")
        elif _is_constant(a, b) and op == "sub":  # constant - tile == tile * -1 + constant
            lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(b)}, op0=nl.multiply, operand0=-1.0, "
                         f"op1=nl.add, operand1={operand(a)})")
        elif _is_constant(a, b):
            lines.append(f"nisa.tensor_scalar(dst={dst_text}, data={text(b)}, "
                         f"op0={TENSOR_TENSOR_OPS[MIRRORED[op]]}, operand0={operand(a)})")
        else:
            lines.append(f"nisa.tensor_tensor(dst={dst_text}, data1={text(a)}, data2={text(b)}, "
                         f"op={TENSOR_TENSOR_OPS[op]})")
    else:
        raise ExpressionError(f"no NKI instruction sequence for op {op}")
    return out


def _scratch(scope: TileScope, role: str, dtype: str = "float32", vector: bool = False) -> str:
    """A tile private to one instruction sequence (where, copysign): dead once its result is written, so every
    sequence in the scope shares it; big math expressions then need a few scratch tiles, not a few per op."""
    return scope.tile(dtype, key=("scratch", role, dtype, vector), vector=vector)


def fp32_tile(ref: Ref, scope: TileScope, lines: list[str], role: str | None = None) -> str:
    """``ref`` as an fp32 full-tile slice (numbers are memset, other dtypes widened); with ``role``, the widened
    copy goes to that shared scratch tile."""
    if ref.tile is not None and ref.dtype == "float32" and not ref.vector:
        return scope.ref_text(ref)
    tile = f"{_scratch(scope, role) if role else scope.tile()}{scope.slice_text}"
    if ref.value is not None:
        lines.append(f"nisa.memset(dst={tile}, value={number(ref.value)})")
    elif ref.vector:  # broadcast as -0.0 + vector: -0.0 is the exact additive identity (0.0 + -0.0 is +0.0)
        lines.append(f"nisa.memset(dst={tile}, value=-0.0)")
        lines.append(f"nisa.tensor_scalar(dst={tile}, data={tile}, op0=nl.add, operand0={scope.ref_text(ref)})")
    else:
        lines.append(f"nisa.tensor_copy(dst={tile}, src={scope.ref_text(ref)})")
    return tile


def _emit_where(args, dst_text, vector, scope, lines) -> None:
    """dst = b ^ ((a ^ b) & mask) on the fp32 bit patterns, mask = 0 - (condition != 0): an exact select
    (inf and nan pass through untouched; an arithmetic blend c * a + (1 - c) * b would make 0 * inf = nan).
    Over (P, 1) row vectors (every operand constant along the free axis, e.g. a one-column domain) it works on
    [rows, 1] slices."""
    condition, on_true, on_false = args
    if condition.value is not None:
        raise ExpressionError("where with a constant condition")
    true_tile = _fp32_text(on_true, vector, scope, lines, "true")
    false_tile = _fp32_text(on_false, vector, scope, lines, "false")
    window = "[0:rows, 0:1]" if vector else scope.slice_text
    condition_int, zero, mask, bits = (_scratch(scope, f"int{i}", "int32", vector) for i in range(4))
    lines += [
        f"nisa.tensor_copy(dst={condition_int}{window}, src={_fp32_text(condition, vector, scope, lines, 'cond')})",
        f"nisa.memset(dst={zero}{window}, value=0)",
        f"nisa.tensor_tensor(dst={mask}{window}, data1={zero}{window}, data2={condition_int}{window}, "
        "op=nl.subtract)",
        f"nisa.tensor_tensor(dst={bits}{window}, data1={true_tile}.view(nl.int32), "
        f"data2={false_tile}.view(nl.int32), op=nl.bitwise_xor)",
        f"nisa.tensor_tensor(dst={bits}{window}, data1={bits}{window}, data2={mask}{window}, op=nl.bitwise_and)",
        f"nisa.tensor_tensor(dst={dst_text}.view(nl.int32), data1={false_tile}.view(nl.int32), "
        f"data2={bits}{window}, op=nl.bitwise_xor)",
    ]


SIGN_BIT = -(2**31)  # 0x80000000 as an int32 operand
MAGNITUDE_BITS = 2**31 - 1  # 0x7fffffff


def _fp32_text(ref: Ref, vector: bool, scope: TileScope, lines: list[str], role: str) -> str:
    """``ref`` as an fp32 slice of the kind (full tile or (P, 1) row vector) being computed (a copy, if needed,
    in the shared scratch tile of ``role``)."""
    if not vector:
        return fp32_tile(ref, scope, lines, role)
    if ref.tile is not None:
        return scope.ref_text(ref)  # row vectors are always kept fp32
    tile = f"{_scratch(scope, role, vector=True)}[0:rows, 0:1]"
    lines.append(f"nisa.memset(dst={tile}, value={number(ref.value)})")
    return tile


def _emit_copysign(args, dst_text, vector, scope, lines) -> None:
    """dst = |magnitude| with the sign bit of ``sign``, on the fp32 bit patterns (int32 views, Vector engine
    bitvec ops): exact for -0.0, inf and nan (nan's sign bit is copied as eager's copysign does)."""
    magnitude, sign = args
    window = "[0:rows, 0:1]" if vector else scope.slice_text
    out_bits = f"{dst_text}.view(nl.int32)"
    if sign.value is not None:  # a number's sign: clear the sign bit, then set it if the number is negative
        mag = _fp32_text(magnitude, vector, scope, lines, "true")
        set_sign = ", op1=nl.bitwise_or, operand1=" + str(SIGN_BIT) if math.copysign(1.0, sign.value) < 0 else ""
        lines.append(f"nisa.tensor_scalar(dst={out_bits}, data={mag}.view(nl.int32), op0=nl.bitwise_and, "
                     f"operand0={MAGNITUDE_BITS}{set_sign})")
        return
    sign_text = _fp32_text(sign, vector, scope, lines, "false")
    if magnitude.value is not None:  # the sign bit of ``sign`` or'ed with the number's magnitude bits
        bits = struct.unpack("<i", struct.pack("<f", abs(magnitude.value)))[0]
        lines.append(f"nisa.tensor_scalar(dst={out_bits}, data={sign_text}.view(nl.int32), op0=nl.bitwise_and, "
                     f"operand0={SIGN_BIT}, op1=nl.bitwise_or, operand1={bits})")
        return
    mag = _fp32_text(magnitude, vector, scope, lines, "true")
    mag_bits, sign_bits = (f"{_scratch(scope, f'int{i}', 'int32', vector)}{window}" for i in range(2))
    lines += [
        f"nisa.tensor_scalar(dst={mag_bits}, data={mag}.view(nl.int32), op0=nl.bitwise_and, "
        f"operand0={MAGNITUDE_BITS})",
        f"nisa.tensor_scalar(dst={sign_bits}, data={sign_text}.view(nl.int32), op0=nl.bitwise_and, "
        f"operand0={SIGN_BIT})",
        f"nisa.tensor_tensor(dst={out_bits}, data1={mag_bits}, data2={sign_bits}, op=nl.bitwise_or)",
    ]


def _emit_inverse_power_of_two(x, dst_text, vector, scope, lines) -> None:
    """dst = 2**(127 - E) for x's biased exponent E (x >= 0, E <= 253): x * dst lies in [1, 2) for normal x, an
    exact rescaling that keeps a reciprocal's input in range. Bits: 0x7f000000 - (bits(x) & 0x7f800000); the
    subtraction runs in fp32 on the int32 values, exact because both are multiples of 2**23 below 2**31."""
    window = "[0:rows, 0:1]" if vector else scope.slice_text
    exponent = f"{_scratch(scope, 'int0', 'int32', vector)}{window}"
    lines += [
        f"nisa.tensor_scalar(dst={exponent}, data={_fp32_text(x, vector, scope, lines, 'true')}.view(nl.int32), "
        "op0=nl.bitwise_and, operand0=2139095040)",
        f"nisa.tensor_scalar(dst={dst_text}.view(nl.int32), data={exponent}, op0=nl.multiply, operand0=-1.0, "
        "op1=nl.add, operand1=2130706432.0)",
    ]


def emit_store(store_dtype: str, value: Ref, scope: TileScope, lines: list[str]) -> str:
    """The SBUF tile slice (of ``store_dtype``) holding ``value``, ready to DMA out."""
    if value.value is not None:
        tile = scope.tile(store_dtype)
        # memset's value must match the tile's dtype (nki-spec §1.3): an int literal for bool and int tiles.
        if store_dtype == "bool":  # a truth test, as a cast to bool is (nan and inf are True)
            literal = str(int(value.value != 0))
        elif store_dtype == "int32":
            if not math.isfinite(value.value) or value.value != int(value.value):
                raise ExpressionError(f"constant {value.value} stored to an int32 buffer")
            literal = str(int(value.value))
        else:
            literal = number(value.value)
        lines.append(f"nisa.memset(dst={tile}{scope.slice_text}, value={literal})")
        return f"{tile}{scope.slice_text}"
    if value.vector and scope.slice_text != "[0:rows, 0:1]":
        # A row vector stored over a full tile (an expand materialized): broadcast it with -0.0 + vector (the
        # exact additive identity: 0.0 + -0.0 would give +0.0 where eager keeps -0.0).
        tile = scope.tile()
        lines.append(f"nisa.memset(dst={tile}{scope.slice_text}, value=-0.0)")
        lines.append(f"nisa.tensor_scalar(dst={tile}{scope.slice_text}, data={tile}{scope.slice_text}, "
                     f"op0=nl.add, operand0={scope.ref_text(value)})")
        value = Ref(tile=tile)
    if value.dtype == store_dtype:
        return scope.ref_text(value)
    tile = scope.tile(store_dtype)
    lines.append(f"nisa.tensor_copy(dst={tile}{scope.slice_text}, src={scope.ref_text(value)})")
    return f"{tile}{scope.slice_text}"


def _emit_iota(expr: ir.Iota, scope: TileScope, lines: list[str]) -> Ref:
    """An int32 tile of affine integers: the access pattern a load through ``expr.layout`` would use becomes the
    iota's pattern (partition entry -> channel_multiplier, free entries -> pattern, offset -> offset)."""
    import re

    name = scope.tile("int32", key=("iota", expr))
    dst, src = scope.load_pattern(ir.Load("iota", expr.layout, "int32"), name)
    match = re.fullmatch(r"iota\.ap\(\[\[(-?\d+), rows\], (.*)\], offset=(.*)\)", src)
    if match is None:
        raise ExpressionError(f"iota over an access pattern it cannot state: {src}")
    channel, free, offset = match.groups()
    lines.append(f"nisa.iota({dst}, [{free}], offset={offset}, channel_multiplier={channel})")
    return Ref(tile=name, dtype="int32")
