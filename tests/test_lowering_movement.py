"""Movement lowerings: views cost no kernel (they become access patterns), copies are kernels; vs eager."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch._subclasses.fake_tensor import FakeTensorMode

from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile.lowering import unsupported_reason


def test_views_of_inputs_need_no_kernel_and_keep_eager_strides():
    x = random_tensor((4, 6, 8))

    def views(x):
        return x.permute(2, 0, 1), x[1:3, ::2], x.select(1, 2), x.unsqueeze(0), x.view(24, 8), x[:, :1].squeeze(1)

    region, outputs = compile_and_run(views, x)
    assert region.kernels == [] and region.nki_nodes >= 6
    check_against_eager(views, x)
    # A view of an input is still a view of it: it shares the input's storage.
    assert outputs[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


VIEW_CHAINS = {
    "transpose": lambda x: x.transpose(0, -1),
    "slice": lambda x: x[..., 1:],
    "step_slice": lambda x: x[::2],
    "select": lambda x: x.select(0, x.shape[0] - 1).unsqueeze(0),
    "expand": lambda x: x[:1].expand(x.shape),
    "flip_dims": lambda x: x.permute(*reversed(range(x.dim()))).contiguous().permute(*reversed(range(x.dim()))),
}


@st.composite
def shapes(draw):
    rank = draw(st.integers(2, 5))
    sizes = st.sampled_from([2, 3, 5, 129]) if rank <= 2 else st.sampled_from([2, 3, 5])
    return tuple(draw(sizes) for _ in range(rank))


@settings(max_examples=20, deadline=None)
@given(shape=shapes(), name=st.sampled_from(sorted(VIEW_CHAINS)), dtype=st.sampled_from([torch.float32,
                                                                                         torch.bfloat16]))
def test_views_feeding_pointwise_read_through_access_patterns(shape, name, dtype):
    x = random_tensor(shape, dtype)
    check_against_eager(lambda x: (VIEW_CHAINS[name](x) * 2 + 1, VIEW_CHAINS[name](x)), x)


def test_clone_of_a_permute_is_one_copy_kernel_with_contiguous_output():
    x = random_tensor((129, 70))
    region, _ = compile_and_run(lambda x: x.t().contiguous(), x)
    assert len(region.kernels) == 1
    check_against_eager(lambda x: x.t().contiguous(), x)


def test_reshape_of_a_kernel_output_is_free():
    x = random_tensor((6, 20))
    region, _ = compile_and_run(lambda x: (x * 2).reshape(3, 40).sum(0), x)
    check_against_eager(lambda x: (x * 2).reshape(3, 40).sum(0), x)


def test_reshape_needing_a_copy_is_unsupported():
    # Tracing decomposes reshape into clone + _unsafe_view; a raw aten.reshape of a transposed tensor may copy.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    reshape = graph.call_function(torch.ops.aten.reshape.default, (x, [-1]))
    with FakeTensorMode():
        x.meta["val"] = torch.empty(3, 4).t()
        reshape.meta["val"] = x.meta["val"].reshape(-1)
    assert "needs a copy" in unsupported_reason(reshape)


@settings(max_examples=15, deadline=None)
@given(shape=shapes(), pieces=st.integers(1, 3), data=st.data(), dtype=st.sampled_from([torch.float32,
                                                                                         torch.bfloat16]))
def test_cat_matches_eager(shape, pieces, data, dtype):
    dim = data.draw(st.integers(0, len(shape) - 1))
    tensors = []
    for index in range(pieces):
        piece = list(shape)
        piece[dim] = data.draw(st.sampled_from([1, 2, 3]))
        tensors.append(random_tensor(tuple(piece), dtype, seed=index))
    check_against_eager(lambda *parts: torch.cat([part * 2 for part in parts], dim), *tensors)


def test_cat_of_views_is_one_kernel():
    x = random_tensor((130, 6))
    region, _ = compile_and_run(lambda x: torch.cat([x[:, :2], x.t()[:3].t(), x], 1), x)
    assert len(region.kernels) == 1
    check_against_eager(lambda x: torch.cat([x[:, :2], x.t()[:3].t(), x], 1), x)


def test_cat_skips_an_empty_cache():
    past, new = random_tensor((2, 0, 8)), random_tensor((2, 3, 8))
    check_against_eager(lambda past, new: torch.cat([past, new], 1), past, new)


def test_inputs_with_a_storage_offset():
    whole = random_tensor((10, 12))
    x = whole[3:, 2:]  # storage offset 38, row stride 12
    region, outputs = compile_and_run(lambda x: (x[1:, 1:], x * 2, x.t()[2]), x)
    check_against_eager(lambda x: (x[1:, 1:], x * 2, x.t()[2]), x)
    assert outputs[0].storage_offset() == x[1:, 1:].storage_offset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_chunk_unbind_are_views_and_unbind_copy_copies(dtype):
    x = random_tensor((6, 129), dtype)
    region, _ = compile_and_run(lambda x: torch.split(x, [1, 2, 3], 0), x)
    assert region.kernels == []  # every piece is a view of the input
    check_against_eager(lambda x: [t * 2 for t in torch.split(x, 50, 1)], x)
    check_against_eager(lambda x: [t + 1 for t in torch.split(x, [1, 2, 3], -2)], x)
    check_against_eager(lambda x: [t + 1 for t in torch.chunk(x.t(), 4, -1)], x)
    y = random_tensor((3, 4, 5), dtype)
    check_against_eager(lambda y: [t * 3 for t in torch.unbind(y.permute(2, 0, 1), -1)], y)
    check_against_eager(lambda y: torch.unbind_copy(y.transpose(0, 2), 1), y)


@pytest.mark.parametrize("offset", [0, 2, -1, -3, 7])
@pytest.mark.parametrize("dim1, dim2", [(0, 1), (1, 2), (2, 0), (-1, -2)])
def test_diagonal_is_a_view_with_summed_strides(offset, dim1, dim2):
    y = random_tensor((3, 7, 5))
    region, _ = compile_and_run(lambda y: y.diagonal(offset, dim1, dim2), y)
    assert region.kernels == []
    check_against_eager(lambda y: y.diagonal(offset, dim1, dim2) * 1.5, y)
    check_against_eager(lambda y: y.permute(2, 0, 1).diagonal(offset, dim1, dim2) * 1.5, y)


def test_trace_and_diagonal_of_a_large_matrix():
    x = random_tensor((129, 130), torch.bfloat16)
    check_against_eager(lambda x: (torch.trace(x.float()), torch.diagonal(x, 1).float() + 1), x)


def test_diagonal_of_a_1d_tensor_is_an_unsupported_reason():
    with FakeTensorMode():
        graph = torch.fx.Graph()
        source = graph.placeholder("x")
        source.meta["val"] = torch.empty(5)
        node = graph.call_function(torch.ops.aten.diagonal.default, (source,))
        node.meta["val"] = torch.empty(5)
    assert "fewer than 2 dims" in unsupported_reason(node)


def test_lift_fresh_copy_is_a_copy_kernel():
    # Dynamo hands constants (masked.* ops' torch.tensor) in as graph inputs: lift_fresh_copy of an input.
    from neuron_compile.pipeline import compile_region

    graph = torch.fx.Graph()
    source = graph.placeholder("x")
    copy = graph.call_function(torch.ops.aten.lift_fresh_copy.default, (source,))
    graph.output((copy,))
    x = random_tensor((129, 3))
    with FakeTensorMode() as mode:
        source.meta["val"] = mode.from_tensor(x)
        copy.meta["val"] = torch.ops.aten.lift_fresh_copy.default(source.meta["val"])
    region = compile_region(torch.fx.GraphModule({}, graph), [x])
    (out,) = region(x)
    assert len(region.kernels) == 1 and out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(out, x, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, dims", [((129,), (0,)), ((5, 129), (1,)), ((130, 7), (0, 1)), ((2, 3, 4), (-1, 0)),
                                         ((1, 3), (0,)), ((2, 1, 3, 2, 2), (1, 3, 4))])
def test_flip_reads_backwards_through_negative_strides(dtype, shape, dims):
    x = random_tensor(shape, dtype)
    check_against_eager(lambda x: torch.flip(x, dims), x)
    check_against_eager(lambda x: torch.flip(x.transpose(0, -1), dims) * 2, x)


def test_rot90_fliplr_flipud():
    x = random_tensor((5, 129))
    check_against_eager(lambda x: (torch.rot90(x, 1, (0, 1)), torch.rot90(x, 2), torch.fliplr(x), torch.flipud(x)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_ops_and_unfold_match_eager(dtype):
    x = random_tensor((5, 129), dtype)
    check_against_eager(lambda x: torch.permute_copy(x, (1, -2)), x)
    check_against_eager(lambda x: torch.view_copy(x, (129, 5)), x)
    check_against_eager(lambda x: (torch.narrow_copy(x, 1, 3, 100), torch.narrow_copy(x.t(), -1, 1, 4)), x)
    check_against_eager(lambda x: torch.ops.aten.copy.default(x, x[0] * 2), x)
    check_against_eager(lambda x: torch.ops.aten.copy.default(x.float(), x), x)
    check_against_eager(lambda x: (x.unfold(1, 4, 3) * 2, x.t().unfold(0, 5, 5) + 1, x.unfold(-2, 2, 1) + 1), x)


def test_copy_to_bool_is_a_truth_test():
    x = torch.tensor([0.0, -0.0, 0.3, float("nan"), float("-inf")])
    check_against_eager(lambda x: torch.ops.aten.copy.default(x > 1, x), x)


def test_view_copy_of_a_non_contiguous_tensor_is_an_unsupported_reason():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.view_copy.default, (x, [-1]))
    with FakeTensorMode():
        x.meta["val"] = torch.empty(3, 4).t()
        node.meta["val"] = torch.empty(12)
    assert "non-contiguous" in unsupported_reason(node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, pad, value",
    [
        ((3, 5), (1, 2), 0.5),
        ((2, 3, 4), (2, 0, 1, 3), -1.0),
        ((129, 7), (-1, 2, 0, 1), 0.0),  # a negative pad cuts the first column
        ((4, 6), (-2, -1), 3.0),  # both sides cut
        ((2, 3, 4, 5), (1, 1, 1, 1, 1, 1), float("inf")),
        ((1, 600), (0, 0, 130, 1), -0.0),  # padded rows beyond one partition tile, > 512 columns
    ],
)
def test_constant_pad_nd_matches_eager(shape, pad, value, dtype):
    x = random_tensor(shape, dtype, seed=len(pad))
    # check_against_eager compiles the graph as one NKI region: a node it could not lower would raise.
    check_against_eager(lambda t: torch.nn.functional.pad(t, pad, value=value), x)


def test_constant_pad_nd_of_a_transposed_input_and_its_reason():
    x = random_tensor((5, 6)).t()
    check_against_eager(lambda t: torch.nn.functional.pad(t, (1, 1, 2, 0), value=2.0), x)
    gm = trace(lambda t: torch.nn.functional.pad(t, (1, 1)), random_tensor((3, 4)))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.constant_pad_nd.default)
    assert unsupported_reason(node) is None
    node.args = (node.args[0], node.args[1], "nan")
    assert "not a number" in unsupported_reason(node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, repeats, transpose",
    [((3, 129), (2, 1), False), ((3, 129), (2, 3, 2), False), ((3, 129), (1, 2), True), ((5,), (130,), False),
     # One frame of a 5-D video repeated (a VAE's causal padding), and repeats over new leading dims: dims repeated
     # once or of size 1 take one copy dim each, so these fit the rank limit.
     ((1, 3, 1, 4, 5), (1, 1, 2, 1, 1), False), ((2, 3), (1, 1, 1, 1, 2), False), ((2, 1, 3, 1), (2, 3, 2, 2), False)],
)
def test_repeat_matches_eager(shape, repeats, transpose, dtype):
    x = random_tensor(shape, dtype, seed=len(repeats))
    check_against_eager(lambda t: (t.t() if transpose else t).repeat(*repeats), x)


def test_repeat_beyond_the_rank_limit_keeps_a_reason():
    gm = trace(lambda t: t.repeat(2, 2, 2, 2, 2), random_tensor((2, 2, 2, 2, 2)))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.repeat.default)
    assert "needs 10 dims" in unsupported_reason(node) and "limit 8" in unsupported_reason(node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "src_shape, dim, start, end", [((6, 3), 1, 2, 5), ((2, 7), 0, -2, None), ((2, 7), 0, 0, 2), ((130, 7), 0, 1, 131)]
)
def test_slice_scatter_matches_eager(src_shape, dim, start, end, dtype):
    base = random_tensor((131, 7) if src_shape[0] == 130 else (6, 7), dtype)
    src = random_tensor(src_shape, dtype, seed=3, low=5.0, high=6.0)  # far from base: a misplaced part shows
    check_against_eager(lambda a, b: torch.slice_scatter(a, b, dim, start, end), base, src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "base_shape, dim, start, end, step",
    [((4, 6), 1, 0, 6, 2), ((4, 6), 1, 1, None, 2), ((4, 7), -1, 1, 6, 3), ((9, 3), 0, -7, None, 4),
     ((130, 5), 0, 3, 129, 5), ((4, 2), 1, 0, None, 3)],
)
def test_slice_scatter_with_a_step_matches_eager(base_shape, dim, start, end, step, dtype):
    base = random_tensor(base_shape, dtype)
    src_shape = torch.empty(base_shape)[(slice(None),) * (dim % 2) + (slice(start, end, step),)].shape
    src = random_tensor(tuple(src_shape), dtype, seed=3, low=5.0, high=6.0)  # far from base: a misplaced part shows
    check_against_eager(lambda a, b: torch.slice_scatter(a, b, dim, start, end, step), base, src)


def test_interleaving_two_stepped_slices_matches_eager():
    # Wan's rotary embedding: out[..., 0::2] = even, out[..., 1::2] = odd, into an empty buffer.
    even, odd = random_tensor((3, 16, 4)), random_tensor((3, 16, 4), seed=1, low=5.0, high=6.0)

    def interleave(a, b):  # the functional form Dynamo's functionalization gives the two assignments
        out = torch.slice_scatter(torch.empty(3, 16, 8), a, -1, 0, None, 2)
        return torch.slice_scatter(out, b, -1, 1, None, 2)

    check_against_eager(interleave, even, odd)  # one region: a node without a lowering would raise
