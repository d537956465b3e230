"""Codegen stage helper: IR expression trees -> NKI instruction lines on SBUF tiles.

Input: an ``ir.Expr`` and a ``TileScope`` (which tile slice the kernel is working on and how each operand is
loaded). Output: lines of NKI source (``nisa.*`` calls, dst first), plus the tile allocations they need.
Every value is computed in an fp32 tile (the engines compute in fp32 anyway); ``cast`` rounds into a tile of
its dtype; a store stages through a tile of the buffer's dtype when they differ. Equal subexpressions are
computed once per scope. Each op renders from its entry in the op table (neuron_compile/op_table.py): the plain
forms (binary ALU ops, tensor_scalar ops, activations, copies) from the entry's NKI operator, the sequences
(division, power, where, copysign, the inverse power of two, the ALU's reciprocal, rsqrt and sqrt) by the small
emitters named in ``SEQUENCES``.
Tiles are named for what they hold (``x_tile_1`` a load of ``x``, ``exp_2`` an op's result, ``as_bfloat16_3``
a cast), numbered so that every name in a kernel is distinct.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import struct

from neuron_compile import ir, op_table
from neuron_compile.codegen.engine_balance import (
    COPY,
    ENGINE_ARGUMENTS,
    FLOAT_TILE_DTYPES,
    GPSIMD,
    GPSIMD_COST,
    SCALAR,
    SPLIT_STEPS,
    EngineBalance,
)

NL_DTYPES = {"float32": "nl.float32", "bfloat16": "nl.bfloat16", "bool": "nl.uint8", "int32": "nl.int32"}

SIGN_BIT = -(2**31)  # 0x80000000 as an int32 operand
MAGNITUDE_BITS = 2**31 - 1  # 0x7fffffff
EXPONENT_BITS = 2139095040  # 0x7f800000
ROW_VECTOR = "[0:rows, 0:1]"  # the slice of a (P, 1) row vector
COLUMNS_WINDOW = "[0:rows, 0:cols]"  # a pointwise tile's window, the one an instruction may be split along
# Columns of the narrowest column tile for an instruction to be split by columns: each part is then at least
# SPLIT_MIN_COLUMNS / SPLIT_STEPS wide, and an instruction over fewer columns costs little more than MIN_II anyway.
SPLIT_MIN_COLUMNS = 64
PSUM_BANK_FP32 = 512  # fp32 elements per partition of one PSUM bank (2 KiB)
_PSUM_STAGING_KEY = "broadcast operands in PSUM"  # memo key: (the scope's PSUM bank, elements used)
_INVARIANT_KEY = "column-invariant expressions"  # memo key: column_invariant's answers for _scaled_factors


def number(value: float) -> str:
    """A float literal that is valid Python source (nan and inf have no literal)."""
    return f"float('{value}')" if math.isnan(value) or math.isinf(value) else repr(float(value))


class ExpressionError(RuntimeError):
    """An expression the codegen cannot emit (the message names the op)."""


@dataclasses.dataclass(frozen=True)
class AccessPattern:
    """An HBM access pattern, ``tensor.ap([[stride, count], ...], offset=...)``: the partition entry first, then the
    free entries (counts are loop bounds like ``rows`` or numbers), the offset as a source expression. It renders
    as the NKI call text (``str``); emitters that restate it for another instruction (iota) read its fields."""

    tensor: str
    entries: tuple[tuple[int, object], ...]
    offset: str

    @property
    def free(self) -> tuple[tuple[int, object], ...]:
        return self.entries[1:]

    def __str__(self) -> str:
        return f"{self.tensor}.ap({_entries_text(self.entries)}, offset={self.offset})"


def _entries_text(entries) -> str:
    return "[" + ", ".join(f"[{stride}, {count}]" for stride, count in entries) + "]"


def _identifier(stem: str) -> str:
    """``stem`` as the start of a Python identifier (a buffer name is one already)."""
    cleaned = "".join(char if char.isalnum() or char == "_" else "_" for char in stem)
    return cleaned if cleaned.isidentifier() and not keyword.iskeyword(cleaned) else f"tile_{cleaned}"


@dataclasses.dataclass
class TileAllocator:
    """A kernel's tile declarations (its template places them: at the top, or per loop iteration so that loads
    overlap compute). A tile is named ``<stem>_<n>``: the stem says what it holds, the kernel-wide count ``n``
    keeps every name distinct (and apart from the template's own names, which carry no number). ``reserved`` are
    the kernel's parameter and output buffer names, which are FX node names of the same form (``add_12``,
    ``mm_3``): a number that would give one of them is skipped, since a tile of that name would shadow the buffer
    (its loads would read the NaN-filled tile)."""

    partitions: int
    reserved: frozenset[str] = frozenset()
    lines: list[str] = dataclasses.field(default_factory=list)
    count: int = 0
    widths: list[int] = dataclasses.field(default_factory=list)  # free elements of each line's SBUF tile (PSUM: 0)
    psum_tiles: set[str] = dataclasses.field(default_factory=set)
    names: list[str] = dataclasses.field(default_factory=list)  # the name each line of ``lines`` declares
    sbuf_bytes: int = 0  # bytes per partition of the SBUF tiles ``new`` declared

    def split_by_width(self, width: int) -> tuple[list[str], list[str]]:
        """(the allocations of SBUF tiles ``width`` wide, the others): a chunked row kernel allocates the first
        per chunk (they hold one chunk's values) and the others per row block (partials that carry across
        chunks)."""
        wide = [line for line, free in zip(self.lines, self.widths) if free == width]
        return wide, [line for line, free in zip(self.lines, self.widths) if free != width]

    def _number(self, stem: str) -> int:
        number = self.count + 1
        while f"{_identifier(stem)}_{number}" in self.reserved:
            number += 1
        return number

    def next_name(self, stem: str) -> str:
        """The name the next allocation with ``stem`` gets (nothing is allocated)."""
        return f"{_identifier(stem)}_{self._number(stem)}"

    def take_name(self, stem: str) -> str:
        """A new distinct name for a tile the caller declares itself (outside the per-iteration allocations)."""
        number = self._number(stem)
        self.count = number
        return f"{_identifier(stem)}_{number}"

    def new_psum(self, stem: str, free: int) -> str:
        """A one-partition fp32 PSUM row (cross-partition results land there)."""
        name = self.take_name(stem)
        self.lines.append(f"{name} = nl.ndarray((1, {free}), dtype=nl.float32, buffer=nl.psum)")
        self.names.append(name)
        self.widths.append(0)
        self.psum_tiles.add(name)
        return name

    def new_psum_bank(self, stem: str) -> str:
        """A [partitions, one PSUM bank] fp32 tile (PSUM operands: see ``stage_in_psum``)."""
        name = self.take_name(stem)
        self.lines.append(f"{name} = nl.ndarray(({self.partitions}, {PSUM_BANK_FP32}), dtype=nl.float32, "
                          "buffer=nl.psum)")
        self.names.append(name)
        self.widths.append(0)
        self.psum_tiles.add(name)
        return name

    def new_psum_tile(self, stem: str, free: int) -> str:
        """A [partitions, free] fp32 PSUM tile allocated with the scope's tiles (codegen/psum_operands.py)."""
        name = self.take_name(stem)
        self.lines.append(f"{name} = nl.ndarray(({self.partitions}, {free}), dtype=nl.float32, buffer=nl.psum)")
        self.names.append(name)
        self.widths.append(0)
        self.psum_tiles.add(name)
        return name

    def new_element(self, stem: str, dtype: str) -> str:
        """A [1, 1] SBUF tile (one value on partition 0: a random seed)."""
        name = self.take_name(stem)
        self.lines.append(f"{name} = nl.ndarray((1, 1), dtype={NL_DTYPES[dtype]}, buffer=nl.sbuf)")
        self.names.append(name)
        self.widths.append(0)
        return name

    def new(self, stem: str, free: int, dtype: str = "float32") -> str:
        name = self.take_name(stem)
        self.lines.append(f"{name} = nl.ndarray(({self.partitions}, {free}), dtype={NL_DTYPES[dtype]}, buffer=nl.sbuf)")
        self.names.append(name)
        self.widths.append(free)
        self.sbuf_bytes += free * ir.ITEMSIZE.get(dtype, 4)
        return name


@dataclasses.dataclass(frozen=True)
class Ref:
    """An operand during emission: a tile (name, dtype) or a Python float."""

    tile: str | None = None
    dtype: str = "float32"
    value: float | None = None
    vector: bool = False  # a (P, 1) per-row value (a reduction result) rather than a full tile
    view: str | None = None  # the operand text when the tile is read through a view (a free-axis broadcast)


