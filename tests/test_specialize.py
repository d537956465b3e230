"""passes/specialize: a symbolic ATen graph becomes the same graph with this call's concrete shapes."""

import collections

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile.passes.specialize import is_dynamic, specialize


def aten_ops(gm):
    """The tensor ops of a graph (sym_size reads a symbol; specialization folds it away on purpose)."""
    return collections.Counter(
        str(node.target)
        for node in gm.graph.nodes
        if node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target is not torch.ops.aten.sym_size.int
    )


def reshape_and_reduce(x, w):
    rows = x.shape[0]
    folded = x.reshape(rows * 2, -1)  # SymInt arithmetic in the graph
    return (folded @ w).softmax(-1) * rows


def test_static_graph_is_returned_unchanged():
    x, w = torch.randn(4, 6), torch.randn(3, 5)
    gm = make_fx(reshape_and_reduce, tracing_mode="fake")(x, w)
    assert not is_dynamic(gm)
    assert specialize(gm, [x, w]) is gm


def test_symbolic_graph_is_specialized_to_each_call():
    gm = make_fx(reshape_and_reduce, tracing_mode="symbolic")(torch.randn(4, 6), torch.randn(3, 5))
    assert is_dynamic(gm)
    for rows in (2, 7):
        x, w = torch.randn(rows, 6), torch.randn(3, 5)
        specialized = specialize(gm, [x, w])
        assert not is_dynamic(specialized)
        assert aten_ops(specialized) == aten_ops(gm)  # the same ATen ops, only the symbols are gone
        values = [node.meta["val"] for node in specialized.graph.nodes if node.op != "output"]
        assert all(type(dim) is int for value in values for dim in value.shape)
        output = specialized.graph.output_node().args[0]  # make_fx of a single-tensor function: one node
        assert tuple(output.meta["val"].shape) == (rows * 2, 5)
        torch.testing.assert_close(specialized(x, w), reshape_and_reduce(x, w), rtol=0, atol=0)


def test_inputs_that_require_grad_add_no_nodes():
    gm = make_fx(lambda a, b: a * b + 1, tracing_mode="symbolic")(torch.randn(3), torch.randn(3))
    weight = torch.randn(5, requires_grad=True)
    specialized = specialize(gm, [torch.randn(5), weight])
    assert aten_ops(specialized) == aten_ops(gm)


def test_an_in_place_metadata_change_leaves_earlier_records_as_they_were():
    def transpose_a_copy(x):
        copy = torch.ops.aten.clone.default(x)
        torch.ops.aten.t_.default(copy)  # changes the copy's shape after the clone node recorded it
        return (copy,)

    gm = make_fx(transpose_a_copy)(torch.randn(4, 6))
    column_major = torch.randn(6, 4).t()  # the traced shape with other strides: specialize propagates
    specialized = specialize(gm, [column_major])
    clone = next(node for node in specialized.graph.nodes if node.target is torch.ops.aten.clone.default)
    assert tuple(clone.meta["val"].shape) == (4, 6)
    assert tuple(specialized(column_major)[0].shape) == (6, 4)


def test_a_graph_mutating_only_data_records_without_snapshots():
    def add_into(x, y):
        torch.ops.aten.copy_.default(x, torch.ops.aten.add.Tensor(x, y))
        return (torch.ops.aten.mul.Tensor(x, 2.0),)

    gm = make_fx(add_into)(torch.randn(4, 6), torch.randn(4, 6))
    x, y = torch.randn(6, 4).t(), torch.randn(4, 6)
    specialized = specialize(gm, [x.clone(), y])
    expected = (x + y) * 2.0
    torch.testing.assert_close(specialized(x, y)[0], expected)
    assert all(tuple(node.meta["val"].shape) == (4, 6) for node in specialized.graph.nodes
               if node.op == "call_function")


def eager_metadata(gm, args) -> dict:
    """Per node of ``gm``, the sizes, strides, storage offset and dtype of what eager computes for ``args``."""
    found = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node.op != "output":
                found[node.name] = metadata(result)
            return result

    Recorder(gm).run(*args)
    return found


def metadata(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.storage_offset(), value.dtype
    if isinstance(value, list | tuple):
        return tuple(metadata(item) for item in value)
    return value


def column_major(tensor):
    return tensor.t().contiguous().t()


def linear_then_rows(x, w, b):
    """``linear`` as aot_autograd writes it, then a row reduction of a pointwise chain."""
    hidden = torch.ops.aten.addmm.default(b, x, torch.ops.aten.t.default(w))
    return (torch.ops.aten.sum.dim_IntList(torch.ops.aten.relu.default(hidden), [1]),)


def scaled_columns(x, y):
    """Pointwise ops follow their input's layout, so a column-major ``x`` changes every node down to the sum."""
    scaled = torch.ops.aten.add.Tensor(torch.ops.aten.mul.Tensor(x, 2.0), y)
    return (torch.ops.aten.sum.dim_IntList(scaled, [0]), scaled)


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129]), inner=st.sampled_from([2, 33, 128]),
       outer=st.sampled_from([2, 129]))
def test_other_strides_rerun_only_the_nodes_they_change(rows, inner, outer):
    x, w, b = torch.randn(rows, inner), torch.randn(outer, inner), torch.randn(outer)
    gm = make_fx(linear_then_rows, tracing_mode="fake")(x, w, b)
    traced = {node.name: node.meta["val"] for node in gm.graph.nodes if node.op != "output"}
    args = [x, column_major(w), b]
    specialized = specialize(gm, args)
    assert specialized is not gm
    values = {node.name: node.meta["val"] for node in specialized.graph.nodes if node.op != "output"}
    assert {name: metadata(value) for name, value in values.items()} == eager_metadata(gm, args)
    # the weight and its transpose ran again; the matmul's result is row-major either way, so nothing after it did
    rerun = {name for name, value in values.items() if value is not traced[name]}
    assert rerun == {"w_1", "t"}
    assert len({value.fake_mode for value in values.values()}) == 1  # one fake mode, as later passes need
    assert all(value is traced[name] for name, value in
               ((node.name, node.meta["val"]) for node in gm.graph.nodes if node.op != "output"))  # gm untouched
    torch.testing.assert_close(specialized(*args), linear_then_rows(*args), rtol=0, atol=0)


@settings(max_examples=4, deadline=None)
@given(rows=st.sampled_from([2, 127, 129]), columns=st.sampled_from([3, 128]))
def test_a_layout_that_pointwise_ops_carry_reruns_them_all(rows, columns):
    x, y = torch.randn(rows, columns), torch.randn(rows, columns)
    gm = make_fx(scaled_columns, tracing_mode="fake")(x, y)
    args = [column_major(x), y]
    specialized = specialize(gm, args)
    values = {node.name: node.meta["val"] for node in specialized.graph.nodes if node.op != "output"}
    assert {name: metadata(value) for name, value in values.items()} == eager_metadata(gm, args)
    assert all(isinstance(value, FakeTensor) for value in values.values())
    torch.testing.assert_close(specialized(*args), scaled_columns(*args), rtol=0, atol=0)
