"""passes/input_ranges: the call-time guard on small integer graph inputs, and the integer math it lets lower.

In range, position arithmetic on a graph input (``arange(n) + pos``, ``pos.add_(1)``) runs in kernels; out of
range, the same compiled function gives eager's exact answer through another dispatch entry (where the math runs
eagerly), never the fp32-rounded one a kernel would give. The float guard: a rotary embedding's frequencies bound
its cos / sin argument (the cheap reduction); frequencies out of the class, non-finite or huge compile (or find)
another entry, with the exact reduction where the bound no longer allows the cheap one.
"""

from __future__ import annotations

import math

import pytest
import torch

import neuron_compile
from neuron_compile.passes.input_ranges import (
    FLOAT_GUARD_MAX,
    GUARD_BOUND,
    GUARDED_FLOAT_NUMEL,
    GUARDED_NUMEL,
    bound_integer_inputs,
    guard_bound,
    guard_float_bound,
    range_guarded_floats,
)
from neuron_compile.passes.value_range import RANGE_KEY
from neuron_compile.runtime.cache import signature_of
from neuron_compile.runtime.disk_cache import region_key_parts


def test_guard_bounds_small_integer_tensors_within_the_bound_only():
    assert guard_bound(torch.tensor([0, GUARD_BOUND, -GUARD_BOUND])) is not None
    assert guard_bound(torch.tensor([GUARD_BOUND + 1])) is None
    assert guard_bound(torch.tensor([-GUARD_BOUND - 1], dtype=torch.int32)) is None
    assert guard_bound(torch.tensor(7)) is not None  # 0-d
    assert guard_bound(torch.zeros(GUARDED_NUMEL + 1, dtype=torch.int64)) is None  # too large to check per call
    assert guard_bound(torch.zeros(0, dtype=torch.int64)) is None
    assert guard_bound(torch.tensor([1.0])) is None and guard_bound(torch.tensor([True])) is None
    assert guard_bound(3) is None
    assert guard_bound(torch.tensor([[0, 2]]).to_sparse()) is None


def test_the_guard_is_part_of_the_dispatch_key():
    (small,) = signature_of([torch.tensor([5])])
    (large,) = signature_of([torch.tensor([2**30])])
    assert small != large and small.bound is not None and large.bound is None
    assert signature_of([torch.tensor([5])]) == signature_of([torch.tensor([-9])])  # one class: no recompile


def test_bounding_copies_the_graph_and_leaves_the_shared_one_alone():
    gm = torch.fx.symbolic_trace(lambda pos, x: pos + 1)
    bounded = bound_integer_inputs(gm, [torch.tensor([3]), torch.ones(2)])
    assert bounded is not gm
    pos, x = [node for node in bounded.graph.nodes if node.op == "placeholder"]
    assert pos.meta[RANGE_KEY].high == GUARD_BOUND and RANGE_KEY not in x.meta
    assert all(RANGE_KEY not in node.meta for node in gm.graph.nodes)
    assert bound_integer_inputs(gm, [torch.tensor([2**30]), torch.ones(2)]) is gm


def test_the_disk_cache_key_holds_the_bounds_a_region_relies_on():
    gm = torch.fx.symbolic_trace(lambda pos: pos + 1)
    args = [torch.tensor([3])]
    plain = region_key_parts(gm, args, None, "trn2")
    bounded = region_key_parts(bound_integer_inputs(gm, args), args, None, "trn2")
    assert "input ranges" not in plain  # keys of regions without bounds are what they were
    assert bounded["input ranges"] == [f"[{-GUARD_BOUND}.0, {float(GUARD_BOUND)}]"]
    assert {key: value for key, value in bounded.items() if key != "input ranges"} == plain


def _positions(pos, x):
    return (torch.arange(4) + pos).float() * x


def test_position_arithmetic_lowers_in_range_and_stays_exact_out_of_range():
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    x = torch.ones(4)
    with neuron_compile.config.patch(fallback="raise"):
        compiled = torch.compile(_positions, backend="neuron")
        small = torch.tensor([5])
        assert torch.equal(compiled(small, x), _positions(small, x))
        stats = neuron_compile.stats()
        assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] >= 3, stats["fallback_reasons"]

        large = torch.tensor([2**30 + 1])  # + 1, + 3: not fp32 values, a kernel would round them
        assert torch.equal(compiled(large, x), _positions(large, x))
        stats = neuron_compile.stats()
        assert stats["cache_misses"] == 2 and stats["recompiles"] == 1
        assert any("not proved within +-2**24" in reason for reason in stats["fallback_reasons"])

        assert torch.equal(compiled(torch.tensor([-77]), x), _positions(torch.tensor([-77]), x))
        assert neuron_compile.stats()["cache_misses"] == 2  # back in range: the first entry, no compile


def _advance(pos, x):
    pos.add_(1)  # an int64 input mutation: aot_autograd emits copy_(pos, pos + 1)
    return x * 2


