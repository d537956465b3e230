"""passes/input_ranges: the call-time guard on small integer graph inputs, and the integer math it lets lower.

In range, position arithmetic on a graph input (``arange(n) + pos``, ``pos.add_(1)``) runs in kernels; out of
range, the same compiled function gives eager's exact answer through another dispatch entry (where the math runs
eagerly), never the fp32-rounded one a kernel would give.
"""

from __future__ import annotations

import torch

import neuron_compile
from neuron_compile.passes.input_ranges import GUARD_BOUND, GUARDED_NUMEL, bound_integer_inputs, guard_bound
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
