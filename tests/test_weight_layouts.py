"""The layouts pass (which weights the matmuls want column-major) and the runtime's copies of them."""

from __future__ import annotations

import torch
from torch._functorch.aot_autograd import aot_module_simplified

import neuron_compile
from neuron_compile import config
from neuron_compile.passes.layouts import column_major_inputs
from neuron_compile.runtime.weight_layouts import ColumnMajorCopies


def _inference_graph(module, *inputs) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        def keep(graph, _):
            graphs.append(graph)
            return graph

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    with torch.no_grad():
        torch.compile(module, backend=backend)(*inputs)
    return graphs[0]


def _placeholder_shapes(gm, indices):
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    return sorted(tuple(placeholders[index].meta["val"].shape) for index in indices)


class TiedHead(torch.nn.Module):
    """An embedding whose weight is also the output projection's, beside a plain linear."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.mix = torch.nn.Linear(16, 24)
        self.back = torch.nn.Linear(24, 16, bias=False)

    def forward(self, ids):
        hidden = self.back(torch.relu(self.mix(self.embed(ids))))
        return hidden @ self.embed.weight.T


def test_the_weights_of_linears_are_chosen_and_a_tied_embedding_is_not():
    gm = _inference_graph(TiedHead(), torch.randint(0, 32, (2, 5)))
    chosen = column_major_inputs(gm)
    # mix.weight [24, 16] and back.weight [16, 24]; the tied [32, 16] weight is also gathered, so it keeps its layout
    assert _placeholder_shapes(gm, chosen) == [(16, 24), (24, 16)]


def test_a_weight_updated_in_the_graph_keeps_its_layout():
    def update_then_project(x, w):
        w.mul_(0.5)
        return x @ w.t()

    gm = _inference_graph(update_then_project, torch.randn(4, 8), torch.randn(6, 8))
    assert column_major_inputs(gm) == ()


def test_a_copy_is_made_once_per_version_and_storage():
    copies = ColumnMajorCopies()
    weight = torch.nn.Parameter(torch.randn(6, 8))
    first = copies.copy_of(weight)
    assert first.stride() == (1, 6) and torch.equal(first, weight)
    assert copies.copy_of(weight) is first
    with torch.no_grad():
        weight.mul_(2)  # an in-place update bumps the version counter
    second = copies.copy_of(weight)
    assert second is not first and torch.equal(second, weight)
    assert copies.owns(second) and not copies.owns(weight)
    first_id = id(first)
    del first  # the remade copy's predecessor is forgotten: an object that takes its id next is not a copy
    assert first_id not in copies._made
    weight.data = torch.randn(6, 8)  # a new storage, its own version counter
    assert torch.equal(copies.copy_of(weight), weight)
    activation = torch.randn(6, 8)
    assert copies.apply([activation, weight], (0, 1))[0] is activation  # only parameters are copied
    latest = copies.copy_of(weight)
    del weight, second
    assert len(copies) == 0  # a freed parameter frees its copy
    assert copies.owns(latest)  # the copy itself lives on while someone holds it
    latest_id = id(latest)
    del latest
    assert latest_id not in copies._made


def test_compiled_linears_read_the_copy_and_see_updates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 48, bias=False))
    x = torch.randn(40, 64)
    compiled = torch.compile(model, backend="neuron")
    neuron_compile.reset_stats()
    with config.patch(cache_dir="off", fallback="raise"), torch.no_grad():
        for step in range(3):
            with neuron_compile.record_launches() as launches:
                out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
            model[2].weight.mul_(-1.5)  # the next call must see it
        source = "\n".join(launch.source.source for launch in launches)
    counts = neuron_compile.stats()
    assert counts["weight_copies"] == 2 + 2  # both weights once, then the updated one on each of the next calls
    assert counts["cache_misses"] == 1 and counts["region_run_failures"] == 0
    # the weights come in with plain DMAs; only the activations (x and the GELU's output) are transposed
    assert source.count("nisa.dma_transpose(dst=moving") == 0 and source.count("nisa.dma_transpose") == 2

    with config.patch(cache_dir="off", fallback="raise", transposed_weights=False), torch.no_grad():
        with neuron_compile.record_launches() as launches:
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert "nisa.dma_transpose(dst=moving" in "\n".join(launch.source.source for launch in launches)


def test_training_graphs_keep_the_weights_as_given():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    x = torch.randn(8, 32)
    neuron_compile.reset_stats()
    with config.patch(cache_dir="off", fallback="raise"):
        out = torch.compile(model, backend="neuron")(x)
        out.sum().backward()
    assert neuron_compile.stats()["weight_copies"] == 0
    assert model.weight.grad is not None and model.weight.grad.shape == (16, 32)


class ConvolutionStack(torch.nn.Module):
    """A 3 x 3 convolution (a matmul: its weight is chosen), a depthwise one (a pointwise kernel: kept as given)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(6, 10, 3, padding=1)
        self.depthwise = torch.nn.Conv2d(10, 10, 3, padding=1, groups=10)

    def forward(self, x):
        return self.depthwise(torch.relu(self.conv(x)))


def test_a_convolution_weight_is_chosen_and_read_with_output_channels_innermost():
    torch.manual_seed(0)
    model, x = ConvolutionStack().eval(), torch.randn(1, 6, 7, 9)
    gm = _inference_graph(model, x)
    assert _placeholder_shapes(gm, column_major_inputs(gm)) == [(10, 6, 3, 3)]
    copy = ColumnMajorCopies().copy_of(model.conv.weight)
    assert copy.stride() == (1, 90, 30, 10) and torch.equal(copy, model.conv.weight)
    compiled = torch.compile(model, backend="neuron")
    neuron_compile.reset_stats()
    with config.patch(cache_dir="off", fallback="raise"), torch.no_grad():
        for _ in range(2):
            with neuron_compile.record_launches() as launches:
                out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
            model.conv.weight.mul_(-0.5)  # the next call must see it
    assert neuron_compile.stats()["weight_copies"] == 2
    source = "\n".join(launch.source.source for launch in launches)
    # a^T's rows (the output channels of one input channel and position) come in as contiguous runs
    assert "stationary[block][0:6, term * 1:term * 1 + 1, 0:rows], src=arg0_1.ap([[90, 6], [540, 1], [1, rows]]" \
        in source