@dataclasses.dataclass(frozen=True)
class BroadcastLoad:
    """A load constant along a tile's first free dim (cos / sin of a rotary, the same for every head): one
    [rows, width] DMA of the distinct elements, read by the instructions through a view that repeats them along
    that dim (an access-pattern entry of step 0), instead of a DMA moving every repeat. With a ``step`` (every
    other element of cos: Wan's ``freqs_cos[..., 0::2]``) the DMA moves the contiguous span they lie in and the
    view takes every step-th (codegen/strided_rows.py)."""

    width: int  # distinct elements per partition
    repeats: str  # the repeated dim's extent (a loop bound like ``cols``)
    source: AccessPattern
    step: int = 1

    @property
    def span(self) -> int:
        """Elements per partition the tile holds."""
        return self.width * self.step

    @property
    def slice_text(self) -> str:
        return f"[0:rows, 0:{(self.width - 1) * self.step + 1}]"

    def view(self, tile: str, row_elems: int | None = None, offset: int = 0) -> str:
        """The repeating view of the elements at ``offset`` of ``tile`` (``row_elems`` per partition)."""
        row = self.span if row_elems is None else row_elems
        return f"{tile}.ap([[{row}, rows], [0, {self.repeats}], [{self.step}, {self.width}]], offset={offset})"


@dataclasses.dataclass(frozen=True)
class RepeatedColumnsLoad:
    """A load constant along a tile's inner free dims but not along its first (a per-row statistic when each
    partition holds several rows, kinds/pointwise.py ``rows_per_partition``): one [rows, cols] DMA of the distinct
    values, read through a view that repeats each one ``inner`` times (a step-0 entry), instead of a DMA moving
    every repeat."""

    span: int  # columns the tile holds
    inner: int
    source: AccessPattern
    slice_text: str = "[0:rows, 0:cols]"

    def view(self, tile: str) -> str:
        return f"{tile}.ap([[{self.span}, rows], [1, cols], [0, {self.inner}]], offset=0)"


class TileScope:
    """One tile-shaped working set: ``slice_text`` like ``[0:rows, 0:cols]`` over tiles of ``free`` elements.

    ``load_pattern(load, tile)`` returns the SBUF destination slice and the HBM ``AccessPattern`` of a load in this
    scope; ``result`` is the Ref that ``ir.Result()`` stands for, ``more_results`` those of ``Result(1)``, ...
    """

    def __init__(self, allocator: TileAllocator, free: int, slice_text: str, load_pattern, result: Ref | None = None,
                 vector_pattern=None, more_results: tuple[Ref, ...] = (), broadcast_pattern=None):
        self.allocator, self.free, self.slice_text = allocator, free, slice_text
        self.load_pattern, self.results = load_pattern, (result, *more_results)
        # vector_pattern(load, tile) -> (dst, src) for loads constant along the free axis, else None
        self.vector_pattern = vector_pattern
        # broadcast_pattern(load) -> a BroadcastLoad for loads constant along the tile's first free dim only
        self.broadcast_pattern = broadcast_pattern
        # shared_row(load) -> the name of a tile filled once before the loops, for loads the same on every
        # partition (codegen/row_broadcast.py), else None
        self.shared_row = None
        # shared_value(op) -> a Ref to a tile computed once before the loops, for ops over such loads alone (the
        # same on every partition too: codegen/row_broadcast.py), else None
        self.shared_value = None
        # span_load(load, lines) -> a Ref to a view of a contiguous span's tile, for loads with a small innermost
        # step (codegen/strided_rows.py), else None (nothing emitted)
        self.span_load = None
        # hoisted: where (P, 1) values that do not depend on the column tile are computed once per row tile
        # (codegen/hoisted_columns.py ``HoistedColumns``), or None: everything in the tile's lines
        self.hoisted = None
        self.memo: dict = {}
        self.tiles: dict[tuple, str] = {}
        self.balance = EngineBalance()
        # values computed into PSUM tiles for their tensor_tensor readers (codegen/psum_operands.py)
        self.psum_operands: frozenset = frozenset()
        # expression -> where its last instruction writes it (a view of a larger tile: a rotary part's columns of
        # the assembled heads), instead of a tile of its own and a copy there; a full tile of its dtype only
        self.destinations: dict[ir.Expr, Ref] = {}
        # whether an instruction over whole ``COLUMNS_WINDOW`` tiles may be split by columns between two engines
        # (``column_parts``): set by a kernel whose every column tile has at least ``SPLIT_MIN_COLUMNS`` columns
        self.split_columns = False
        # whether ``(x * s) * y`` may be one scalar_tensor_tensor (``_emit_scaled_product``): set by a row kernel's
        # epilogue, whose norm times its weight is the tail of each row block
        self.scaled_products = False

    def tile(self, dtype: str = "float32", key=None, vector: bool = False, stem: str = "value") -> str:
        # One tile per (scope, expression): loop iterations overwrite it, the code stays straight-line.
        if key is not None and key in self.tiles:
            return self.tiles[key]
        name = self.allocator.new(stem, 1 if vector else self.free, dtype)
        if key is not None:
            self.tiles[key] = name
        return name

    def ref_text(self, ref: Ref) -> str:
        if ref.view is not None:
            return ref.view
        return f"{ref.tile}{ROW_VECTOR}" if ref.vector else f"{ref.tile}{self.slice_text}"

    def operand_text(self, ref: Ref) -> str:
        """A tensor_scalar operand: a number literal or a (P, 1) row-vector slice."""
        return number(ref.value) if ref.value is not None else self.ref_text(ref)

    def window(self, vector: bool) -> str:
        """The slice an instruction over full tiles (or over (P, 1) row vectors) works on."""
        return ROW_VECTOR if vector else self.slice_text


def emit(expr: ir.Expr, scope: TileScope, lines: list[str]) -> Ref:
    """Append the instructions computing ``expr`` to ``lines``; return where the value is."""
    if isinstance(expr, ir.Load):
        expr = _canonical_load(expr)
    if expr in scope.memo:
        return scope.memo[expr]
    shared = scope.shared_value(expr) if scope.shared_value is not None and isinstance(expr, ir.Op) else None
    if shared is not None:
        scope.memo[expr] = shared
        return shared
    if scope.hoisted is not None and column_invariant(expr, scope, scope.hoisted.invariant):
        with scope.hoisted.emitting(scope) as hoisted_lines:
            ref = _emit_uncached(expr, scope, hoisted_lines)
    else:
        ref = _emit_uncached(expr, scope, lines)
    scope.memo[expr] = ref
    return ref


def bind_load(scope: TileScope, load: ir.Load, ref: Ref) -> None:
    """Make ``scope`` read ``load`` from ``ref``, a tile already on chip, instead of loading it (a norm epilogue's
    rows, kept in SBUF by the matmul that computed them)."""
    scope.memo[_canonical_load(load)] = ref


def column_invariant(expr: ir.Expr, scope: TileScope, known: dict | None = None) -> bool:
    """Whether ``expr`` is a (P, 1) row vector the same in every column tile of ``scope``: a load the scope's
    ``vector_pattern`` takes as one element per partition, a row kernel's reduced value held as a (P, 1) column, or
    an op over such values and numbers in which every op reads at least one of them. Its instructions then touch
    only ``[0:rows, 0:1]`` slices and never the column loop's variables. (An op over numbers alone may need a full
    tile, a memset: it is not one.) ``known``: the answers so far (expressions are DAGs that share subexpressions
    thousands of times)."""
    known = {} if known is None else known
    if expr not in known:
        if isinstance(expr, ir.Load):
            known[expr] = expr.dtype != "bool" and scope.vector_pattern is not None \
                and scope.vector_pattern(_canonical_load(expr), "column") is not None
        elif isinstance(expr, ir.Op):
            invariant = [column_invariant(arg, scope, known) for arg in expr.args]
            known[expr] = any(invariant) and all(
                flag or isinstance(arg, ir.Scalar) for flag, arg in zip(invariant, expr.args))
        elif isinstance(expr, ir.Result):  # a row kernel's reduced value, one per row: a (P, 1) column
            result = scope.results[expr.operand] if expr.operand < len(scope.results) else None
            known[expr] = result is not None and result.vector
        else:
            known[expr] = False
    return known[expr]


def _canonical_load(load: ir.Load) -> ir.Load:
    """``load`` with stride 0 on its size-1 dims: two loads of the same elements are then one expression (eager
    gives a size-1 dim the contiguous stride, a broadcast view 0), so a scope loads them once."""
    layout = load.layout
    strides = tuple(0 if size == 1 else stride for size, stride in zip(layout.shape, layout.strides))
    if strides == layout.strides:
        return load
    return dataclasses.replace(load, layout=ir.Layout(layout.shape, strides, layout.offset))


