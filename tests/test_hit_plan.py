"""The hit plan (runtime/hit_plan.py): a call like the previous one skips the dispatch key, and every part of the key
it no longer builds is still enforced, by the plan itself (tested on our CompiledGraph alone, below Dynamo's guards)
and end to end through torch.compile: another storage offset, strides, dtype, value bound, a tensor in two
positions, weights updated or replaced, in-place ops on returned tensors; each gives eager's answer."""

from __future__ import annotations

import pytest
import torch
from hit_path_models import MLP

import neuron_compile
from neuron_compile import config
from neuron_compile.errors import NeuronCompileError
from neuron_compile.runtime import compiled_graph, launch_plan
from neuron_compile.runtime.hit_plan import HitPlan


@pytest.fixture(autouse=True)
def settings():
    with config.patch(cache_dir="off", fallback="raise"), torch.no_grad():
        yield


def _graph_calls(monkeypatch, compiled, *inputs) -> list[tuple[compiled_graph.CompiledGraph, list]]:
    """Run ``compiled`` twice (compile, then a hit); the CompiledGraph calls of the second run, with their args."""
    calls = []
    dispatch = compiled_graph.CompiledGraph.__call__
    compiled(*inputs)
    monkeypatch.setattr(compiled_graph.CompiledGraph, "__call__",
                        lambda self, args: calls.append((self, list(args))) or dispatch(self, args))
    compiled(*inputs)
    monkeypatch.setattr(compiled_graph.CompiledGraph, "__call__", dispatch)
    return calls


def _lookups(monkeypatch) -> list[int]:
    """One entry per ``CompiledGraph.lookup`` from now on (the dispatch key built and looked up)."""
    counted, lookup = [], compiled_graph.CompiledGraph.lookup
    monkeypatch.setattr(compiled_graph.CompiledGraph, "lookup",
                        lambda self, *args: counted.append(1) or lookup(self, *args))
    return counted


def _mlp_graph(monkeypatch):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    (graph, args), = _graph_calls(monkeypatch, torch.compile(model, backend="neuron"), x)
    return model, x, graph, args


def test_a_call_like_the_last_skips_the_key_and_gives_the_same_answer(monkeypatch):
    model, x, graph, args = _mlp_graph(monkeypatch)
    lookups = _lookups(monkeypatch)
    neuron_compile.reset_stats()
    for _ in range(3):
        torch.testing.assert_close(graph(list(args))[0], model(x), rtol=1e-5, atol=1e-5)
    assert graph.hit_plan is not None and lookups == []
    assert neuron_compile.stats()["cache_hits"] == 3


@pytest.mark.parametrize("change", ["storage offset", "strides", "requires_grad", "shape"])
def test_a_call_with_other_metadata_misses_the_plan_and_gets_its_own_entry(monkeypatch, change):
    model, x, graph, args = _mlp_graph(monkeypatch)
    wide = torch.randn(13, 16)
    other = {
        "storage offset": wide[1:],  # the same shape and strides, one row into its storage
        "strides": x.t().contiguous().t(),
        "requires_grad": x.clone().requires_grad_(),
        "shape": torch.randn(5, 16),
    }[change]
    called = [other if arg is x else arg for arg in args]
    lookups = _lookups(monkeypatch)
    got = graph(called)[0]
    assert lookups == [1]  # the plan refused the call: its key was built and looked up
    torch.testing.assert_close(got, model(other), rtol=1e-5, atol=1e-5)


def test_a_call_in_another_dtype_misses_the_plan_and_never_runs_the_fp32_kernels(monkeypatch):
    model, x, graph, args = _mlp_graph(monkeypatch)
    lookups = _lookups(monkeypatch)
    # An ATen graph is traced for its dtypes (Dynamo guards them and traces again): called with others, its region
    # refuses them by name, never reinterprets them.
    with pytest.raises(NeuronCompileError, match="compiled for dtype float32, called with torch.bfloat16"):
        graph([arg.detach().to(torch.bfloat16) for arg in args])
    assert lookups == [1]


def test_a_model_converted_to_another_dtype_gets_eager_s_answer():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    model.to(torch.bfloat16)  # each parameter's .data replaced
    for _ in range(2):
        got = compiled(x.to(torch.bfloat16))
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, model(x.to(torch.bfloat16)), rtol=2e-2, atol=2e-2)


def test_one_tensor_in_two_positions_makes_no_plan(monkeypatch):
    model, x, graph, args = _mlp_graph(monkeypatch)
    weights = [position for position, arg in enumerate(args) if isinstance(arg, torch.nn.Parameter)]
    twice = list(args)
    twice[weights[0]] = twice[weights[1]] = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
    assert HitPlan.of(graph.hit_plan.config, twice, twice, None, frozenset()) is None
    assert graph(list(args)) is not None and graph.hit_plan is not None  # the usual call makes one again


