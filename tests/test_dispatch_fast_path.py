"""The in-process cache hit (runtime/launch_plan.py, region.py, launcher.py, compiled_graph.py): a hit lowers
nothing, reuses the first launch's cost report with the same figures, keeps every first-call check for inputs it
has not validated, and reads parameters through kept views that still see every update."""

from __future__ import annotations

import operator

import pytest
import torch

import neuron_compile
from neuron_compile import config, pipeline
from neuron_compile.config import Config
from neuron_compile.lowering import LoweringError
from neuron_compile.passes import value_range
from neuron_compile.runtime import compiled_graph, launch_plan, launcher, simulator, stable_views
from neuron_compile.runtime import region as region_module

from launch_spy import spy_traces

aten = torch.ops.aten
LAUNCH_FIGURES = ("kernels_launched", "hbm_bytes", "flops", "est_time_s", "est_lower_bound_s", "launch_s",
                  "roofline_s")


def _matmul_then_sum(x, w):
    h = aten.mm.default(x, w)
    return aten.add.Tensor(h, aten.sum.dim_IntList(h, [0])),


def _region(fn, *inputs):
    return pipeline.compile_region(torch.fx.symbolic_trace(fn), list(inputs), Config(launcher="simulator"))


def _inputs(rows=8):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, 16, generator=generator), torch.randn(16, 4, generator=generator)


def test_a_repeated_launch_reuses_the_first_report_and_records_no_trace(monkeypatch):
    x, w = _inputs()
    region = _region(_matmul_then_sum, x, w)
    traced = spy_traces(monkeypatch)
    kernel, flat = region.launched[0], {"x": x.reshape(-1), "w": w.reshape(-1)}
    arguments = [flat[name] for name in kernel.source.parameters]
    first_outputs, first_report = region.launcher.launch(kernel, arguments)
    second_outputs, second_report = region.launcher.launch(kernel, arguments)
    assert traced == [True, False] and second_report is first_report and first_report.flops > 0
    for first, second in zip(first_outputs, second_outputs, strict=True):
        assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()


def test_a_launch_with_other_argument_shapes_gets_its_own_report(monkeypatch):
    x, w = _inputs()
    region = _region(lambda a: (aten.mul.Tensor(a, 2.0),), x)
    traced = spy_traces(monkeypatch)
    kernel = region.launched[0]
    _, small = region.launcher.launch(kernel, [x.reshape(-1)])
    _, large = region.launcher.launch(kernel, [torch.randn(2 * x.numel())])  # a longer span: another signature
    assert traced == [True, True] and large is not small


def test_an_untraced_run_computes_the_same_outputs_and_has_no_report():
    x, w = _inputs()
    region = _region(_matmul_then_sum, x, w)
    kernel = region.launched[0]
    function, flat = kernel.function, {"x": x.reshape(-1).numpy(), "w": w.reshape(-1).numpy()}
    arrays = [flat[name] for name in kernel.source.parameters]
    traced = simulator.run_kernel(function, arrays)
    untraced = simulator.run_kernel(function, arrays, trace=False)
    assert untraced.trace is None and len(traced.trace) > 0
    for expected, got in zip(traced.outputs, untraced.outputs, strict=True):
        assert (expected == got).all()
    with pytest.raises(ValueError, match="trace=False"):
        untraced.report  # noqa: B018 -- the property raises


def test_launch_hooks_always_get_a_traced_run():
    x, w = _inputs()
    kernel = _region(_matmul_then_sum, x, w).launched[0]
    flat = {"x": x.reshape(-1).numpy(), "w": w.reshape(-1).numpy()}
    runs = []
    simulator.launch_hooks.append(runs.append)
    try:
        simulator.run_kernel(kernel.function, [flat[name] for name in kernel.source.parameters], trace=False)
    finally:
        simulator.launch_hooks.remove(runs.append)
    assert runs[0].trace and runs[0].report.flops > 0