def _emit_uncached(expr, scope, lines) -> Ref:
    if isinstance(expr, ir.Scalar):
        return Ref(value=float(expr.value))
    if isinstance(expr, ir.Result):
        if expr.operand >= len(scope.results) or scope.results[expr.operand] is None:
            raise ExpressionError(f"{expr}() used outside a kernel that produces it")
        return scope.results[expr.operand]
    if isinstance(expr, ir.Iota):
        return _emit_iota(expr, scope, lines)
    if isinstance(expr, ir.RandomKeep):
        return _emit_random_keep(expr, scope, lines)
    if isinstance(expr, ir.Load):
        return _emit_load(expr, scope, lines)
    rounded = (_emit_rounded_op(expr, scope, lines) or _emit_scaled_square(expr, scope, lines)
               or _emit_scaled_product("float32", expr, scope, lines))
    if rounded is not None:
        return rounded
    return _emit_op(expr, _operands(expr, scope, lines), scope, lines)


def _emit_scaled_square(expr: ir.Expr, scope: TileScope, lines: list[str]) -> Ref | None:
    """``(x * c) * x`` (``ir.scaled_square``) of a full tile as one ScalarE ``activation(square, x, scale=s)``,
    ``s`` the fp32 ``sqrt(c)``: ``c * x * x`` rounded three times (``s``, ``x * s``, the square) where the two
    products rounded it twice, a few fp32 ulps apart, with the same special values (-0, inf and nan give what the
    products give). The products took ScalarE's multiply, then a tensor_tensor of two tiles on VectorE or GpSimd
    (two passes over fp32 operands). None when the pattern does not apply or x is a number or a row vector (the
    operand's lines, if any, are harmless: the plain path reuses them)."""
    matched = ir.scaled_square(expr)
    if matched is None or expr in scope.memo:
        return None
    x, factor = matched
    operand = _widened_source(x, scope, lines) or emit(x, scope, lines)
    if operand.tile is None or operand.vector:
        return None
    if expr in scope.psum_operands:  # ScalarE writes PSUM: the reader streams one operand from there
        out = Ref(tile=scope.allocator.new_psum_tile("square", scope.free))
    else:
        out = Ref(tile=scope.tile(stem="square"))
    scale = _rounded(math.sqrt(_rounded(factor, "float32")), "float32")
    scope.balance.note("scalar")
    lines.append(f"nisa.activation(dst={scope.ref_text(out)}, op=nl.square, data={scope.ref_text(operand)}, "
                 f"scale={number(scale)})")
    return out


# Sequences whose instructions read a bf16 / fp16 tile as they read an fp32 one (the ALU's reciprocal and rsqrt; pow's
# square, copy and power by a number; its elementwise power widens its operands itself).
READS_NARROW_TILES = {"reciprocal_alu", "rsqrt_alu", "sqrt_alu", "pow"}
# Casts to fp32 that change no value: the engines read these dtypes and compute in fp32 anyway.
EXACT_WIDENING = {"bfloat16", "float16"}


def _operands(expr: ir.Op, scope: TileScope, lines: list[str]) -> list[Ref]:
    """The Refs of ``expr``'s arguments. An instruction of one of the plain forms reads a bf16 / fp16 tile as
    it reads an fp32 one (it computes in fp32), so an argument that only widens such a tile to fp32 is read
    from that tile: no tensor_copy, unless something else (a store, a sequence) needs the fp32 tile."""
    if expr.op == "where":
        condition = _row_condition(expr.args[0], scope, lines)
        if condition is not None:
            return [condition] + [emit(arg, scope, lines) for arg in expr.args[1:]]
    if op_table.spec(expr.op).form not in PLAIN_FORMS and expr.op not in READS_NARROW_TILES:
        return [emit(arg, scope, lines) for arg in expr.args]
    return [_widened_source(arg, scope, lines) or emit(arg, scope, lines) for arg in expr.args]


def _row_condition(condition: ir.Expr, scope: TileScope, lines: list[str]) -> Ref | None:
    """A where's bool condition loaded constant along the free axis (a per-row mask, as the embedding gradient's
    padding test) as its (P, 1) column, which the where widens on chip (_predicate_text), instead of a broadcast
    DMA that moves one burst per repeated element. None for any other condition. Only here: other users of a bool
    load (bitwise ops) need it as a tile of its own dtype."""
    if not _is_row_condition(condition, scope):
        return None
    return _emit_column_load(_canonical_load(condition), scope, lines)


def _is_row_condition(condition: ir.Expr, scope: TileScope) -> bool:
    return isinstance(condition, ir.Load) and condition.dtype == "bool" and scope.vector_pattern is not None \
        and scope.vector_pattern(_canonical_load(condition), "column") is not None


def unwidened(expr: ir.Expr) -> ir.Expr:
    """``expr`` without a cast to fp32 of a bf16 / fp16 value (a cast that changes no value), for an instruction
    that reads the narrow tile as it reads an fp32 one (reductions and activations compute in fp32 from any float
    input): no widening copy is emitted for it."""
    widens = isinstance(expr, ir.Op) and op_table.spec(expr.op).form == "copy" and expr.dtype == "float32"
    return expr.args[0] if widens and getattr(expr.args[0], "dtype", None) in EXACT_WIDENING else expr


def _widened_source(arg: ir.Expr, scope: TileScope, lines: list[str]) -> Ref | None:
    """The full bf16 / fp16 tile that ``arg`` (a cast to fp32) widens, or None (nothing emitted for the cast)."""
    if not (isinstance(arg, ir.Op) and arg.dtype == "float32" and op_table.spec(arg.op).form == "copy"):
        return None
    source = emit(arg.args[0], scope, lines)
    if source.tile is None or source.vector or source.dtype not in EXACT_WIDENING:
        return None
    return source


REDUCE_OVERHEAD_CYCLES = 64  # an activation's reduce_res costs one MIN_II beyond its pass (cost.py)


def emit_row_summed(expr: ir.Expr, scope: TileScope, lines: list[str], row_sums: str, groups: int = 1) -> Ref | None:
    """``expr`` computed by one ScalarE activation that also writes each row's sum of its result into
    ``row_sums`` (its ``reduce_res``, a (P, 1) slice): a sum over a square or an activation then needs no
    tensor_reduce on VectorE. With ``groups`` > 1 (rows grouped on a partition, ``scope.free // groups`` columns
    each), one activation per group, writing group g's sum into column g of the tile ``row_sums`` names. None, with
    nothing emitted, when ``expr`` is not one activation of a full tile."""
    if expr in scope.memo or not isinstance(expr, ir.Op):
        return None
    entry = op_table.spec(expr.op)
    squared = ir.is_square(expr)
    if not squared and entry.form != "activation":
        return None
    operand = _widened_source(expr.args[0], scope, lines) or emit(expr.args[0], scope, lines)
    if operand.tile is None or operand.vector or (groups > 1 and operand.view is not None):
        return None  # a number or a row vector (or a view): the caller's plain path (the operand's lines are harmless)
    out = Ref(tile=scope.tile(stem=expr.op))
    function = "nl.square" if squared else entry.nl_op
    if groups == 1:
        scope.balance.note("scalar")
        lines.append(f"nisa.activation(dst={scope.ref_text(out)}, op={function}, data={scope.ref_text(operand)}, "
                     f"reduce_op=nl.add, reduce_res={row_sums})")
    else:
        row = scope.free // groups
        for group in range(groups):
            columns = f"[0:rows, {group * row}:{(group + 1) * row}]"
            lines.append(f"nisa.activation(dst={out.tile}{columns}, op={function}, data={operand.tile}{columns}, "
                         f"reduce_op=nl.add, reduce_res={row_sums}[0:rows, {group}:{group + 1}])")
        # each activation's reduce costs MIN_II cycles more than its pass (cost.py): in passes over the tile
        scope.balance.note("scalar", 1 + groups * REDUCE_OVERHEAD_CYCLES / scope.free)
    scope.memo[expr] = out
    return out


ROUNDING_DTYPES = {"bfloat16"}


def _emit_rounded_op(expr: ir.Expr, scope: TileScope, lines: list[str]) -> Ref | None:
    """``cast(op(...), bf16)`` with a one-instruction op: the instruction writes a bf16 tile directly. The
    engines compute in fp32 and round to the destination's dtype, so this is the value the fp32 result plus a
    rounding tensor_copy would give, one instruction fewer. The op's fp32 value is not kept (another use of it
    computes it again). None when the pattern does not apply."""
    if not (isinstance(expr, ir.Op) and expr.dtype in ROUNDING_DTYPES and op_table.spec(expr.op).form == "copy"):
        return None
    inner = expr.args[0]
    scaled = _emit_scaled_product(expr.dtype, inner, scope, lines) if inner not in scope.memo else None
    if scaled is not None:
        return scaled
    if isinstance(inner, ir.Op) and inner not in scope.memo and _divides_by_number(inner):
        return _emit_rounded_scaling(expr.dtype, inner, scope, lines)
    if isinstance(inner, ir.Op) and inner not in scope.memo and inner.op == "where":
        return _emit_rounded_select(expr.dtype, inner, scope, lines)
    if isinstance(inner, ir.Op) and inner not in scope.memo and inner.op in ROUNDED_BY_LAST_INSTRUCTION:
        return _emit_rounded_sequence(expr.dtype, inner, scope, lines)
    if not isinstance(inner, ir.Op) or inner in scope.memo or op_table.spec(inner.op).form not in PLAIN_FORMS:
        return None
    args = _operands(inner, scope, lines)
    tiles = [arg for arg in args if arg.tile is not None]
    entry = op_table.spec(inner.op)
    if not tiles or all(arg.vector for arg in tiles):
        return None  # numbers only, or (P, 1) row vectors (tensor_scalar operands stay fp32): the plain path
    out = _destination(expr, expr.dtype, scope) or Ref(
        tile=scope.tile(expr.dtype, stem=f"{inner.op}_{expr.dtype}"), dtype=expr.dtype)
    if _subtracts_constant(inner.op, args):
        lines += _subtraction(args, scope.ref_text(out), scope)
    else:
        lines.append(PLAIN_FORMS[entry.form](entry, args, scope.ref_text(out), scope, expr.dtype))
    return out