def test_an_integer_input_mutation_lowers_exactly():
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    x = torch.ones(3)
    with neuron_compile.config.patch(fallback="raise"):
        compiled = torch.compile(_advance, backend="neuron")
        pos = torch.tensor([41])
        compiled(pos, x)
        assert pos.tolist() == [42] and pos.dtype == torch.int64
        stats = neuron_compile.stats()
        assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
        big = torch.tensor([2**40 + 1])
        compiled(big, x)
        assert big.tolist() == [2**40 + 2]  # eager's add: the out-of-range call does not run it in fp32


# ---------------------------------------------------------------- float inputs feeding sin / cos


def test_float_guard_classes_are_powers_of_two_of_finite_small_tensors():
    assert guard_float_bound(torch.tensor([0.3, -0.01])).high == 1.0  # at least 1: one class below it
    assert guard_float_bound(torch.tensor([1.0])).high == 1.0
    assert guard_float_bound(torch.tensor([-1.5], dtype=torch.bfloat16)).low == -2.0
    assert guard_float_bound(torch.tensor([1000.0])).high == 1024.0
    assert guard_float_bound(torch.zeros(3)).high == 1.0
    assert guard_float_bound(torch.tensor([FLOAT_GUARD_MAX])).high == FLOAT_GUARD_MAX
    for refused in (torch.tensor([FLOAT_GUARD_MAX * 1.5]), torch.tensor([1.0, math.nan]), torch.tensor([math.inf]),
                    torch.zeros(GUARDED_FLOAT_NUMEL + 1), torch.zeros(0), torch.tensor([3]), 2.0):
        assert guard_float_bound(refused) is None


def _rotary(inv_freq, weight, x):
    angles = torch.arange(8).float()[:, None] * inv_freq[None, :]
    return torch.cos(angles) * x, torch.sin(angles) * x + x @ weight


def test_only_floats_reaching_sin_or_cos_through_value_ranges_are_guarded():
    args = [torch.ones(4), torch.ones(4, 4), torch.ones(8, 4)]
    gm = torch.fx.experimental.proxy_tensor.make_fx(_rotary)(*args)
    assert range_guarded_floats(gm) == {0}  # the frequencies; not the matmul's weight, not x
    (frequencies, weight, _) = signature_of(args, range_guarded_floats(gm))
    assert frequencies.bound == "[-1.0, 1.0]" and weight.bound is None
    bounded = bound_integer_inputs(gm, args)
    placeholders = [node for node in bounded.graph.nodes if node.op == "placeholder"]
    assert placeholders[0].meta[RANGE_KEY].high == 1.0 and RANGE_KEY not in placeholders[1].meta


def _trig_instructions() -> int:
    record = neuron_compile.last_compiled()
    return sum(kernel.source.count("nisa.") for kernel in record.kernels)


@pytest.mark.parametrize(("out_of_class", "full_reduction"), [(1e4, False), (math.nan, True), (2.0**30, True)])
def test_rotary_frequencies_pick_the_cheap_reduction_and_others_stay_exact(out_of_class, full_reduction):
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    weight, x = torch.randn(4, 4), torch.randn(8, 4)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    with neuron_compile.config.patch(fallback="raise"):
        compiled = torch.compile(_rotary, backend="neuron")
        for got, want in zip(compiled(inv_freq, weight, x), _rotary(inv_freq, weight, x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        cheap = _trig_instructions()
        wide = inv_freq.clone()
        # angles up to 7e4 (class 2**14: past Cody-Waite's 2**12, within the summed tail's 2**20), nan (eager's nan,
        # the full reduction), beyond the guard (the full reduction)
        wide[1] = out_of_class
        for got, want in zip(compiled(wide, weight, x), _rotary(wide, weight, x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        stats = neuron_compile.stats()
        assert stats["cache_misses"] == 2 and stats["fallback_nodes"] == 0, stats
        if full_reduction:  # the exact reduction is ~400 instructions per function
            assert cheap * 4 < _trig_instructions()
        else:  # the summed tail: a few more instructions than Cody-Waite's, a fraction of the full reduction's
            assert cheap < _trig_instructions() < cheap * 2
        compiled(inv_freq * 0.5, weight, x)  # the same class: no compile
        assert neuron_compile.stats()["cache_misses"] == 2


def _float_positions(mask):
    # OPT's position ids: a float cumsum of the attention mask, cast to int64 (and recomputed in the backward from
    # the saved float cumsum, where the cumsum is a graph input)
    return (mask.cumsum(1) * mask - 1).long() + 2


def test_floats_cast_to_integers_are_guarded_and_the_cast_lowers_in_class_only():
    gm = torch.fx.experimental.proxy_tensor.make_fx(_float_positions)(torch.ones(2, 5))
    assert range_guarded_floats(gm) == {0}
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    compiled = torch.compile(_float_positions, backend="neuron")
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(compiled(mask), _float_positions(mask))
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] >= 4, stats["fallback_reasons"]
    huge = mask * (2.0**24 + 2)  # its cumsum leaves the fp32-exact integers: the cast stays eager, eager's answer
    assert torch.equal(compiled(huge), _float_positions(huge))
    stats = neuron_compile.stats()
    assert stats["cache_misses"] == 2
    assert any("not proved within +-2**24" in reason for reason in stats["fallback_reasons"])
