"""Kernel kind ``scan``: a running sum, product, logsumexp, maximum or minimum of a prologue along one dim
(``ir.Scan``: cumsum, cumprod, logcumsumexp, cummax / cummin values or indices).

Fusion: a pointwise producer over the domain becomes the prologue, pointwise consumers over the domain the
epilogue. Tiling: the scanned dim on the free axis, walked in chunks that each carry their last column into the
next; the other dims on partitions and outer loops, whatever their order in memory. Codegen (scan.py.j2): per
partition tile and chunk, the prologue, ``nisa.tensor_tensor_scan`` from the value carried in from the previous
chunk (column 0 of each carried tile), the stores, then the chunk's last column becomes the next carry.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import Ref, TileAllocator, TileScope, emit, fp32_tile, number
from neuron_compile.codegen.kernel_text import (
    Patterns,
    kernel_context,
    kernel_names,
    render_template,
    row_scopes,
    store_lines,
)
from neuron_compile.kind_registry import register_kind
from neuron_compile.kinds.fusion_rules import ProloguedKind
from neuron_compile.kinds.rows import partition_dim, row_dims
from neuron_compile.tiles import TilePlan, count_tiles, free_tile

SCAN_TILES = 8  # running values and errors (each with a carry column), constants, the compensation's scratch
SCAN_OPS = {"sum": ("nl.add", 0.0), "prod": ("nl.multiply", 1.0)}
FLOAT32_MAX = 3.4028234663852886e38
LOG_INPUT_MAX = 2.0**64  # the top of nl.log's valid input range (nki-spec 1.5)


@dataclasses.dataclass
class _ScanTiles:
    """The tiles of one scan kernel: ``window`` slices of ``free``-column tiles, a -0.0 tile (op1's exact additive
    identity, 0.0 + -0.0 being +0.0), and the carried tiles with the value each starts a row from."""

    allocator: TileAllocator
    free: int
    window: str
    setup: list[str] = dataclasses.field(default_factory=list)
    carried: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.negative_zeros = self.tile("negative_zeros")
        self.setup.append(f"nisa.memset(dst={self.negative_zeros}, value=-0.0)")

    def tile(self, stem: str) -> str:
        return self.allocator.new(stem, self.free)

    def carried_tile(self, stem: str, initial: float) -> tuple[str, str]:
        """A tile of ``free`` + 1 columns and its view from column 1: scans write the view, column 0 holds the
        value carried in from the previous chunk (the scan's ``initial``), so ``tile[.., 0:cols]`` is each step's
        previous value."""
        tile = self.allocator.new(stem, self.free + 1)
        view = f"{tile}_chunk"
        self.setup.append(f"{view} = {tile}[:, 1:{self.free + 1}]")
        self.carried.append((tile, initial))
        return tile, view

    def scan(self, dst: str, data0: str, data1: str | None, initial: str, op0: str, op1: str = "nl.add",
             reverse0: bool = False) -> str:
        """One tensor_tensor_scan over the window: dst = op1(op0(data0, previous), data1), from ``initial``'s
        carry column; data1 defaults to the -0.0 tile."""
        data1 = data1 or f"{self.negative_zeros}{self.window}"
        reverse = ", reverse0=True" if reverse0 else ""
        return (f"nisa.tensor_tensor_scan(dst={dst}{self.window}, data0={data0}, data1={data1}, "
                f"initial={initial}[0:rows, 0:1], op0={op0}, op1={op1}{reverse})")


def _zero_non_finite(value: str, scratch: tuple[str, str]) -> list[str]:
    """Lines that set the non-finite elements of ``value`` (from an inf or nan in the row) to 0, through its
    bits: all masked where value - value != 0, so an error term cannot turn the running correction into nan."""
    difference, mask = scratch
    return [
        f"nisa.tensor_tensor(dst={difference}, data1={value}, data2={value}, op=nl.subtract)",
        f"nisa.tensor_scalar(dst={mask}.view(nl.int32), data={difference}, op0=nl.equal, operand0=0.0, "
        "op1=nl.multiply, operand1=-1.0)",
        f"nisa.tensor_tensor(dst={value}.view(nl.int32), data1={value}.view(nl.int32), data2={mask}.view(nl.int32), "
        "op=nl.bitwise_and)",
    ]


def _two_sum_error(previous: str, scanned: str, data: str, scratch: tuple[str, ...], error: str) -> list[str]:
    """Lines computing ``error`` = the exact fp32 rounding error of each step ``scanned = previous + data``
    (Knuth's TwoSum: six fp32 operations, no branch, no FMA)."""
    virtual, roundoff = scratch[:2]
    return [
        "# TwoSum: the exact rounding error of each step of the fp32 running sum",
        f"nisa.tensor_tensor(dst={virtual}, data1={scanned}, data2={data}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst={roundoff}, data1={scanned}, data2={virtual}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst={virtual}, data1={previous}, data2={virtual}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst={roundoff}, data1={data}, data2={roundoff}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst={error}, data1={virtual}, data2={roundoff}, op=nl.add)",
    ]


SPLIT_FACTOR = 4097.0  # 2**12 + 1: Veltkamp's split of a 24-bit significand into two 12-bit halves


def _split(value: str, high: str, low: str) -> list[str]:
    """Lines splitting ``value`` into ``high`` + ``low`` with 12-bit significands (Veltkamp), so that products
    of halves are exact in fp32."""
    return [
        f"nisa.tensor_scalar(dst={high}, data={value}, op0=nl.multiply, operand0={SPLIT_FACTOR})",
        f"nisa.tensor_tensor(dst={low}, data1={high}, data2={value}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst={high}, data1={high}, data2={low}, op=nl.subtract)",
        f"nisa.tensor_tensor(dst={low}, data1={value}, data2={high}, op=nl.subtract)",
    ]


def _two_product_excess(previous: str, scanned: str, data: str, scratch: tuple[str, ...], excess: str) -> list[str]:
    """Lines computing ``excess`` = scanned - data * previous exactly, minus the rounding error of each step of
    the fp32 running product (Dekker's TwoProduct without FMA: both factors split into 12-bit halves, whose
    products are exact): excess = (((scanned - x_hi * p_hi) - x_lo * p_hi) - x_hi * p_lo) - x_lo * p_lo. Exact
    unless a factor is beyond 2**115 (the split overflows: nan, then 0) or the product underflows."""
    x_high, x_low, p_high, p_low, term = scratch

    def multiply(a, b):
        return f"nisa.tensor_tensor(dst={term}, data1={a}, data2={b}, op=nl.multiply)"

    def subtract(a, b):
        return f"nisa.tensor_tensor(dst={excess}, data1={a}, data2={b}, op=nl.subtract)"

    return [
        "# TwoProduct: the exact rounding excess of each step of the fp32 running product",
        *_split(data, x_high, x_low), *_split(previous, p_high, p_low),
        multiply(x_high, p_high), subtract(scanned, term),
        multiply(x_low, p_high), subtract(excess, term),
        multiply(x_high, p_low), subtract(excess, term),
        multiply(x_low, p_low), subtract(excess, term),
    ]


def _running_scan(tiles: _ScanTiles, op: str, data: str, compensated: bool) -> tuple[list[str], str]:
    """(lines, result tile) of a running sum or product: op0 combines x with the running value, op1 adds -0.0.

    ``compensated``: the running value rounds to fp32 at every step, where eager accumulates in double. Each
    step's rounding error e is exact in fp32 (TwoSum; TwoProduct gives -e); the running value's error E follows
    E_i = E_(i-1) + e_i for a sum and E_i = x_i * E_(i-1) + e_i for a product (a second scan), and the result,
    the running value + E, is the double-accumulated value rounded to fp32. A product subtracts its running
    excess -E plus 0.0 instead: that keeps a -0.0 product (a running sum starts from +0.0, never -0.0)."""
    window = tiles.window
    combine, identity = SCAN_OPS[op]
    running, scanned = tiles.carried_tile("running", identity)
    lines = [tiles.scan(scanned, data, None, running, combine)]
    if not compensated:
        return lines, scanned
    errors, corrections = tiles.carried_tile("errors", 0.0)
    error, result = f"{tiles.tile('step_error')}{window}", tiles.tile("compensated")
    previous, current = f"{running}{window}", f"{scanned}{window}"
    if op == "sum":
        scratch = tuple(f"{tiles.tile(stem)}{window}" for stem in ("virtual", "roundoff"))
        lines += _two_sum_error(previous, current, data, scratch, error)
        recurrence = [tiles.scan(corrections, error, None, errors, "nl.add")]
    else:
        scratch = tuple(f"{tiles.tile(stem)}{window}" for stem in ("x_high", "x_low", "p_high", "p_low", "term"))
        lines += _two_product_excess(previous, current, data, scratch, error)
        recurrence = [tiles.scan(corrections, data, error, errors, "nl.multiply"),
                      "# x * E is nan after an inf x (inf * 0), where the running product is not finite anyway"]
        recurrence += _zero_non_finite(f"{corrections}{window}", scratch[:2])
        recurrence.append(f"nisa.tensor_scalar(dst={scratch[0]}, data={corrections}{window}, op0=nl.add, "
                          "operand0=0.0)")
    lines += ["# Non-finite step errors (an inf or nan in the row) become 0"] + _zero_non_finite(error, scratch[:2])
    lines += recurrence
    if op == "sum":
        lines.append(f"nisa.tensor_tensor(dst={result}{window}, data1={current}, data2={corrections}{window}, "
                     "op=nl.add)")
    else:
        lines.append(f"nisa.tensor_tensor(dst={result}{window}, data1={current}, data2={scratch[0]}, op=nl.subtract)")
    return lines, result


def _log_sum_exp_scan(tiles: _ScanTiles, data: str) -> tuple[list[str], str]:
    """(lines, result tile) of log(sum(exp(x))) over every prefix. m = the running max (nan sticks, as in eager);
    d = m clamped to finite values, so that -inf - -inf and inf - inf make no nan; the rescaled running sum
    s_i = s_(i-1) * exp(d_(i-1) - d_i) + exp(x_i - d_i) is a scan (multiply, then add); the result m + log(s).
    With any finite x so far, s is in [1, n] (log's valid range); before that s = 0, clamped to 1 (m is -inf);
    after an inf, m is inf."""
    window = tiles.window
    maxima, maxima_chunk = tiles.carried_tile("maxima", -math.inf)
    sums, sums_chunk = tiles.carried_tile("sums", 0.0)
    shifts = tiles.allocator.new("shifts", tiles.free + 1)  # d over the carry column and the chunk
    decay, terms, result = tiles.tile("decay"), tiles.tile("terms"), tiles.tile("log_sum_exp")
    with_carry = "[0:rows, 0:cols + 1]"
    return [
        "# m: the running max; d: m clamped to finite values",
        tiles.scan(maxima_chunk, data, None, maxima, "nl.maximum"),
        f"nisa.tensor_scalar(dst={shifts}{with_carry}, data={maxima}{with_carry}, op0=nl.maximum, "
        f"operand0={-FLOAT32_MAX!r}, op1=nl.minimum, operand1={FLOAT32_MAX!r})",
        "# s_i = s_(i-1) * exp(d_(i-1) - d_i) + exp(x_i - d_i)",
        f"nisa.tensor_tensor(dst={decay}{window}, data1={shifts}{window}, data2={shifts}[0:rows, 1:cols + 1], "
        "op=nl.subtract)",
        f"nisa.activation(dst={decay}{window}, op=nl.exp, data={decay}{window})",
        f"nisa.tensor_tensor(dst={terms}{window}, data1={data}, data2={shifts}[0:rows, 1:cols + 1], op=nl.subtract)",
        f"nisa.activation(dst={terms}{window}, op=nl.exp, data={terms}{window})",
        tiles.scan(sums_chunk, f"{decay}{window}", f"{terms}{window}", sums, "nl.multiply"),
        "# m + log(s), with s clamped into log's valid input range",
        f"nisa.tensor_scalar(dst={result}{window}, data={sums_chunk}{window}, op0=nl.maximum, operand0=1.0, "
        f"op1=nl.minimum, operand1={LOG_INPUT_MAX!r})",
        f"nisa.activation(dst={result}{window}, op=nl.log, data={result}{window})",
        f"nisa.tensor_tensor(dst={result}{window}, data1={result}{window}, data2={maxima_chunk}{window}, op=nl.add)",
    ], result


EXTREMA = {"max": ("nl.maximum", -math.inf), "min": ("nl.minimum", math.inf)}


def _extremum_scan(tiles: _ScanTiles, op: str, data: str) -> tuple[list[str], str]:
    """(lines, result tile) of cummax / cummin values (op max | min) or indices (max_index | min_index), eager's
    rule: a step takes x and its index when x is nan or, the running value not being nan, x >= it (<= for min).
    The values: a scan of maximum(running, x) (reverse0: on a tie, such as -0.0 after 0.0, x is taken), nan
    sticking. The indices: x hits where it equals the new running value or is nan; hit * position is a scan of
    maximum from 0, positions only growing (exact in fp32: the lowering keeps the scanned dim within 2**24)."""
    window = tiles.window
    combine, identity = EXTREMA[op.removesuffix("_index")]
    extrema, extrema_chunk = tiles.carried_tile("running_" + op.removesuffix("_index"), identity)
    lines = [tiles.scan(extrema_chunk, data, None, extrema, combine, reverse0=True)]
    if not op.endswith("_index"):
        return lines, extrema_chunk
    indices, indices_chunk = tiles.carried_tile("indices", 0.0)
    hits, nan_hits, positions = tiles.tile("hits"), tiles.tile("nan_hits"), tiles.tile("positions")
    return lines + [
        "# x takes the running place where it is the new running value, or where x is nan",
        f"nisa.tensor_tensor(dst={hits}{window}, data1={data}, data2={extrema_chunk}{window}, op=nl.equal)",
        f"nisa.tensor_tensor(dst={nan_hits}{window}, data1={data}, data2={data}, op=nl.not_equal)",
        f"nisa.tensor_tensor(dst={hits}{window}, data1={hits}{window}, data2={nan_hits}{window}, op=nl.add)",
        f"nisa.iota({positions}{window}, [[1, cols]], offset=f0, channel_multiplier=0)",
        f"nisa.tensor_tensor(dst={hits}{window}, data1={hits}{window}, data2={positions}{window}, op=nl.multiply)",
        tiles.scan(indices_chunk, f"{hits}{window}", None, indices, "nl.maximum"),
    ], indices_chunk


def render_scan(node: ir.Scan, plan: TilePlan, name: str, parameters: list[str]) -> str:
    """Per partition tile, per chunk of the scanned dim: the prologue, the scan instructions from the carried
    values, the stores; then each carried tile's last column becomes column 0 for the next chunk."""
    patterns = Patterns(plan)
    allocator = TileAllocator(plan.partition.tile, reserved=kernel_names(node, parameters))
    # the scan instruction takes full tiles: no (P, 1) column operands
    prologue, row_free, free, chunked = row_scopes(node, plan, allocator, patterns, columns=False)
    tiles = _ScanTiles(allocator, row_free, prologue.slice_text)
    body: list[str] = []
    value = emit(node.prologue, prologue, body)
    # a scan of a fill (cumsum of ones: positions) scans a tile memset to it
    data = prologue.ref_text(value) if value.tile is not None else fp32_tile(value, prologue, body)
    if node.op == "logsumexp":
        lines, result = _log_sum_exp_scan(tiles, data)
    elif node.op.removesuffix("_index") in EXTREMA:
        lines, result = _extremum_scan(tiles, node.op, data)
    else:
        lines, result = _running_scan(tiles, node.op, data, node.compensated)
    body += lines
    scope = TileScope(allocator, row_free, tiles.window, prologue.load_pattern, Ref(tile=result))
    scope.tiles, scope.memo = prologue.tiles, dict(prologue.memo)  # operands loaded for the prologue stay loaded
    store_lines(node.stores, scope, patterns, free, chunked, body)
    start = [f"nisa.memset(dst={tile}[0:rows, 0:1], value={number(value)})" for tile, value in tiles.carried]
    if chunked:
        body += [f"nisa.tensor_copy(dst={tile}[0:rows, 0:1], src={tile}[0:rows, cols:cols + 1])"
                 for tile, _ in tiles.carried]
    context = kernel_context(node, plan, name, parameters, allocations=allocator.lines, setup=tiles.setup, start=start,
                      body=body)
    return render_template("scan.py.j2", **context)


def plan_scan(node: ir.Scan, target) -> TilePlan:
    layouts = [layout for expr in (node.prologue, *(store.expr for store in node.stores))
               for layout in ir.access_layouts(expr)] + [store.layout for store in node.stores]
    kept, scanned = row_dims(node.domain, (node.dim,), layouts)
    tiles = count_tiles([node.prologue] + [store.expr for store in node.stores]) + SCAN_TILES
    free = dataclasses.replace(scanned[0], tile=free_tile(scanned[0].size, tiles, target))
    return TilePlan("scan", tuple(kept[:-1]), partition_dim(kept, target), (free,), tiles)


class ScanKind(ProloguedKind):
    node_type = ir.Scan
    name = "scan"

    def plan(self, node, target):
        return plan_scan(node, target)

    def render(self, node, plan, name, parameters):
        return render_scan(node, plan, name, parameters)


register_kind(ScanKind())