def _destination(expr: ir.Expr, dtype: str, scope: TileScope) -> Ref | None:
    """Where ``expr``'s caller asked its value written (``TileScope.destinations``), when that is a tile of the
    value's ``dtype``."""
    out = scope.destinations.get(expr)
    return out if out is not None and out.dtype == dtype else None


def _scaled_factors(expr: ir.Expr, scope: TileScope) -> tuple[ir.Expr, ir.Expr, ir.Expr] | None:
    """(x, s, y) when ``expr`` is ``(x * s) * y`` (either order of either product) with ``x * s`` not computed yet and
    ``s`` a number or a row-vector expression (``column_invariant``): a norm's normed row times its weight."""
    if not (isinstance(expr, ir.Op) and expr.op == "mul"):
        return None
    known = scope.memo.setdefault(_INVARIANT_KEY, {})  # column_invariant's answers, kept for the scope's life
    for inner, y in (expr.args, reversed(expr.args)):
        if isinstance(inner, ir.Op) and inner.op == "mul" and inner not in scope.memo:
            for x, factor in (inner.args, reversed(inner.args)):
                if isinstance(factor, ir.Scalar) or column_invariant(factor, scope, known):
                    return x, factor, y
    return None


def _emit_scaled_product(dtype: str, expr: ir.Expr, scope: TileScope, lines: list[str]) -> Ref | None:
    """``(x * s) * y`` of full tiles ``x`` and ``y`` and a number or (P, 1) row vector ``s`` (``_scaled_factors``) as
    one scalar_tensor_tensor writing a ``dtype`` tile: the engine computes ``x * s`` in fp32 and multiplies it by
    ``y`` unrounded, which is the fp32 tile of ``x * s`` times ``y`` bit for bit, in one pass over the two tiles
    instead of a pass over ``x`` and another over both (an RMSNorm's ``normed * weight`` with its ``x * rsqrt``). None
    (the operands' lines, if any, are harmless: the plain path reuses them) when a factor is not of that form or a
    tile is in PSUM."""
    if not scope.scaled_products or expr in scope.psum_operands:  # planned into PSUM: left as planned
        return None
    factors = _scaled_factors(expr, scope)
    if factors is None:
        return None
    x, y = (_widened_source(arg, scope, lines) or emit(arg, scope, lines) for arg in (factors[0], factors[2]))
    factor = emit(factors[1], scope, lines)
    tiles_only = all(ref.tile is not None and not ref.vector for ref in (x, y))
    if not tiles_only or not (factor.value is not None or factor.vector) or any(
            ref.tile in scope.allocator.psum_tiles for ref in (x, y, factor)):
        return None
    out = Ref(tile=scope.tile(dtype, stem=f"scaled_product_{dtype}"), dtype=dtype)
    engine = scope.balance.pick([x, y], scope, passes=2)
    lines.append(f"nisa.scalar_tensor_tensor(dst={scope.ref_text(out)}, data={scope.ref_text(x)}, op0=nl.multiply, "
                 f"operand0={scope.operand_text(factor)}, op1=nl.multiply, operand1={scope.ref_text(y)}{engine})")
    return out


def _divides_by_number(expr: ir.Op) -> bool:
    return expr.op == "div" and isinstance(expr.args[1], ir.Scalar)


def _division_factor(denominator: float) -> float:
    """x / d as the multiply x * factor: x / 0 is x * inf in IEEE arithmetic (inf with the sign of x, nan for
    0 / 0), as eager gives."""
    return 1.0 / denominator if denominator else math.copysign(math.inf, denominator)


def _emit_rounded_scaling(dtype: str, division: ir.Op, scope: TileScope, lines: list[str]) -> Ref | None:
    """``cast(x / number, dtype)`` as one multiply by the inverse (as ``_emit_div`` computes it) writing the
    ``dtype`` tile; None when x is not a full tile."""
    numerator = _widened_source(division.args[0], scope, lines) or emit(division.args[0], scope, lines)
    if numerator.tile is None or numerator.vector:
        return None
    out = Ref(tile=scope.tile(dtype, stem=f"div_{dtype}"), dtype=dtype)
    factor = _division_factor(division.args[1].value)
    lines.append(_tensor_scalar(scope.ref_text(out), scope.ref_text(numerator), (("nl.multiply", factor),),
                                engine=scope.balance.pick([numerator], scope, ("nl.multiply",))))
    return out


def _emit_rounded_select(dtype: str, select: ir.Op, scope: TileScope, lines: list[str]) -> Ref | None:
    """``cast(where(c, a, b), dtype)`` whose branches are tiles of ``dtype`` or numbers it holds exactly (masked_fill
    of bf16 scores with -inf): the select writes a ``dtype`` tile, no fp32 select and rounding copy. None
    otherwise."""
    if _is_row_condition(select.args[0], scope):
        return None  # the plain where widens the condition's column on chip
    args = [emit(arg, scope, lines) for arg in select.args]

    def exact(ref: Ref) -> bool:
        if ref.value is not None:
            return _representable(ref.value, dtype)
        return ref.tile is not None and not ref.vector and ref.dtype == dtype

    if args[0].tile is None or args[0].vector or not all(exact(branch) for branch in args[1:]):
        return None
    out = Ref(tile=scope.tile(dtype, stem=f"where_{dtype}"), dtype=dtype)
    emitted = len(lines)
    _emit_where(args, scope.ref_text(out), False, scope, lines, dtype)
    scope.balance.note("vector", len(lines) - emitted)
    return out


# Sequences whose value is their last instruction's fp32 result, so that instruction may round into the cast's tile.
ROUNDED_BY_LAST_INSTRUCTION = {"sqrt_alu", "reciprocal_alu"}


def _emit_rounded_sequence(dtype: str, sequence: ir.Op, scope: TileScope, lines: list[str]) -> Ref | None:
    """``cast(sqrt_alu(x), dtype)`` (or the ALU reciprocal) of a full tile: the sequence's last instruction writes
    the ``dtype`` tile, rounding its fp32 result once, as the cast would; no fp32 result and rounding copy. None
    for (P, 1) row vectors (kept fp32)."""
    args = _operands(sequence, scope, lines)
    if args[0].tile is None or args[0].vector:
        return None
    out = Ref(tile=scope.tile(dtype, stem=f"{sequence.op}_{dtype}"), dtype=dtype)
    SEQUENCES[sequence.op](args, scope.ref_text(out), False, scope, lines)
    return out


def _emit_load(expr: ir.Load, scope: TileScope, lines: list[str]) -> Ref:
    if scope.vector_pattern is not None and expr.dtype != "bool":
        column = _emit_column_load(expr, scope, lines)
        if column is not None:
            return column
    shared = scope.shared_row(expr) if scope.shared_row is not None else None
    if shared is not None:
        return Ref(tile=shared, dtype=expr.dtype)
    broadcast = scope.broadcast_pattern(expr) if scope.broadcast_pattern is not None else None
    if broadcast is not None:
        name = scope.allocator.new(f"{expr.buffer}_once", broadcast.span, expr.dtype)
        lines.append(f"nisa.dma_copy(dst={name}{broadcast.slice_text}, src={broadcast.source})")
        return stage_in_psum(name, expr.dtype, broadcast, scope, lines) or Ref(
            tile=name, dtype=expr.dtype, view=broadcast.view(name))
    spanned = scope.span_load(expr, lines) if scope.span_load is not None else None
    if spanned is not None:
        return spanned
    name = scope.tile(expr.dtype, key=("load", expr), stem=f"{expr.buffer}_tile")
    dst, src = scope.load_pattern(expr, name)
    lines.append(f"nisa.dma_copy(dst={dst}, src={src})")
    return Ref(tile=name, dtype=expr.dtype)


