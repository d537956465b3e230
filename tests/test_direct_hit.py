"""The direct hit (runtime/direct_hit.py): once a one-region graph has settled, a hit goes straight to the region's
kernels with the flat arguments a memo keeps; every change that must invalidate them does, and each call gives
eager's answer: weights updated in place, replaced, restrided over the same memory, freed and regathered (FSDP2),
a bias read in place, new activations, blocks called in turn, inputs the region writes, and a failing region."""

from __future__ import annotations

import pytest
import torch
from hit_path_models import MLP

import neuron_compile
from neuron_compile import config
from neuron_compile.runtime import compiled_graph, region

SETTLING_CALLS = 4  # the plan's call, the first direct call (records its tensors), the memo's call, one served by it


@pytest.fixture(autouse=True)
def settings():
    with config.patch(cache_dir="off", fallback="raise"), torch.no_grad():
        yield


@pytest.fixture
def graphs(monkeypatch):
    """Every CompiledGraph called from now on."""
    seen, dispatch = [], compiled_graph.CompiledGraph.__call__

    def recording(self, args):
        if self not in seen:
            seen.append(self)
        return dispatch(self, args)

    monkeypatch.setattr(compiled_graph.CompiledGraph, "__call__", recording)
    return seen


@pytest.fixture
def prepared(monkeypatch):
    """One entry per region ``prepare`` from now on (the per-input work a memo skips)."""
    counted, prepare = [], region.CompiledRegion.prepare
    monkeypatch.setattr(region.CompiledRegion, "prepare", lambda self, tensors: counted.append(1) or prepare(self, tensors))
    return counted


def settle(compiled, model, make_input, graphs) -> None:
    """Call ``compiled`` until its memo serves, each time with a new input, checking eager's answer."""
    for _ in range(SETTLING_CALLS):
        x = make_input()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    assert graph.hit_plan.direct is not None and graph.hit_plan.direct.memos  # the path under test is taken


def test_a_settled_graph_runs_from_its_memo_on_new_inputs(graphs, prepared):
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = torch.compile(model, backend="neuron")
    settle(compiled, model, lambda: torch.randn(12, 16), graphs)
    del prepared[:]
    neuron_compile.reset_stats()
    for _ in range(3):
        x = torch.randn(12, 16)  # an activation new on every call
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert prepared == [] and neuron_compile.stats()["cache_hits"] == 3


UPDATES = {
    "in place (version)": lambda model: model.up.weight.mul_(-2.0),
    "another storage": lambda model: setattr(model.up.weight, "data", torch.randn(24, 16)),
    "other strides, same memory": lambda model: setattr(
        model.up.weight, "data", model.up.weight.data.t().contiguous().t()),
    "a bias read in place": lambda model: model.down.bias.add_(1.0),
    "a bias replaced": lambda model: setattr(model.down.bias, "data", torch.randn(8)),
    "freed and regathered": lambda model: (model.down.weight.untyped_storage().resize_(0),
                                           model.down.weight.untyped_storage().resize_(24 * 8 * 4),
                                           model.down.weight.normal_()),
}


@pytest.mark.parametrize("update", UPDATES, ids=list(UPDATES))
def test_a_weight_change_after_the_memo_is_read_anew(graphs, update):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    settle(compiled, model, lambda: x, graphs)
    UPDATES[update](model)
    for _ in range(SETTLING_CALLS):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_an_activation_written_in_place_between_calls_is_read_anew(graphs):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    settle(compiled, model, lambda: x, graphs)  # the same tensor on every call: a stable argument
    for _ in range(3):
        x.mul_(-1.5)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_blocks_called_in_turn_keep_a_memo_each(graphs, prepared):
    """As diffusers' regional compile calls one compiled block class with each block's weights in turn."""
    torch.manual_seed(0)
    blocks, x = [MLP().eval() for _ in range(3)], torch.randn(12, 16)
    forward = torch.compile(lambda block, inputs: block(inputs), backend="neuron")
    for _ in range(SETTLING_CALLS):
        for block in blocks:
            torch.testing.assert_close(forward(block, x), block(x), rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    assert len(graph.hit_plan.direct.memos) == len(blocks)
    del prepared[:]
    for block in blocks:
        torch.testing.assert_close(forward(block, x), block(x), rtol=1e-5, atol=1e-5)
    assert prepared == []
    blocks[1].up.weight.mul_(3.0)
    for block in blocks + blocks:
        torch.testing.assert_close(forward(block, x), block(x), rtol=1e-5, atol=1e-5)


def test_outputs_are_fresh_tensors_of_their_own(graphs):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    settle(compiled, model, lambda: x, graphs)
    expected = model(x)
    first, second = compiled(x), compiled(x)
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert not first._is_view() and first._version == 0
    first.mul_(-7.0).add_(1.0)
    first.resize_(3)
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


def test_an_input_the_region_writes_is_written_on_every_direct_call(graphs):
    def write_row(cache, rows, index):
        cache.index_copy_(0, index, rows)
        return cache.sum(0) * 2.0

    torch.manual_seed(0)
    compiled = torch.compile(write_row, backend="neuron")
    cache, expected_cache = torch.zeros(16, 8), torch.zeros(16, 8)
    for step in range(2 * SETTLING_CALLS):
        rows, index = torch.randn(1, 8), torch.tensor([step])
        torch.testing.assert_close(compiled(cache, rows, index), write_row(expected_cache, rows, index))
        torch.testing.assert_close(cache, expected_cache)
    (graph,) = graphs
    assert graph.hit_plan.direct is not None and graph.hit_plan.direct.memos


def test_a_region_failing_on_the_direct_path_falls_back_to_eager(graphs, monkeypatch):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(12, 16)
    compiled = torch.compile(model, backend="neuron")
    settle(compiled, model, lambda: x, graphs)

    def failing(self, tensors, arguments, validate=None):
        raise RuntimeError("a launch failed")

    monkeypatch.setattr(region.CompiledRegion, "finish", failing)
    neuron_compile.reset_stats()
    with config.patch(fallback="silent"):
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert neuron_compile.stats()["region_run_failures"] == 1  # the second call runs eagerly without trying


def test_a_graph_with_an_eager_op_takes_no_direct_path(graphs):
    def partly_eager(x):
        return torch.special.zeta(x.abs() + 2.0, torch.tensor(3.0)) + x.sin()

    x = torch.rand(8, 8)
    compiled = torch.compile(partly_eager, backend="neuron")
    with config.patch(fallback="silent"):
        for _ in range(SETTLING_CALLS):
            torch.testing.assert_close(compiled(x), partly_eager(x), rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    assert graph.hit_plan.direct is None
