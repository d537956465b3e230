"""Analysis stage (feeds the partitioner's per-node decision): bounds on the values each ATen node produces.

Input: an ATen ``torch.fx.Graph`` with ``meta["val"]`` on its nodes. Output: ``value_range(node)`` — an
``Interval`` holding every value the node's tensor can take, or None when nothing is known (a graph input the
call-time guard did not bound, an op without a rule). Results are cached in ``node.meta[RANGE_KEY]``; the partitioner copies a node's meta into the
placeholder that stands for it in a region, so a region input keeps the bound its producer proved.

Why: NKI has no int64 and the Vector / Scalar engines compute in fp32, so an integer op is exact in a kernel
only when every integer it reads or writes lies within +-2**24 (every such integer is an fp32 value, and so is
every sum, difference, product, minimum and comparison whose result lies there too). The index arithmetic that
decompositions emit (arange, add, clamp, casts, in interpolate / pad / tril / diag) starts from bounded values,
so intervals prove it exact. Integers read from graph inputs are unknown, unless the graph was specialized on a
call-time check of their values (passes/input_ranges.py sets their placeholders' range: a decode step's cache
position); the rest stay eager.

Float intervals are kept only where they come from such integers (interpolate's ``(arange + 0.5) * scale``)
so that a float -> int cast of them can be proved to fit, or from a float input's call-time guard (a rotary
embedding's frequencies times its positions: lowering/trigonometry.py picks sin's and cos's argument reduction). One fp32 rounding moves a bound by one part in 2**24,
inside the slack the callers leave (see ``EXACT_INTEGER_BOUND``); where roundings add up (float sums) or are
coarser (bf16 results), the interval is widened by their worst case.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

from neuron_compile.limits import FP32_EXACT_INTEGER

aten = torch.ops.aten
prims = torch.ops.prims

RANGE_KEY = "neuron_value_range"
# Integers with |v| <= 2**24 are exact fp32 values; a little below it so fp32-rounded float bounds stay sound.
EXACT_INTEGER_BOUND = FP32_EXACT_INTEGER - 2**10


@dataclasses.dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def within(self, bound: float) -> bool:
        return -bound <= self.low and self.high <= bound

    def union(self, other: Interval) -> Interval:
        return Interval(min(self.low, other.low), max(self.high, other.high))

    def __str__(self) -> str:
        return f"[{self.low}, {self.high}]"


def _point(value) -> Interval | None:
    if isinstance(value, bool):
        return Interval(float(value), float(value))
    if isinstance(value, (int, float)) and math.isfinite(value):
        return Interval(float(value), float(value))
    return None


def _of(arg) -> Interval | None:
    """The interval of an operand: a node's cached range, or a number."""
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get(RANGE_KEY)
    return _point(arg)


def _finite(low: float, high: float) -> Interval | None:
    if math.isnan(low) or math.isnan(high) or math.isinf(low) or math.isinf(high):
        return None
    return Interval(low, high)


def _combine(a: Interval | None, b: Interval | None, fn) -> Interval | None:
    """fn applied to the corners: exact bounds for add, sub, mul, min and max of two intervals."""
    if a is None or b is None:
        return None
    corners = [fn(x, y) for x in (a.low, a.high) for y in (b.low, b.high)]
    return _finite(min(corners), max(corners))


def _monotone(a: Interval | None, fn) -> Interval | None:
    return None if a is None else _finite(*sorted((fn(a.low), fn(a.high))))


def _scaled(a: Interval | None, alpha) -> Interval | None:
    return _combine(a, _point(alpha), operator.mul)


def _alpha(node: torch.fx.Node):
    return node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)


def _arange(node):
    if node.target is aten.arange.default:
        start, end, step = 0, node.args[0], 1
    else:
        start, end = node.args[:2]
        step = node.args[2] if len(node.args) > 2 else node.kwargs.get("step", 1)
    count = node.meta["val"].numel()
    if count == 0 or not all(isinstance(v, (int, float)) for v in (start, step)):
        return None
    last = start + (count - 1) * step
    return _finite(min(start, last), max(start, last))


def _fill(node):
    return _of(node.args[0] if node.target is aten.scalar_tensor.default else node.args[1])


def _clamp(node):
    """min(max(x, low), high). An integer result is bounded by the bounds alone; a float one only when x is known
    (clamp keeps a nan x as nan)."""
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if node.target in (aten.clamp_min.default, aten.clamp_min.Tensor):
        low, high = node.args[1], None
    elif node.target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        low, high = None, node.args[1]
    source = _of(node.args[0])
    if source is None and node.meta["val"].is_floating_point():
        return None
    result = source or Interval(-math.inf, math.inf)
    if low is not None:
        bound = _of(low) or Interval(-math.inf, math.inf)
        result = Interval(max(result.low, bound.low), max(result.high, bound.high))
    if high is not None:
        bound = _of(high) or Interval(-math.inf, math.inf)
        result = Interval(min(result.low, bound.low), min(result.high, bound.high))
    return _finite(result.low, result.high)