def stage_in_psum(name: str, dtype: str, broadcast: BroadcastLoad, scope: TileScope, lines: list[str]) -> Ref | None:
    """An fp32 broadcast operand (a rotary's cos or sin, the same for every head) copied on ScalarE into a PSUM bank
    the scope's broadcast operands share, and read from there: a VectorE tensor_tensor with one PSUM operand
    streams at full rate, where two fp32 SBUF operands halve it (cost.py), so each product with x costs one pass
    instead of two for a copy of one head's elements. The copy is exact (fp32 to fp32, signed zeros, inf and nan
    as they are); its SBUF tile stays readable for an instruction whose other operand is in PSUM too. None (nothing
    emitted) for other dtypes or when the bank is full."""
    if dtype != "float32" or not isinstance(broadcast, BroadcastLoad):
        return None
    bank, used = scope.memo.get(_PSUM_STAGING_KEY, (None, 0))
    width = (broadcast.width - 1) * broadcast.step + 1
    if used + broadcast.span > PSUM_BANK_FP32:
        return None
    if bank is None:
        bank = scope.allocator.new_psum_bank("broadcast_psum")
    scope.memo[_PSUM_STAGING_KEY] = (bank, used + broadcast.span)
    scope.balance.note("scalar", broadcast.span / scope.free)
    lines.append(f"nisa.tensor_copy(dst={bank}[0:rows, {used}:{used + width}], src={name}[0:rows, 0:{width}]"
                 f"{SCALAR})")
    staged = Ref(tile=bank, dtype=dtype, view=broadcast.view(bank, PSUM_BANK_FP32, used))
    scope.memo[(_PSUM_STAGING_KEY, staged)] = Ref(tile=name, dtype=dtype, view=broadcast.view(name))
    return staged


def _emit_column_load(expr: ir.Load, scope: TileScope, lines: list[str]) -> Ref | None:
    """A load constant along the free axis (a per-row statistic): one element per partition, not a broadcast DMA
    that moves every repeated element; ops take it as a (P, 1) operand, kept fp32 for them. None (and no tile) for
    a load that varies along the free axis."""
    key, stem = ("vector", expr), f"{expr.buffer}_column"
    name = scope.tiles.get(key) or scope.allocator.next_name(stem)
    patterns = scope.vector_pattern(expr, name)
    if patterns is None:
        return None
    scope.tile(key=key, vector=True, stem=stem)
    lines.append(f"nisa.dma_copy(dst={patterns[0]}, src={patterns[1]})")
    return Ref(tile=name, vector=True)


def _emit_iota(expr: ir.Iota, scope: TileScope, lines: list[str]) -> Ref:
    """An int32 tile of affine integers: the access pattern a load through ``expr.layout`` would use becomes the
    iota's pattern (partition entry -> channel_multiplier, free entries -> pattern, offset -> offset)."""
    name = scope.tile("int32", key=("iota", expr), stem="iota")
    dst, src = scope.load_pattern(ir.Load("iota", expr.layout, "int32"), name)
    if not isinstance(src, AccessPattern) or not src.free or src.entries[0][1] != "rows":
        raise ExpressionError(f"iota over an access pattern it cannot state: {src}")
    lines.append(f"nisa.iota({dst}, {_entries_text(src.free)}, offset={src.offset}, "
                 f"channel_multiplier={src.entries[0][0]})")
    return Ref(tile=name, dtype="int32")


def _emit_random_keep(expr: ir.RandomKeep, scope: TileScope, lines: list[str]) -> Ref:
    """Dropout's keep mask (1.0 kept, 0.0 dropped) for this tile: the Vector engine's generator is seeded with the
    call's seed xor the tile's first flat index (so the mask depends on the seed and the tile, not on loop order
    or on how tiles split over cores), then ``nisa.dropout`` zeroes a tile of ones with the drop probability."""
    name = scope.tile(key=("random_keep", expr), stem="keep")
    dst, src = scope.load_pattern(ir.Load("element", expr.layout, "float32"), name)
    if not isinstance(src, AccessPattern):
        raise ExpressionError(f"random_keep over an access pattern it cannot state: {src}")
    seed = scope.allocator.new_element("seed", "int32")
    seed_entry = f"{expr.seed.buffer}.ap([[1, 1], [1, 1]], offset={expr.seed.layout.offset})"
    lines += [
        f"nisa.dma_copy(dst={seed}, src={seed_entry})",
        f"nisa.tensor_scalar(dst={seed}, data={seed}, op0=nl.bitwise_xor, operand0={src.offset})",
        f"nisa.set_rng_seed({seed})",
        f"nisa.memset(dst={dst}, value=1.0)",
        f"nisa.dropout(dst={dst}, data={dst}, prob={number(expr.probability)})",
    ]
    scope.balance.note("vector", 3)
    return Ref(tile=name)


def _is_constant(ref: Ref, other: Ref) -> bool:
    """Whether ``ref`` can be a tensor_scalar operand next to ``other``: a number, or a (P, 1) row vector
    beside a full tile."""
    return ref.value is not None or (ref.vector and other.tile is not None and not other.vector)


def _emit_op(expr: ir.Op, args: list[Ref], scope: TileScope, lines: list[str]) -> Ref:
    entry = op_table.spec(expr.op)
    if entry.fold is not None and all(arg.value is not None for arg in args):
        return Ref(value=float(entry.fold(*(arg.value for arg in args))))
    tiles = [arg for arg in args if arg.tile is not None]
    if expr.op == "mul" and len(tiles) == 1 and any(arg.value == 1.0 for arg in args):
        return tiles[0]  # x * 1.0 is x, bit for bit (-0.0, inf and nan included): no instruction
    if not tiles and entry.form != "copy":
        # Every operand is a number and the op does not fold (abs of full()'s value, say): the instruction
        # needs a tile to read, so the first number is memset into one.
        first = Ref(tile=scope.tile(stem="constant"))
        lines.append(f"nisa.memset(dst={scope.ref_text(first)}, value={number(args[0].value)})")
        args, tiles = [first, *args[1:]], [first]
    # Only (P, 1) row vectors (a reduction's result, before it meets a full tile): compute on [rows, 1].
    vector = bool(tiles) and all(arg.vector for arg in tiles)
    if entry.form == "copy":
        return _emit_cast(expr.dtype, args[0], vector, scope, lines)
    if not vector and expr in scope.psum_operands and entry.form == "binary":
        out = Ref(tile=scope.allocator.new_psum_tile(expr.op, scope.free))
    elif not vector and _destination(expr, "float32", scope) is not None:
        out = _destination(expr, "float32", scope)
    else:
        out = Ref(tile=scope.tile(vector=vector, stem=expr.op), vector=vector)
    dst = scope.ref_text(out)
    if _subtracts_constant(expr.op, args):
        lines += _subtraction(args, dst, scope)
    elif entry.form == "sequence":
        emitted = len(lines)
        SEQUENCES[expr.op](args, dst, vector, scope, lines)
        charged = vector or expr.op in SELF_BALANCED  # (P, 1) row vectors: one element per partition
        for line in lines[emitted:] if not charged else ():
            scope.balance.note(*_engine_and_cost(line))
    else:
        lines.append(PLAIN_FORMS[entry.form](entry, args, dst, scope))
    return out


# ---------------------------------------------------------------- plain forms: one instruction from the table


def _tensor_scalar(dst: str, data: str, stages, operand: str | None = None, engine: str = "") -> str:
    """``tensor_scalar`` with one or two (operator, operand) stages; an operand None is ``operand``."""
    parts = [f"nisa.tensor_scalar(dst={dst}, data={data}"]
    for i, (nl_op, fixed) in enumerate(stages):
        parts.append(f"op{i}={nl_op}, operand{i}={operand if fixed is None else number(fixed)}")
    return ", ".join(parts) + engine + ")"


def _binary(entry: op_table.OpSpec, args, dst: str, scope: TileScope, dst_dtype: str = "float32") -> str:
    a, b = args
    if entry.name == "mul" and a == b and a.tile is not None and not a.vector:
        # x * x of a full tile: ScalarE's square (the same fp32 product, rounded once), off the busier VectorE
        scope.balance.note("scalar")
        return f"nisa.activation(dst={dst}, op=nl.square, data={scope.ref_text(a)})"
    written = dst.partition("[")[0]  # a PSUM destination keeps the instruction off GpSimd (pick reads it)
    for data, number_operand, stages in ((a, b, ((entry.nl_op, None),)), (b, a, entry.number_first)):
        if _is_constant(number_operand, data):
            in_psum = [Ref(tile=written)] if written in scope.allocator.psum_tiles else []
            engine = scope.balance.pick([*args, *in_psum], scope, _operators(stages))
            return _tensor_scalar(dst, scope.ref_text(data), stages, scope.operand_text(number_operand), engine)
    # the cost model's one pass: a bf16 add, subtract or multiply (operands and destination)
    one_pass = entry.nl_op in ("nl.add", "nl.subtract", "nl.multiply") and dst_dtype == "bfloat16" and all(
        arg.dtype == "bfloat16" for arg in args if arg.tile is not None)
    if all(arg.tile in scope.allocator.psum_tiles for arg in args):  # at most one operand may be in PSUM
        a, b = args = [scope.memo.get((_PSUM_STAGING_KEY, a), a), b]
    engine = scope.balance.pick(list(args), scope, passes=1 if one_pass else 2,
                                psum_dst=written in scope.allocator.psum_tiles)
    return (f"nisa.tensor_tensor(dst={dst}, data1={scope.ref_text(a)}, data2={scope.ref_text(b)}, "
            f"op={entry.nl_op}{engine})")