def test_a_hit_lowers_nothing_and_adds_the_same_launch_figures(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    x = torch.randn(24, 32)
    compiled = torch.compile(model, backend="neuron")
    regions_compiled = []
    compile_region = compiled_graph.compile_region
    monkeypatch.setattr(compiled_graph, "compile_region",
                        lambda *args, **kwargs: regions_compiled.append(1) or compile_region(*args, **kwargs))
    deltas = []
    with config.patch(cache_dir="off", fallback="raise"), torch.no_grad():
        for _ in range(3):
            neuron_compile.reset_stats()  # from zero: each call's figures exactly, not differences of float sums
            with neuron_compile.record_launches() as launches:
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            counts = neuron_compile.stats()
            deltas.append({name: counts[name] for name in (*LAUNCH_FIGURES, "cache_hits")})
            deltas[-1]["reports"] = [launch.report for launch in launches]
    assert len(regions_compiled) == 1  # the first call compiled the one region; the hits lowered nothing
    first, *hits = deltas
    assert first["cache_hits"] == 0 and all(hit["cache_hits"] == 1 for hit in hits)
    for hit in hits:  # the figures of a hit are exactly those of the miss
        assert {name: hit[name] for name in LAUNCH_FIGURES} == {name: first[name] for name in LAUNCH_FIGURES}
        assert hit["reports"] == first["reports"] and first["kernels_launched"] == 1


def test_an_input_with_unvalidated_strides_is_still_checked():
    x, w = _inputs()
    region = _region(_matmul_then_sum, x, w)
    region(x, w)
    transposed = w.t().contiguous().t()  # same shape, other strides: never validated for this region
    with pytest.raises(LoweringError, match="compiled for shape"):
        region(x, transposed)
    with pytest.raises(LoweringError, match="compiled for dtype"):
        region(x, w.to(torch.bfloat16))
    torch.testing.assert_close(region(x, w)[0], _matmul_then_sum(x, w)[0])  # the validated one still runs


def test_trusted_inputs_are_not_read_again_and_the_others_still_are():
    x, w = _inputs()
    region = _region(_matmul_then_sum, x, w)
    region.trust_inputs([1])  # w: held by the caller's dispatch key
    assert region.checked_inputs == (0,)
    region(x, w)
    with pytest.raises(LoweringError, match="compiled for shape"):
        region(x.t().contiguous().t(), w)  # x is not trusted: a new signature of it is checked in full
    torch.testing.assert_close(region(x, w)[0], _matmul_then_sum(x, w)[0])


def _top_graph(with_resize: bool) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """placeholders x, w; an eager sort of x; a region reading (sorted x, w, x, a constant of the graph)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    if with_resize:
        graph.call_function(aten.resize_.default, (x, [4]))
    values = graph.call_function(operator.getitem, (graph.call_function(aten.sort.default, (x,)), 0))
    region = graph.call_module("nki_region_0", (values, w, x, graph.get_attr("constant")))
    graph.output(region)
    return torch.fx.GraphModule({"nki_region_0": torch.nn.Identity(), "constant": torch.zeros(0)}, graph), region


def test_graph_inputs_and_constants_are_fixed_for_a_key():
    top, region = _top_graph(with_resize=False)
    assert compiled_graph.dispatch_keyed_inputs(top, region) == [1, 2, 3]  # not the eager sort's output
    top, region = _top_graph(with_resize=True)  # an eager op may change an input's metadata: trust nothing
    assert compiled_graph.dispatch_keyed_inputs(top, region) == []


def _positions_passed_to(monkeypatch, method: str) -> list[list[int]]:
    """The positions each call of ``CompiledRegion.<method>`` receives, in order (the method still runs)."""
    passed = []
    original = getattr(region_module.CompiledRegion, method)
    monkeypatch.setattr(region_module.CompiledRegion, method,
                        lambda self, positions: passed.append(list(positions)) or original(self, positions))
    return passed


def test_a_compiled_graph_trusts_its_regions_graph_inputs(monkeypatch):
    trusted = _positions_passed_to(monkeypatch, "trust_inputs")

    def sorted_then_matmul(x, w):
        return torch.relu(torch.sort(x, dim=-1).values @ w) + 1.0

    x, w = _inputs()
    compiled = torch.compile(sorted_then_matmul, backend="neuron")
    with config.patch(cache_dir="off"):
        for _ in range(2):
            torch.testing.assert_close(compiled(x, w), sorted_then_matmul(x, w))
    (positions,) = trusted  # one region: the sorted x (eager-made, position 0) stays checked, w is trusted
    assert positions == [1]


def test_kept_parameter_views_see_in_place_updates_and_new_storage():
    x, w = _inputs()
    weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    region = _region(_matmul_then_sum, x, weight)
    for _ in range(2):  # the second call keeps the weight's view
        torch.testing.assert_close(region(x, weight)[0], _matmul_then_sum(x, weight)[0])
    with torch.no_grad():
        weight.mul_(-3.0)  # the same storage, new values
    torch.testing.assert_close(region(x, weight)[0], _matmul_then_sum(x, weight)[0])
    weight.data = torch.randn(16, 4)  # another storage
    torch.testing.assert_close(region(x, weight)[0], _matmul_then_sum(x, weight)[0])
    for _ in range(2):  # kept again
        torch.testing.assert_close(region(x, weight)[0], _matmul_then_sum(x, weight)[0])
    weight.untyped_storage().resize_(0)  # FSDP2 frees and regathers a parameter's memory this way
    weight.untyped_storage().resize_(16 * 4 * 4)
    with torch.no_grad():
        weight.copy_(torch.ones(16, 4))
    torch.testing.assert_close(region(x, weight)[0], _matmul_then_sum(x, weight)[0])
    region(x, weight)  # kept again
    weight.untyped_storage().resize_(0)  # freed for good: the kept view's storage holds nothing now
    weight.data = torch.full((16, 4), 2.0)  # a new storage, which may well land at the freed address
    torch.testing.assert_close(region(x, weight)[0], _matmul_then_sum(x, weight)[0])


def test_a_region_failing_on_a_hit_still_falls_back(monkeypatch):
    model = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="neuron")
    neuron_compile.reset_stats()
    with config.patch(cache_dir="off", fallback="silent"), torch.no_grad():
        compiled(x)  # compiles, checks the outputs once

        def lost(self, kernel, tensors):
            raise RuntimeError("device lost")

        monkeypatch.setattr(launcher.SimulatorLauncher, "launch", lost)
        torch.testing.assert_close(compiled(x), model(x))  # the hit's failure ran the region eagerly
        torch.testing.assert_close(compiled(x), model(x))
    counts = neuron_compile.stats()
    assert counts["region_run_failures"] == 1 and counts["cache_hits"] == 2


def test_int64_inputs_the_dispatch_key_bounds_are_narrowed_without_a_range_check(monkeypatch):
    trusted = _positions_passed_to(monkeypatch, "trust_values")

    def shifted(ids, x):
        return x + (ids % 7).to(torch.float32) * 0.5

    x = torch.randn(4, 16)
    small, huge = torch.randint(0, 50, (4, 16)), torch.full((4, 16), 2**40) + torch.arange(16)
    compiled = torch.compile(shifted, backend="neuron")
    with config.patch(cache_dir="off", fallback="silent"):
        for ids in (small, small, huge, huge, small):
            torch.testing.assert_close(compiled(ids, x), shifted(ids, x))
    # the small ids' graph trusts its int64 input (its key bounds it within +-2**20); the huge ids get another key,
    # whose region checks the narrowing, fails, and runs eagerly
    assert trusted == [[0], []]


def test_int32_bounds_are_trusted_only_for_guarded_graph_inputs_of_a_graph_without_in_place_ops():
    graph = torch.fx.Graph()
    ids, other = graph.placeholder("ids"), graph.placeholder("other")
    ids.meta[value_range.RANGE_KEY] = value_range.Interval(-2.0**20, 2.0**20)
    other.meta[value_range.RANGE_KEY] = value_range.Interval(-2.0**40, 2.0**40)
    region = graph.call_module("nki_region_0", (other, ids))
    graph.output(region)
    top = torch.fx.GraphModule({"nki_region_0": torch.nn.Identity()}, graph)
    assert compiled_graph.int32_bounded_inputs(top, region) == [1]
    with graph.inserting_before(region):
        graph.call_function(aten.copy_.default, (ids, other))  # an eager write could change the values
    assert compiled_graph.int32_bounded_inputs(top, region) == []


def test_empty_inputs_keep_one_view_per_dtype():
    views = stable_views.StableViews(1)
    slot = launch_plan.InputSlot("e", 0, False)
    first = views.view(0, torch.empty(0), slot)
    assert views.view(0, torch.empty(0, 3), slot) is first  # nothing is read: any empty view serves
    other = views.view(0, torch.empty(0, dtype=torch.bfloat16), slot)
    assert other is not first and other.dtype == torch.bfloat16 and other.numel() == 0


def _concatenated(x, e):
    return aten.cat.default([x, e]),


def test_an_empty_input_kept_by_identity_is_still_checked_for_its_dtype():
    x, empty = torch.randn(4, 16), torch.empty(0, 16)
    region = _region(_concatenated, x, empty)
    for _ in range(2):  # the second call serves the empty input's view by identity
        torch.testing.assert_close(region(x, empty)[0], x)
    empty.data = torch.empty(0, 16, dtype=torch.bfloat16)  # the same object, another dtype
    with pytest.raises(LoweringError, match="compiled for dtype"):  # refused before any view is taken
        region(x, empty)


def _two_halves(x):
    doubled = aten.mul.Tensor(x, 2.0)
    return aten.slice.Tensor(doubled, 0, 0, 2), aten.slice.Tensor(doubled, 0, 2, 4)


def test_outputs_of_one_buffer_do_not_share_a_version_counter():
    """An in-place op on one must not count as one on the other (autograd would refuse a saved one)."""
    x = torch.randn(4, 16)
    region = _region(_two_halves, x)
    for _ in range(2):
        first, second = region(x)
        assert first._is_view() is False and second._is_view() is False
        assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        before = second._version
        first.add_(1.0)
        assert second._version == before
        torch.testing.assert_close(second, x[2:] * 2)


def test_the_only_output_of_its_buffer_is_no_view_and_owns_its_memory_apart_from_the_next_call():
    x = torch.randn(4, 16)
    region = _region(lambda a: (aten.mul.Tensor(a, 3.0),), x)
    outputs = [region(x)[0] for _ in range(3)]
    for out in outputs:
        assert out._is_view() is False and out.shape == (4, 16)
    assert len({out.untyped_storage().data_ptr() for out in outputs}) == 3
    outputs[0].resize_(100)  # eager's outputs can be resized and written; the later ones are unaffected
    outputs[1].mul_(0)
    torch.testing.assert_close(outputs[2], x * 3)


def test_deferred_counts_are_added_when_read_and_dropped_by_a_reset(monkeypatch):
    neuron_compile.reset_stats()
    stats_module = compiled_graph.stats
    stats_module.count_hit()
    stats_module.count_launch("kernel", None)
    assert neuron_compile.stats()["cache_hits"] == 1 and neuron_compile.stats()["kernels_launched"] == 1
    stats_module.count_hit()
    neuron_compile.reset_stats()  # a hit counted before the reset belongs before it
    assert neuron_compile.stats()["cache_hits"] == 0
    monkeypatch.setattr(stats_module, "DEFERRED_KEPT", 3)
    for _ in range(3):
        stats_module.count_hit()
    assert stats_module.pending() == 0  # folded at the bound, not kept until read
    assert neuron_compile.stats()["cache_hits"] == 3