def _abs(node):
    source = _of(node.args[0])
    if source is None:
        return None
    if source.low >= 0:
        return source
    if source.high <= 0:
        return Interval(-source.high, -source.low)
    return Interval(0.0, max(-source.low, source.high))


def _sum(node):
    source = _of(node.args[0])
    meta_in, meta_out = node.args[0].meta.get("val"), node.meta["val"]
    if source is None or meta_in is None or meta_out.numel() == 0:
        return None
    count = meta_in.numel() // max(meta_out.numel(), 1)
    low, high = min(0.0, source.low * count), max(0.0, source.high * count)
    if meta_out.is_floating_point():  # each of the count additions rounds: widen by count fp32 ulps
        slack = max(-low, high) * count * 2.0**-23
        low, high = low - slack, high + slack
    return _finite(low, high)


def _cumsum(node):
    """Prefix sums of 1..n elements of the source's range (OPT's positions: cumsum of a 0/1 attention mask)."""
    source, meta = _of(node.args[0]), node.args[0].meta.get("val")
    if source is None or meta is None:
        return None
    n = meta.shape[node.args[1]] if meta.dim() else 1
    low, high = min(source.low, source.low * n), max(source.high, source.high * n)
    if node.meta["val"].is_floating_point():  # n roundings at most, as for a sum
        slack = max(-low, high) * n * 2.0**-23
        low, high = low - slack, high + slack
    return _finite(low, high)


def _remainder(node):
    """Python's remainder by a nonzero constant b: the divisor's sign, magnitude below |b|."""
    divisor = node.args[1]
    if not isinstance(divisor, (int, float)) or divisor == 0:
        return None
    limit = float(abs(divisor) - 1 if not node.meta["val"].is_floating_point() else abs(divisor))
    return Interval(0.0, limit) if divisor > 0 else Interval(-limit, 0.0)


def _fmod(node):
    """C's fmod by a nonzero constant b: the dividend's sign, magnitude below |b|."""
    source, divisor = _of(node.args[0]), node.args[1]
    if source is None or not isinstance(divisor, (int, float)) or divisor == 0:
        return None
    limit = float(abs(divisor) - 1 if not node.meta["val"].is_floating_point() else abs(divisor))
    return Interval(-limit if source.low < 0 else 0.0, limit if source.high > 0 else 0.0)


def _floor_divide(node):
    divisor = node.args[1]
    if not isinstance(divisor, (int, float)) or divisor == 0:
        return None
    rounding = math.trunc if node.kwargs.get("rounding_mode") == "trunc" else math.floor
    return _monotone(_of(node.args[0]), lambda v: rounding(v / divisor))


def _true_divide(node):
    divisor = _of(node.args[1])
    if divisor is None or divisor.low <= 0 <= divisor.high:
        return None
    return _combine(_of(node.args[0]), Interval(1 / divisor.high, 1 / divisor.low), operator.mul)


def _same_as_first(node):
    return _of(node.args[0])


def _union_of(*positions):
    def infer(node):
        ranges = [_of(node.args[p]) for p in positions]
        if any(r is None for r in ranges):
            return None
        result = ranges[0]
        for r in ranges[1:]:
            result = result.union(r)
        return result

    return infer


def _cat(node):
    ranges = [_of(arg) for arg in node.args[0] if arg.meta["val"].numel() > 0]
    if not ranges or any(r is None for r in ranges):
        return None
    result = ranges[0]
    for r in ranges[1:]:
        result = result.union(r)
    return result


def _constant_pad(node):
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    source, pad = _of(node.args[0]), _point(value)
    return None if source is None or pad is None else source.union(pad)


def _positions(node, dim_position: int = 1):
    """Indices into the reduced dims of an argmax / max.dim: [0, positions - 1]."""
    source = node.args[0].meta["val"]
    dim = node.args[dim_position] if len(node.args) > dim_position else node.kwargs.get("dim")
    size = source.numel() if dim is None else (source.shape[dim] if source.dim() else 1)
    return Interval(0.0, float(max(size - 1, 0)))


def _getitem(node):
    """max.dim / min.dim return (values, indices): the values are the source's, the indices positions."""
    producer, index = node.args
    if producer.target not in (aten.max.dim, aten.min.dim):
        return None
    return _positions(producer) if index == 1 else _of(producer.args[0])


# Ops whose every output value is one of the first argument's values (views, copies, gathers, extrema).
SAME_VALUES = (
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.slice.Tensor, aten.select.int, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.clone.default, aten.alias.default,
    aten.contiguous.default, aten._to_copy.default, prims.convert_element_type.default, aten.lift_fresh_copy.default,
    aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.embedding.default, aten.flip.default,
    aten.repeat.default, aten.diagonal.default, aten.unfold.default, aten.amax.default, aten.amin.default,
    aten.max.default, aten.min.default, aten.permute_copy.default, aten.view_copy.default,
    aten.expand_copy.default, aten.unsqueeze_copy.default, aten.squeeze_copy.dim, aten.slice_copy.Tensor,
)