_NEGATION_KEY = "negated row vector"  # memo keys (this, a row vector's tile): the tile holding its negation


def _subtracts_constant(op: str, args: list[Ref]) -> bool:
    """Whether the op is ``tile - c`` with ``c`` a number or a (P, 1) row vector (a norm's ``x - mean``)."""
    return op == "sub" and args[0].tile is not None and not args[0].vector and _is_constant(args[1], args[0])


def _subtraction(args: list[Ref], dst: str, scope: TileScope) -> list[str]:
    """The lines of ``dst = x - c`` (``_subtracts_constant``): a subtract stage on VectorE or GpSimd, or, on
    ScalarE, whose tensor_scalar has no subtract stage on trn2, an add of ``-c``: the same IEEE value (x - c is
    x + (-c), signed zeros, inf and nan included). A row vector is negated once per scope for that (a (P, 1)
    instruction, where the subtract is a pass over the whole tile)."""
    data, constant = args
    engine = scope.balance.pick(list(args), scope, ("nl.add",))
    if engine != SCALAR:
        return [_tensor_scalar(dst, scope.ref_text(data), (("nl.subtract", None),), scope.operand_text(constant),
                               engine)]
    if constant.value is not None:
        return [_tensor_scalar(dst, scope.ref_text(data), (("nl.add", -constant.value),), engine=engine)]
    lines: list[str] = []
    key = (_NEGATION_KEY, constant.tile)
    if key not in scope.memo:
        scope.memo[key] = Ref(tile=scope.tile(vector=True, stem="negated"), vector=True)
        lines.append(_tensor_scalar(scope.ref_text(scope.memo[key]), scope.ref_text(constant),
                                    (("nl.multiply", -1.0),)))
    lines.append(_tensor_scalar(dst, scope.ref_text(data), (("nl.add", None),), scope.ref_text(scope.memo[key]),
                                engine))
    return lines


def remember_negation(scope: TileScope, value: Ref, negated: Ref) -> None:
    """Note that the (P, 1) tile ``negated`` holds ``-value`` (a variance's negated mean), for ``_subtraction``
    to add instead of negating ``value`` again; scopes copying ``scope``'s memo later know it too."""
    scope.memo[_NEGATION_KEY, value.tile] = negated


def _operators(stages) -> tuple[str, ...]:
    return tuple(nl_op for nl_op, _ in stages)


def _unary_tensor_scalar(entry: op_table.OpSpec, args, dst: str, scope: TileScope, dst_dtype: str = "") -> str:
    engine = scope.balance.pick(list(args), scope, _operators(entry.stages))
    return _tensor_scalar(dst, scope.ref_text(args[0]), entry.stages, engine=engine)


def _activation(entry: op_table.OpSpec, args, dst: str, scope: TileScope, dst_dtype: str = "") -> str:
    scope.balance.note("scalar")
    return f"nisa.activation(dst={dst}, op={entry.nl_op}, data={scope.ref_text(args[0])})"


# Each plain form: (op-table entry, operand Refs, dst slice, scope, dst dtype) -> the instruction line.
PLAIN_FORMS = {"binary": _binary, "tensor_scalar": _unary_tensor_scalar, "activation": _activation}


def _emit_cast(dtype: str, source: Ref, vector: bool, scope: TileScope, lines: list[str]) -> Ref:
    """``tensor_copy`` into a tile of ``dtype`` (a number is memset there); a full tile already rounded to
    ``dtype`` (a bf16 tile) is its own cast."""
    if source.tile is not None and not source.vector and source.dtype == dtype and dtype in ROUNDING_DTYPES:
        return source
    if source.value is not None and _representable(source.value, dtype):
        return source  # masked_fill's cast[bfloat16](-inf): a number the instructions take as it is
    if source.value is not None and dtype in ("float32", "bfloat16") and not math.isnan(source.value):
        return Ref(value=_rounded(source.value, dtype))  # the value a memset into a tile of dtype would hold
    if vector and dtype != "float32":
        # Round the row vector to the dtype, then keep it fp32: tensor_scalar operands must be fp32.
        rounded = scope.tile(dtype, vector=True, stem=f"as_{dtype}")
        widened = scope.tile(vector=True, stem=f"{dtype}_rounded")
        lines.append(f"nisa.tensor_copy(dst={rounded}{ROW_VECTOR}, src={scope.ref_text(source)})")
        lines.append(f"nisa.tensor_copy(dst={widened}{ROW_VECTOR}, src={rounded}{ROW_VECTOR})")
        return Ref(tile=widened, vector=True)
    out = Ref(tile=scope.tile(dtype, vector=vector, stem=f"as_{dtype}"), dtype=dtype, vector=vector)
    if source.value is not None:
        lines.append(f"nisa.memset(dst={scope.ref_text(out)}, value={number(source.value)})")
    else:
        engine = scope.balance.pick([source, out], scope, COPY) if dtype in FLOAT_TILE_DTYPES else ""
        lines.append(f"nisa.tensor_copy(dst={scope.ref_text(out)}, src={scope.ref_text(source)}{engine})")
    return out


FP32_ROUNDS_TO_INF = 2.0**128 - 2.0**103  # the midpoint between fp32's largest value and 2**128


def _rounded(value: float, dtype: str) -> float:
    """A number as a memset stores it in a tile of ``dtype``: rounded to fp32, then for bf16 to its upper half
    (round to nearest, ties to even; past the largest bf16, inf)."""
    if abs(value) >= FP32_ROUNDS_TO_INF:
        return math.copysign(math.inf, value)
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if dtype == "bfloat16":
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _representable(value: float, dtype: str) -> bool:
    """Whether the float ``value`` is exactly a value of the float ``dtype`` (its cast changes nothing)."""
    if dtype not in ("float32", "bfloat16") or math.isnan(value):
        return False
    if math.isinf(value):
        return True
    if abs(value) >= FP32_ROUNDS_TO_INF:
        return False  # a finite number past fp32's range (a cast makes it inf)
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
        return False  # not an fp32 value
    return dtype == "float32" or bits & 0xFFFF == 0  # bf16 is fp32's upper half


# ---------------------------------------------------------------- sequences: several instructions per op

# Scratch tiles private to one instruction sequence (where, copysign, pow, the inverse power of two): dead once
# its result is written, so every sequence in the scope shares them; big math expressions then need a few scratch
# tiles, not a few per op. Role -> name stem: fp32 copies of operands, where's uint8 predicate, then the int32 bit
# patterns of copysign and the inverse power of two.
SCRATCH_STEMS = {"true": "first_operand", "false": "second_operand", "cond": "condition", "predicate": "predicate",
                 "int0": "bits", "int1": "bits"}


def _scratch(scope: TileScope, role: str, dtype: str = "float32", vector: bool = False) -> str:
    stem = SCRATCH_STEMS[role]
    return scope.tile(dtype, key=("scratch", role, dtype, vector), vector=vector, stem=stem)


def fp32_tile(ref: Ref, scope: TileScope, lines: list[str], role: str | None = None) -> str:
    """``ref`` as an fp32 full-tile slice (numbers are memset, other dtypes widened); with ``role``, the widened
    copy goes to that shared scratch tile."""
    if ref.tile is not None and ref.dtype == "float32" and not ref.vector:
        return scope.ref_text(ref)
    stem = "constant" if ref.value is not None else "broadcast" if ref.vector else "as_float32"
    tile = f"{_scratch(scope, role) if role else scope.tile(stem=stem)}{scope.slice_text}"
    if ref.value is not None:
        lines.append(f"nisa.memset(dst={tile}, value={number(ref.value)})")
    elif ref.vector:  # broadcast as -0.0 + vector: -0.0 is the exact additive identity (0.0 + -0.0 is +0.0)
        lines.append(f"nisa.memset(dst={tile}, value=-0.0)")
        lines.append(f"nisa.tensor_scalar(dst={tile}, data={tile}, op0=nl.add, operand0={scope.ref_text(ref)})")
    else:
        lines.append(f"nisa.tensor_copy(dst={tile}, src={scope.ref_text(ref)})")
    return tile


