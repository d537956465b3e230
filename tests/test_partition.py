"""passes/partition: regions vs eager nodes, reasons, purity, and that the partitioned graph computes the same."""


import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from random_programs import programs, run_program
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile.passes.partition import REGION_PREFIX, partition_graph

aten = torch.ops.aten


def supporting(*ops):
    """An unsupported_reason that accepts exactly ``ops`` (OpOverloadPackets or OpOverloads)."""

    def unsupported_reason(node):
        target = node.target
        packet = getattr(target, "overloadpacket", target)
        return None if (target in ops or packet in ops) else f"no lowering for {target}"

    return unsupported_reason


def aten_graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def regions_of(gm):
    return [name for name, _ in gm.named_children() if name.startswith(REGION_PREFIX)]


def test_everything_supported_is_one_region():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = aten_graph(lambda a, b: torch.relu(a * b + a), x, y)
    result = partition_graph(gm, unsupported_reason=supporting(aten.mul, aten.add, aten.relu))
    assert regions_of(result.graph_module) == ["nki_region_0"]
    assert result.report.eager == ()
    assert [p.op for p in result.report.regions["nki_region_0"]] == [
        "aten.mul.Tensor",
        "aten.add.Tensor",
        "aten.relu.default",
    ]
    torch.testing.assert_close(result.graph_module(x, y), gm(x, y), rtol=0, atol=0)


def test_unsupported_node_splits_regions_and_names_its_reason():
    x = torch.randn(4, 8)
    gm = aten_graph(lambda a: torch.sort(torch.exp(a) + 1, dim=-1).values * 2, x)
    result = partition_graph(gm, unsupported_reason=supporting(aten.exp, aten.add, aten.mul))
    assert regions_of(result.graph_module) == ["nki_region_0", "nki_region_1"]
    eager = {p.op: p.reason for p in result.report.eager}
    assert eager["aten.sort.default"] == "no lowering for aten.sort.default"
    assert eager["getitem"] == "its producer runs eagerly"
    text = str(result.report)
    assert text.startswith("2 NKI region(s), 3 eager node(s)")  # sort + its two getitems
    assert "eager: no lowering for aten.sort.default" in text
    torch.testing.assert_close(result.graph_module(x), gm(x), rtol=0, atol=0)
    # The partitioned graph is topologically sorted: every node's inputs come before it.
    seen = set()
    for node in result.graph_module.graph.nodes:
        assert all(arg in seen for arg in node.all_input_nodes)
        seen.add(node)


def test_getitem_follows_its_producer_into_the_region():
    x, weight = torch.randn(4, 8), torch.randn(8)
    gm = aten_graph(lambda a, w: aten.native_layer_norm(a, [8], w, None, 1e-5)[0] + 1, x, weight)
    result = partition_graph(gm, unsupported_reason=supporting(aten.native_layer_norm, aten.add))
    getitems = [p for p in result.report.placements if p.op == "getitem"]
    assert getitems and all(p.region == "nki_region_0" for p in getitems)
    torch.testing.assert_close(result.graph_module(x, weight), gm(x, weight), rtol=0, atol=0)


def test_in_place_mutation_stays_eager_even_if_supported():
    def mutate(a):
        a.add_(1)
        return a * 2

    x = torch.randn(3)
    gm = make_fx(mutate, tracing_mode="fake")(x)
    result = partition_graph(gm, unsupported_reason=lambda node: None)
    mutations = [p for p in result.report.eager if p.op == "aten.add_.Tensor"]
    assert mutations and "mutates its input in place" in mutations[0].reason
    expected, got = x.clone(), x.clone()
    torch.testing.assert_close(result.graph_module(got), mutate(expected), rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_input_graph_is_not_modified():
    gm = aten_graph(lambda a: torch.tanh(a) * 3, torch.randn(2, 2))
    before = str(gm.graph)
    partition_graph(gm, unsupported_reason=supporting(aten.tanh, aten.mul))
    assert str(gm.graph) == before and not regions_of(gm)


def test_a_raising_predicate_makes_the_node_eager():
    def broken(node):
        raise KeyError("oops")

    gm = aten_graph(lambda a: a + 1, torch.randn(2))
    result = partition_graph(gm, unsupported_reason=broken)
    assert result.report.eager[0].reason == "unsupported_reason raised KeyError: 'oops'"


@settings(max_examples=20, deadline=None)
@given(
    program=programs(max_size=8),
    supported=st.sets(st.sampled_from(["exp", "tanh", "relu", "neg", "sigmoid", "add", "mul", "sub"])),
)
def test_random_graphs_partition_without_changing_results(program, supported):
    """Any support pattern over a random DAG gives an acyclic partitioned graph that computes the same."""

    def fn(a, b):
        values = run_program(program, a, b)
        return values[-1], values[len(values) // 2]

    x, y = torch.randn(3, 5), torch.randn(3, 5)
    gm = aten_graph(fn, x, y)
    result = partition_graph(gm, unsupported_reason=supporting(*(getattr(aten, name) for name in supported)))
    placed = {p.node for p in result.report.placements if p.region is not None}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert (node.name in placed) == (node.target.overloadpacket.__name__ in supported)
    torch.testing.assert_close(result.graph_module(x, y), gm(x, y), rtol=0, atol=0)


def test_copy_into_an_input_read_outside_its_region_stays_eager():
    # The region writes the input after its kernels; a reader left eager could run after it and see the new value.
    import neuron_compile.passes.partition as partition_module

    graph = torch.fx.Graph()
    stats, x = graph.placeholder("stats"), graph.placeholder("x")
    stats.meta["val"], x.meta["val"] = torch.zeros(4), torch.zeros(4)
    read = graph.call_function(torch.ops.aten.cos.default, (stats,))
    read.meta["val"] = torch.zeros(4)
    new = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    new.meta["val"] = torch.zeros(4)
    write = graph.call_function(torch.ops.aten.copy_.default, (stats, new))
    write.meta["val"] = torch.zeros(4)
    graph.output((read,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    def reason(node):
        return "test: cos is eager" if node.target is torch.ops.aten.cos.default else None

    result = partition_module.partition_graph(gm, unsupported_reason=reason)
    placement = {p.node: p for p in result.report.placements}
    assert placement[write.name].region is None and "read outside" in placement[write.name].reason
    assert placement[new.name].region is not None
    # With the reader in a region too, the write joins it.
    result = partition_module.partition_graph(gm, unsupported_reason=lambda node: None)
    placement = {p.node: p for p in result.report.placements}
    assert placement[write.name].region == placement[read.name].region is not None


def test_placements_carry_matmul_flops_in_kernels_and_eager():
    """Each mm / bmm node's FLOPs (2 * M * N * K) are on its placement, in a region or eager."""
    x, w, b = torch.randn(3, 5), torch.randn(5, 7), torch.randn(2, 7, 4)
    gm = aten_graph(lambda a, m, c: torch.bmm(torch.mm(a, m).relu().expand(2, 3, 7), c), x, w, b)
    result = partition_graph(gm, unsupported_reason=supporting(aten.mm, aten.relu, aten.expand))
    flops = {p.op: p.flops for p in result.report.placements}
    assert flops["aten.mm.default"] == 2 * 3 * 7 * 5
    assert flops["aten.bmm.default"] == 2 * 2 * 3 * 4 * 7
    assert flops["aten.relu.default"] == 0
    eager = {p.op: p.flops for p in result.report.eager}
    assert eager == {"aten.bmm.default": 2 * 2 * 3 * 4 * 7}
