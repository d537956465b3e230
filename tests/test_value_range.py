"""The value-range analysis (passes/value_range.py): bounds it proves, and the ones it must not claim."""

from __future__ import annotations

import math

import torch
from lowering_harness import trace

from neuron_compile.passes.value_range import Interval, value_range


def _ranges(fn, *inputs) -> dict[str, Interval | None]:
    graph = trace(fn, *inputs).graph
    return {node.name: value_range(node) for node in graph.nodes if node.op != "output"}


def _last(fn, *inputs) -> Interval | None:
    graph = trace(fn, *inputs).graph
    (output,) = [node for node in graph.nodes if node.op == "output"]
    result = output.args[0]
    return value_range(result[0] if isinstance(result, (list, tuple)) else result)


X = torch.zeros(3)


def test_arange_and_integer_arithmetic():
    assert _last(lambda x: torch.arange(5, 17, 3), X) == Interval(5, 14)
    assert _last(lambda x: torch.arange(10, -3, -4), X) == Interval(-2, 10)
    assert _last(lambda x: torch.arange(4) * 3 - 7, X) == Interval(-7, 2)
    assert _last(lambda x: (torch.arange(6) - 2).abs(), X) == Interval(0, 3)
    assert _last(lambda x: torch.arange(6) - torch.arange(3)[:, None], X) == Interval(-2, 5)
    assert _last(lambda x: torch.where(x > 0, torch.arange(3), torch.arange(3) + 100), X) == Interval(0, 102)


def test_clamp_bounds_an_unknown_integer_but_not_an_unknown_float():
    index = torch.tensor([3, -9, 40])
    assert _last(lambda i: i.clamp(0, 7), index) == Interval(0, 7)
    assert _last(lambda i: i + 1, index) is None  # a graph input: nothing is known
    # A float clamp keeps nan: its result is not bounded unless its input is.
    assert _last(lambda x: x.clamp(0, 7), X) is None


def test_float_to_integer_cast_truncates_both_bounds():
    # (arange(7) * 0.25 + 0.5) spans [0.5, 2.0]; truncated it is {0, 1, 2}: the bound must include 0.
    assert _last(lambda x: (torch.arange(7) * 0.25 + 0.5).long(), X) == Interval(0, 2)
    assert _last(lambda x: (torch.arange(7) * -0.5 - 0.25).long(), X) == Interval(-3, 0)


def test_sums_divisions_and_bools():
    assert _last(lambda x: (x > 0).sum(dtype=torch.int64), X) == Interval(0, 3)
    assert _last(lambda x: torch.arange(3) / (torch.arange(3) - 1), X) is None  # the divisor spans 0
    ranges = _ranges(lambda x: (x > 0) & (x < 1), X)
    assert all(r == Interval(0, 1) for name, r in ranges.items() if name.startswith(("gt", "lt", "bitwise")))


def test_unknown_and_non_finite_values_are_not_bounded():
    assert _last(lambda x: x * 2, X) is None
    assert _last(lambda x: torch.full((3,), math.inf) + torch.arange(3), X) is None


def test_argmax_and_max_dim_indices_are_positions():
    x = torch.zeros(4, 6)
    assert _last(lambda a: torch.argmax(a), x) == Interval(0, 23)
    assert _last(lambda a: torch.argmin(a, 1), x) == Interval(0, 5)
    assert _last(lambda a: torch.max(a, 0)[1], x) == Interval(0, 3)
    assert _last(lambda a: torch.max(a, 0)[0], x) is None  # the values are the (unknown) source's


def test_rounding_widens_bf16_results_and_float_sums():
    bounded = _last(lambda x: (torch.arange(1000) * 1.0).to(torch.bfloat16), X)
    assert bounded.low < 0 and bounded.high > 999 * (1 + 2**-8)  # a bf16 rounding may carry 999 up to 1000
    total = _last(lambda x: (torch.arange(4096) * 1.0).sum(), X)
    assert total.high >= sum(range(4096)) * (1 + 4096 * 2**-24)


def test_integer_cumsum_of_a_mask_is_bounded_by_its_length():
    mask = torch.ones(2, 9, dtype=torch.int64)
    assert _last(lambda m: (m > 0).long().cumsum(1) * (m > 0) - 1, mask) == Interval(-1, 8)
    assert _last(lambda m: m.cumsum(1), mask) is None  # the graph input itself is unknown
    positions = _last(lambda m: (torch.ones(2, 9).cumsum(1) - 1).long(), mask)  # OPT's float mask cumsum
    assert positions == Interval(0, 8)