def _fp32_text(ref: Ref, vector: bool, scope: TileScope, lines: list[str], role: str) -> str:
    """``ref`` as an fp32 slice of the kind (full tile or (P, 1) row vector) being computed (a copy, if needed,
    in the shared scratch tile of ``role``)."""
    if not vector:
        return fp32_tile(ref, scope, lines, role)
    if ref.tile is not None:
        return scope.ref_text(ref)  # row vectors are always kept fp32
    tile = f"{_scratch(scope, role, vector=True)}{ROW_VECTOR}"
    lines.append(f"nisa.memset(dst={tile}, value={number(ref.value)})")
    return tile


def _emit_div(args, dst, vector, scope, lines) -> None:
    """x / number: a multiply by its inverse; tile / row vector: a multiply by the vector's reciprocal; otherwise
    reciprocal(y), then the multiply by x."""
    numerator, denominator = args
    text = scope.ref_text
    if denominator.value is not None:
        lines.append(_tensor_scalar(dst, text(numerator), (("nl.multiply", _division_factor(denominator.value)),)))
    elif _is_constant(denominator, numerator):
        inverse = Ref(tile=scope.tile(vector=True, stem="reciprocal"), vector=True)
        lines.append(f"nisa.activation(dst={text(inverse)}, op=nl.reciprocal, data={text(denominator)})")
        lines.append(_tensor_scalar(dst, text(numerator), (("nl.multiply", None),), text(inverse)))
    else:
        lines.append(f"nisa.activation(dst={dst}, op=nl.reciprocal, data={text(denominator)})")
        if _is_constant(numerator, denominator):
            lines.append(_tensor_scalar(dst, dst, (("nl.multiply", None),), scope.operand_text(numerator)))
        else:
            lines.append(f"nisa.tensor_tensor(dst={dst}, data1={text(numerator)}, data2={dst}, op=nl.multiply)")


def _emit_pow(args, dst, vector, scope, lines) -> None:
    """Elementwise exponents: the ALU power (C pow semantics, on GpSimd; a number base is memset first). A number
    exponent: 2 is ScalarE's square of a full tile (a multiply of a (P, 1) vector), 1 a copy, any other the
    tensor_scalar power."""
    base, exponent = args
    if exponent.tile is not None:
        base_text = _fp32_text(base, vector, scope, lines, "true")
        exponent_text = _fp32_text(exponent, vector, scope, lines, "false")
        lines.append(f"nisa.tensor_tensor(dst={dst}, data1={base_text}, data2={exponent_text}, op=nl.power)")
        return
    if base.value is not None or exponent.value is None:
        raise ExpressionError("pow needs a tensor base and a number exponent")
    base_text = scope.ref_text(base)
    if exponent.value == 2.0 and not vector:
        lines.append(f"nisa.activation(dst={dst}, op=nl.square, data={base_text})")  # ScalarE, as in _binary
    elif exponent.value == 2.0:
        lines.append(f"nisa.tensor_tensor(dst={dst}, data1={base_text}, data2={base_text}, op=nl.multiply)")
    elif exponent.value == 1.0:
        lines.append(f"nisa.tensor_copy(dst={dst}, src={base_text})")
    else:
        lines.append(_tensor_scalar(dst, base_text, (("nl.power", exponent.value),)))


def _emit_where(args, dst, vector, scope, lines, dtype: str = "float32") -> None:
    """dst (of ``dtype``) = on_false, then ``tensor_copy_predicated`` of on_true where the condition holds: an exact
    select (inf and nan pass through untouched; an arithmetic blend c * a + (1 - c) * b would make 0 * inf = nan). A
    number is a memset or the copy's scalar source; a tile of ``dtype`` is read as it is, any other is copied to fp32
    first (the predicated copy's source shares its destination's dtype). Over (P, 1) row vectors (every operand
    constant along the free axis, e.g. a one-column domain) it works on [rows, 1] slices."""
    condition, on_true, on_false = args
    if condition.value is not None:  # a constant condition (flex attention's no-op mask): a static choice
        _copy_into(dst, on_true if condition.value else on_false, vector, scope, lines, dtype, "chosen")
        return
    predicate = _predicate_text(condition, vector, scope, lines)
    true_text = _select_source(on_true, vector, scope, lines, "true", dtype)
    if true_text == dst:  # dst already holds on_true: bring on_false in where the condition fails
        false_text = _select_source(on_false, vector, scope, lines, "false", dtype)
        lines.append(f"nisa.tensor_copy_predicated(dst={dst}, src={false_text}, predicate={predicate}, "
                     "reverse_pred=True)")
        return
    _copy_into(dst, on_false, vector, scope, lines, dtype, "false")
    lines.append(f"nisa.tensor_copy_predicated(dst={dst}, src={true_text}, predicate={predicate})")


def _copy_into(dst, operand, vector, scope, lines, dtype: str, role: str) -> None:
    """dst (of ``dtype``) = ``operand``: a memset for a number, else an exact copy of its tile."""
    if operand.value is not None:
        lines.append(f"nisa.memset(dst={dst}, value={number(operand.value)})")
        return
    # a plain copy also widens a bf16 / fp16 tile into the fp32 dst exactly: no fp32 copy of it first
    widens = dtype == "float32" and operand.dtype in EXACT_WIDENING
    direct = operand.tile is not None and operand.vector == vector and (widens or operand.dtype == dtype)
    text = scope.ref_text(operand) if direct else _fp32_text(operand, vector, scope, lines, role)
    if text != dst:
        lines.append(f"nisa.tensor_copy(dst={dst}, src={text})")


def _select_source(ref: Ref, vector: bool, scope: TileScope, lines: list[str], role: str,
                   dtype: str = "float32") -> str:
    """A number as itself (the predicated copy's scalar source), a tile of ``dtype`` as it is, anything else as an
    fp32 slice."""
    if ref.value is not None:
        return number(ref.value)
    if ref.tile is not None and ref.vector == vector and ref.dtype == dtype:
        return scope.ref_text(ref)
    return _fp32_text(ref, vector, scope, lines, role)


def _predicate_text(condition: Ref, vector: bool, scope: TileScope, lines: list[str]) -> str:
    """The condition as the uint8 predicate tensor_copy_predicated reads: a bool tile of the same kind as is, else
    its 0 / 1 values converted."""
    if condition.tile is not None and condition.dtype == "bool" and condition.vector == vector:
        return scope.ref_text(condition)
    predicate = f"{_scratch(scope, 'predicate', 'bool', vector)}{scope.window(vector)}"
    if condition.vector and not vector:  # a (P, 1) column of 0 / 1 widened over the tile: 0 + column
        lines.append(f"nisa.memset(dst={predicate}, value=0)")
        lines.append(f"nisa.tensor_scalar(dst={predicate}, data={predicate}, op0=nl.add, "
                     f"operand0={scope.ref_text(condition)})")
        return predicate
    lines.append(f"nisa.tensor_copy(dst={predicate}, src={_fp32_text(condition, vector, scope, lines, 'cond')})")
    return predicate


def _emit_copysign(args, dst, vector, scope, lines) -> None:
    """dst = |magnitude| with the sign bit of ``sign``, on the fp32 bit patterns (int32 views, Vector engine
    bitvec ops): exact for -0.0, inf and nan (nan's sign bit is copied as eager's copysign does)."""
    magnitude, sign = args
    out_bits = f"{dst}.view(nl.int32)"
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
    window = scope.window(vector)
    mag_bits, sign_bits = (f"{_scratch(scope, f'int{i}', 'int32', vector)}{window}" for i in range(2))
    lines += [
        f"nisa.tensor_scalar(dst={mag_bits}, data={mag}.view(nl.int32), op0=nl.bitwise_and, "
        f"operand0={MAGNITUDE_BITS})",
        f"nisa.tensor_scalar(dst={sign_bits}, data={sign_text}.view(nl.int32), op0=nl.bitwise_and, "
        f"operand0={SIGN_BIT})",
        f"nisa.tensor_tensor(dst={out_bits}, data1={mag_bits}, data2={sign_bits}, op=nl.bitwise_or)",
    ]


def _emit_alu_reciprocal(args, dst, vector, scope, lines) -> None:
    """dst = 1 / x by the ALU's reciprocal, every fp32 input (IEEE special values): VectorE's nisa.reciprocal, or
    GpSimd's tensor_scalar form where the engine balance puts it (full tiles only), or both, each over a part of
    the columns, where the balance splits it (``column_parts``)."""
    data = scope.ref_text(args[0])
    cost = CYCLES_PER_ELEMENT["nisa.reciprocal("]
    costs = {"vector": cost}
    if not vector and args[0].tile not in scope.allocator.psum_tiles:
        costs["gpsimd"] = cost * GPSIMD_COST
    if vector:
        engines = [("vector", dst, data)]
    elif splittable(scope, dst, data):
        engines = column_parts(scope.balance.choose_split(costs), dst, data)
    else:
        engines = [(scope.balance.choose(costs), dst, data)]
    for engine, part_dst, part_data in engines:
        if engine == "gpsimd":
            lines.append(_tensor_scalar(part_dst, part_data, (("nl.reciprocal", 0.0),), engine=GPSIMD))
        else:
            lines.append(f"nisa.reciprocal(dst={part_dst}, data={part_data})")