RULES = {
    aten.arange.default: _arange,
    aten.arange.start_step: _arange,
    aten.full.default: _fill,
    aten.full_like.default: _fill,
    aten.scalar_tensor.default: _fill,
    aten.add.Tensor: lambda n: _combine(_of(n.args[0]), _scaled(_of(n.args[1]), _alpha(n)), operator.add),
    aten.add.Scalar: lambda n: _combine(_of(n.args[0]), _scaled(_of(n.args[1]), _alpha(n)), operator.add),
    aten.sub.Tensor: lambda n: _combine(_of(n.args[0]), _scaled(_of(n.args[1]), _alpha(n)), operator.sub),
    aten.sub.Scalar: lambda n: _combine(_of(n.args[0]), _scaled(_of(n.args[1]), _alpha(n)), operator.sub),
    aten.rsub.Scalar: lambda n: _combine(_of(n.args[1]), _scaled(_of(n.args[0]), _alpha(n)), operator.sub),
    aten.rsub.Tensor: lambda n: _combine(_of(n.args[1]), _scaled(_of(n.args[0]), _alpha(n)), operator.sub),
    aten.mul.Tensor: lambda n: _combine(_of(n.args[0]), _of(n.args[1]), operator.mul),
    aten.mul.Scalar: lambda n: _combine(_of(n.args[0]), _of(n.args[1]), operator.mul),
    aten.div.Tensor: _true_divide,
    aten.div.Scalar: _true_divide,
    aten.neg.default: lambda n: _monotone(_of(n.args[0]), operator.neg),
    aten.abs.default: _abs,
    aten.maximum.default: lambda n: _combine(_of(n.args[0]), _of(n.args[1]), max),
    aten.minimum.default: lambda n: _combine(_of(n.args[0]), _of(n.args[1]), min),
    aten.clamp.default: _clamp,
    aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: _clamp,
    aten.clamp_min.Tensor: _clamp,
    aten.clamp_max.default: _clamp,
    aten.clamp_max.Tensor: _clamp,
    aten.floor.default: lambda n: _monotone(_of(n.args[0]), math.floor),
    aten.ceil.default: lambda n: _monotone(_of(n.args[0]), math.ceil),
    aten.trunc.default: lambda n: _monotone(_of(n.args[0]), math.trunc),
    aten.round.default: lambda n: _monotone(_of(n.args[0]), round),
    aten.where.self: _union_of(1, 2),
    aten.sum.default: _sum,
    aten.sum.dim_IntList: _sum,
    aten.cumsum.default: _cumsum,
    aten.remainder.Scalar: _remainder,
    aten.fmod.Scalar: _fmod,
    aten.floor_divide.default: _floor_divide,
    aten.div.Tensor_mode: _floor_divide,
    aten.div.Scalar_mode: _floor_divide,
    aten.cat.default: _cat,
    aten.copy.default: lambda n: _of(n.args[1]),  # self's values are replaced by src's (broadcast, cast)
    aten.copy_.default: lambda n: _of(n.args[1]),
    aten.constant_pad_nd.default: _constant_pad,
    aten.argmax.default: _positions,
    aten.argmin.default: _positions,
    operator.getitem: _getitem,
    **{op: _same_as_first for op in SAME_VALUES},
}


def _infer(node: torch.fx.Node) -> Interval | None:
    meta = node.meta.get("val")
    if not isinstance(meta, torch.Tensor):
        return None
    if meta.dtype == torch.bool:
        return Interval(0.0, 1.0)
    if meta.dtype.is_complex or node.op != "call_function":
        return None
    rule = RULES.get(node.target)
    if rule is None:
        return None
    try:
        result = rule(node)
    except (TypeError, ValueError, AttributeError, KeyError, ZeroDivisionError, OverflowError):
        return None  # an argument form the rule does not know (symbolic, list): nothing proved
    if result is not None and meta.dtype in (torch.bfloat16, torch.float16):
        # rounding to 8 (11) significant bits can carry a value past the exact bound: widen by that much
        slack = max(-result.low, result.high) * 2.0**-7
        result = Interval(result.low - slack, result.high + slack)
    if result is not None and not meta.is_floating_point():
        # An integer result holds integers of the interval, or float values truncated by a cast (a float -> int
        # _to_copy, an integer sum or fill of floats): truncating both ends bounds either.
        result = Interval(float(math.trunc(result.low)), float(math.trunc(result.high)))
    return result


def annotate(graph: torch.fx.Graph) -> None:
    """Fill ``meta[RANGE_KEY]`` for every node of ``graph`` that has none yet (in order: operands first)."""
    for node in graph.nodes:
        if RANGE_KEY not in node.meta:
            node.meta[RANGE_KEY] = _infer(node)


def value_range(node: torch.fx.Node) -> Interval | None:
    """Every value ``node``'s tensor can take (None: unknown)."""
    if RANGE_KEY not in node.meta:
        annotate(node.graph)
    return node.meta.get(RANGE_KEY)