def test_a_weight_replaced_with_other_strides_over_the_same_memory_is_seen():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(16, 16, bias=False), torch.randn(8, 16)
    model.weight.data = torch.randn(16, 32)[:, :16]  # rows 32 apart in memory
    compiled = torch.compile(model, backend="neuron")
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    # The same data pointer and version counter, other strides: Dynamo does not re-check a parameter whose module
    # is unchanged, so only our key (and the copy's stamp) can see it.
    model.weight.data = model.weight.data.as_strided((16, 16), (16, 1))
    for _ in range(2):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_weight_at_another_storage_offset_is_seen():
    torch.manual_seed(0)
    storage = torch.randn(20, 16)
    model, x = torch.nn.Linear(16, 16, bias=False), torch.randn(8, 16)
    model.weight.data = storage[:16]
    compiled = torch.compile(model, backend="neuron")
    for start in (0, 0, 4, 4, 0):
        model.weight.data = storage[start:start + 16]
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_weights_updated_in_place_or_replaced_are_read_anew():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    updates = [
        lambda: model.up.weight.mul_(-2.0),  # the version counter moves
        lambda: setattr(model.up.weight, "data", torch.randn(24, 16)),  # another storage, its own counter
        lambda: model.down.weight.untyped_storage().resize_(0),  # FSDP2 frees the memory ...
        lambda: (model.down.weight.untyped_storage().resize_(24 * 8 * 4), model.down.weight.normal_()),  # regathers
    ]
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    for update in updates:
        update()
        if model.down.weight.untyped_storage().nbytes() == 0:
            continue  # freed: nothing can run
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_two_modules_sharing_one_graph_keep_their_own_copies_and_views(monkeypatch):
    """As diffusers' regional compile calls one compiled block class with each block's weights in turn."""
    torch.manual_seed(0)
    first, second = MLP().eval(), MLP().eval()
    x = torch.randn(12, 16)
    forward = torch.compile(lambda module, inputs: module(inputs), backend="neuron")
    neuron_compile.reset_stats()
    for _ in range(2):
        for module in (first, second):
            torch.testing.assert_close(forward(module, x), module(x), rtol=1e-5, atol=1e-5)
    views_made, flat_argument = [], launch_plan.flat_argument
    monkeypatch.setattr(launch_plan, "flat_argument", lambda *args: views_made.append(1) or flat_argument(*args))
    for _ in range(2):
        for module in (first, second):
            torch.testing.assert_close(forward(module, x), module(x), rtol=1e-5, atol=1e-5)
    assert neuron_compile.stats()["weight_copies"] == 4  # two weights per module, each copied once
    assert views_made == []  # every weight, copy and bias of both modules read through a kept view
    first.up.weight.mul_(-1.0)  # one module's weight changes: its copy is made again, the other's is kept
    second.down.bias.add_(1.0)  # a bias read in place: its kept view sees the new values
    for module in (first, second, first):
        torch.testing.assert_close(forward(module, x), module(x), rtol=1e-5, atol=1e-5)
    assert neuron_compile.stats()["weight_copies"] == 5


def test_in_place_ops_on_returned_tensors_change_nothing_the_next_call_reads():
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    expected = model(x)
    outputs = [compiled(x) for _ in range(3)]
    for out in outputs:
        out.mul_(-7.0).add_(1.0)
        out.resize_(3)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


def test_integer_bounds_are_recomputed_on_every_call():
    def shifted(ids, x):
        return x + (ids % 7).to(torch.float32) * 0.5

    x = torch.randn(4, 16)
    small, huge = torch.randint(0, 50, (4, 16)), torch.full((4, 16), 2**40) + torch.arange(16)
    values = small.clone()  # one tensor, its values changed in place: its metadata never changes
    compiled = torch.compile(shifted, backend="neuron")
    with config.patch(fallback="silent"):  # int64 values beyond int32 cannot enter a kernel: that region runs eagerly
        for ids in (small, small, huge, huge, small):
            values.copy_(ids)
            # the small ids' kernels narrow int64 to int32 unchecked (their key bounds the values): reused for the
            # huge ones, they would wrap
            torch.testing.assert_close(compiled(values, x), shifted(values, x))


def test_float_bounds_are_recomputed_on_every_call():
    def rotate(x, frequencies):
        return x * torch.cos(frequencies) + torch.sin(frequencies)

    torch.manual_seed(0)
    x, base = torch.randn(4, 16), torch.rand(16)
    frequencies = base.clone()
    compiled = torch.compile(rotate, backend="neuron")
    for scale in (1.0, 1.0, 3e5, 3e5, 1.0):
        frequencies.copy_(base * scale)  # another binade: the float guard's class moves
        torch.testing.assert_close(compiled(x, frequencies), rotate(x, frequencies), rtol=1e-4, atol=1e-4)