def splittable(scope: TileScope, *operands: str) -> bool:
    """Whether an instruction over ``operands`` (slice texts) may be split by columns: the scope allows it (every
    column tile at least ``SPLIT_MIN_COLUMNS`` wide) and each operand is a tile's whole window."""
    return scope.split_columns and all(text.endswith(COLUMNS_WINDOW) for text in operands)


def column_parts(split: tuple[str, str | None, int], *operands: str) -> list[tuple[str, ...]]:
    """(engine, operand slices ...) of each part of an instruction the engine balance split by columns
    (``choose_split``'s answer): the first engine's share of the columns first, then the rest; one part when
    the balance did not split it."""
    first, second, share = split
    if second is None:
        return [(first, *operands)]
    cut = f"cols * {share} // {SPLIT_STEPS}"
    tiles = [text[:-len(COLUMNS_WINDOW)] for text in operands]
    return [(first, *(f"{tile}[0:rows, 0:{cut}]" for tile in tiles)),
            (second, *(f"{tile}[0:rows, {cut}:cols]" for tile in tiles))]


def _emit_gpsimd_rsqrt(args, dst, vector, scope, lines) -> None:
    """dst = 1 / sqrt(x) by GpSimd's ALU rsqrt (its operand is not read): every fp32 input. GpSimd cannot read
    PSUM: a PSUM operand is copied to SBUF first."""
    data = scope.ref_text(args[0])
    if args[0].tile in scope.allocator.psum_tiles:
        staged = f"{scope.tile(vector=vector, stem='from_psum')}{scope.window(vector)}"
        lines.append(f"nisa.tensor_copy(dst={staged}, src={data})")
        data = staged
    lines.append(_tensor_scalar(dst, data, (("nl.rsqrt", 0.0),), engine=GPSIMD))


FP32_LARGEST = 3.4028234663852886e38  # fp32's largest finite value: rsqrt(inf) would be 0, and inf * 0 nan
RSQRT_OF_ZERO_CLAMP = 2.0**100  # above every rsqrt of a finite positive fp32 (at most 2**74.5): only +-inf meet it


def _emit_alu_sqrt(args, dst, vector, scope, lines) -> None:
    """dst = sqrt(x) = x * min(|rsqrt(min(x, fp32 max))|, 2**100) (guarded_math.alu_sqrt): GpSimd's ALU rsqrt with
    the clamp as its first stage, then one scalar_tensor_tensor (VectorE or GpSimd, as the engine balance says)
    that clamps the rsqrt and multiplies by x. GpSimd cannot read PSUM: a PSUM operand is copied to SBUF first."""
    data = scope.ref_text(args[0])
    if args[0].tile in scope.allocator.psum_tiles:
        staged = f"{scope.tile(vector=vector, stem='from_psum')}{scope.window(vector)}"
        lines.append(f"nisa.tensor_copy(dst={staged}, src={data})")
        data = staged
        if not vector:
            scope.balance.note("vector")
    inverse_root = f"{scope.tile(vector=vector, stem='rsqrt')}{scope.window(vector)}"
    lines.append(_tensor_scalar(inverse_root, data, (("nl.minimum", FP32_LARGEST), ("nl.rsqrt", 0.0)),
                                engine=GPSIMD))
    engine = "vector"  # (P, 1) row vectors: one element per partition, nothing to balance
    if not vector:
        scope.balance.note("gpsimd", CYCLES_PER_ELEMENT["op1=nl.rsqrt"] * GPSIMD_COST)
        passes = 2  # a scalar_tensor_tensor streams its two tiles (cost.py)
        engine = scope.balance.choose({"vector": passes, "gpsimd": passes * GPSIMD_COST})
    lines.append(f"nisa.scalar_tensor_tensor(dst={dst}, data={inverse_root}, op0=nl.abs_min, "
                 f"operand0={number(RSQRT_OF_ZERO_CLAMP)}, op1=nl.multiply, operand1={data}"
                 f"{ENGINE_ARGUMENTS[engine]})")


def _emit_inverse_power_of_two(args, dst, vector, scope, lines) -> None:
    """dst = 2**(127 - E) for x's biased exponent E (x >= 0, E <= 253): x * dst lies in [1, 2) for normal x, an
    exact rescaling that keeps a reciprocal's input in range. Bits: 0x7f000000 - (bits(x) & 0x7f800000); the
    subtraction runs in fp32 on the int32 values, exact because both are multiples of 2**23 below 2**31."""
    exponent = f"{_scratch(scope, 'int0', 'int32', vector)}{scope.window(vector)}"
    x = _fp32_text(args[0], vector, scope, lines, "true")
    lines.append(_tensor_scalar(exponent, f"{x}.view(nl.int32)", (("nl.bitwise_and", None),), str(EXPONENT_BITS)))
    lines.append(_tensor_scalar(f"{dst}.view(nl.int32)", exponent, (("nl.multiply", -1.0), ("nl.add", 2130706432.0))))


# The op-table ops of form "sequence", each with its emitter: (operand Refs, dst slice, row vectors?, scope, lines).
SEQUENCES = {
    "div": _emit_div,
    "pow": _emit_pow,
    "where": _emit_where,
    "copysign": _emit_copysign,
    "inverse_power_of_two": _emit_inverse_power_of_two,
    "reciprocal_alu": _emit_alu_reciprocal,
    "rsqrt_alu": _emit_gpsimd_rsqrt,
    "sqrt_alu": _emit_alu_sqrt,
}
# Sequences whose emitter asks the engine balance itself (its choice is charged there).
SELF_BALANCED = {"reciprocal_alu", "sqrt_alu"}
# Cycles per element of the instructions a sequence emits, where not 1 (the cost model's figures: the ALU's
# reciprocal takes 8, GpSimd's ALU rsqrt 4), so the engine balance weighs them as the schedule will.
CYCLES_PER_ELEMENT = {"nisa.reciprocal(": 8, "op0=nl.reciprocal": 8, "op0=nl.rsqrt": 4, "op1=nl.rsqrt": 4}


def _engine_and_cost(line: str) -> tuple[str, float]:
    """(engine, relative cost) of one emitted instruction line, for the engine balance."""
    engine = ("scalar" if line.startswith("nisa.activation(") or SCALAR in line else "gpsimd" if GPSIMD in line
              else "vector")
    cost = max((cycles for text, cycles in CYCLES_PER_ELEMENT.items() if text in line), default=1)
    return engine, cost * (GPSIMD_COST if engine == "gpsimd" else 1)


def emit_store(store_dtype: str, value: Ref, scope: TileScope, lines: list[str]) -> str:
    """The SBUF tile slice (of ``store_dtype``) holding ``value``, ready to DMA out."""
    return f"{stored_tile(store_dtype, value, scope, lines)}{scope.slice_text}"


def stored_tile(store_dtype: str, value: Ref, scope: TileScope, lines: list[str]) -> str:
    """The name of a whole SBUF tile of ``store_dtype`` holding ``value`` (itself when it is one)."""
    if value.value is not None:
        tile = scope.tile(store_dtype, stem="fill")
        lines.append(f"nisa.memset(dst={tile}{scope.slice_text}, value={_memset_literal(store_dtype, value.value)})")
        return tile
    if value.vector and scope.slice_text != ROW_VECTOR:
        # A row vector stored over a full tile (an expand materialized): broadcast it with -0.0 + vector (the
        # exact additive identity: 0.0 + -0.0 would give +0.0 where eager keeps -0.0).
        tile = scope.tile(stem="broadcast")
        lines.append(f"nisa.memset(dst={tile}{scope.slice_text}, value=-0.0)")
        lines.append(f"nisa.tensor_scalar(dst={tile}{scope.slice_text}, data={tile}{scope.slice_text}, "
                     f"op0=nl.add, operand0={scope.ref_text(value)})")
        value = Ref(tile=tile)
    if value.dtype == store_dtype and value.view is None:
        return value.tile
    # another dtype, or a view (a broadcast, a step): a DMA of a strided SBUF read would pay a burst per element
    tile = scope.tile(store_dtype, stem=f"as_{store_dtype}")
    lines.append(f"nisa.tensor_copy(dst={tile}{scope.slice_text}, src={scope.ref_text(value)})")
    return tile


def _memset_literal(dtype: str, value: float) -> str:
    """memset's value must match the tile's dtype (nki-spec §1.3): an int literal for bool and int tiles."""
    if dtype == "bool":  # a truth test, as a cast to bool is (nan and inf are True)
        return str(int(value != 0))
    if dtype == "int32":
        if not math.isfinite(value) or value != int(value):
            raise ExpressionError(f"constant {value} stored to an int32 buffer")
        return str(int(value))
    return number(value)
