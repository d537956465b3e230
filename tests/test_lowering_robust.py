"""Robustness lowerings against eager: numel-0 results, uninitialized (empty*) tensors, ops on constants only.

A numel-0 result is a buffer with eager's sizes and strides and no instructions; an empty input of a non-empty
result keeps a reason; empty* tensors compare by metadata (their contents are uninitialized in eager too).
"""

from __future__ import annotations

import pytest
import torch
from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace

from neuron_compile import ir
from neuron_compile.lowering import unsupported_reason


def _node(gm, target):
    return next(node for node in gm.graph.nodes if node.target is target)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 129), (2, 0, 5)])
def test_numel_0_pointwise_results_need_no_kernel(shape):
    x = random_tensor(shape)
    region = check_against_eager(lambda t: torch.sigmoid(torch.exp(t) * 2.0 + 1.0), x)
    assert region.kernels == []
    assert region.nki_nodes >= 3


def test_numel_0_result_keeps_eager_strides():
    x = random_tensor((4, 0, 3)).transpose(0, 2)
    region, (out,) = compile_and_run(lambda t: t * 2.0, x)
    want = x * 2.0
    assert (out.shape, out.stride()) == (want.shape, want.stride())


def test_numel_0_beside_non_empty_output():
    x, y = random_tensor((0, 5)), random_tensor((3, 129), seed=1)
    check_against_eager(lambda a, b: (a.abs(), torch.rsqrt(b.abs() + 1.0)), x, y)


def test_empty_input_of_non_empty_result_without_identity_keeps_a_reason():
    # amax has no identity (eager raises on an empty row): a node like that must keep its reason.
    gm = trace(lambda t: t.sum(1), random_tensor((3, 0)))
    node = _node(gm, torch.ops.aten.sum.dim_IntList)
    node.target = torch.ops.aten.amax.default
    assert "numel 0" in unsupported_reason(node)


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: torch.empty(3, 129),
        lambda t: torch.empty_like(t),
        lambda t: torch.empty_like(t.transpose(0, 1)),
        lambda t: torch.empty_permuted((2, 3, 4), (2, 0, 1)),
        lambda t: t.new_empty((5, 7)),
        lambda t: t.new_empty_strided((4, 3), (1, 4)),
        lambda t: torch.empty_strided((2, 3), (1, 2)),
    ],
)
def test_empty_tensors_have_eager_metadata_and_no_kernel(fn):
    x = random_tensor((6, 4))
    region, outputs = compile_and_run(fn, x)
    want = fn(x)
    (got,) = outputs
    assert region.kernels == []
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())


def test_kernel_reading_an_empty_tensor_sees_nan():
    # Uninitialized memory: the region NaN-fills it, as the simulator does every new buffer (never stale data).
    x = random_tensor((3, 129))
    region, (out,) = compile_and_run(lambda t: torch.empty_like(t) + t, x)
    assert len(region.kernels) == 1
    assert out.isnan().all()


def test_empty_sparse_layout_is_refused():
    gm = trace(lambda t: torch.empty(2, 3) * t, random_tensor((2, 3)))
    node = _node(gm, torch.ops.aten.empty.memory_format)
    node.meta["val"] = torch.empty(2, 3).to_sparse()
    assert "layout" in unsupported_reason(node)


@pytest.mark.parametrize("value", [0.4, -0.6, float("inf"), float("-inf"), float("nan"), -0.0])
def test_activation_of_a_constant_only_expression(value):
    # lerp's decomposition: abs(full(weight)) >= 0.5 selects the formula; every operand of abs is a number.
    x, y = random_tensor((5, 129)), random_tensor((5, 129), seed=1)
    check_against_eager(lambda a, b: torch.lerp(a, b, value), x, y)
    check_against_eager(lambda a: a + torch.full((), value).abs().exp(), x)


ZERO_D_VALUES = [3.5, -0.0, float("inf"), float("-inf"), float("nan"), 1e30]


@pytest.mark.parametrize("value", ZERO_D_VALUES)
@pytest.mark.parametrize(
    "fn",
    [
        torch.sum,
        torch.mean,
        torch.amax,
        torch.amin,
        torch.prod,
        lambda t: t.sum(dim=0, keepdim=True),
        lambda t: t.mean(dim=-1),
        lambda t: t.amax(dim=[]),
        lambda t: torch.var(t, correction=0),
        lambda t: torch.var(t, correction=0.5),
        lambda t: torch.var(t),
        lambda t: torch.var(t, correction=2),
    ],
)
def test_reduction_of_a_0d_tensor_is_a_copy(fn, value):
    check_against_eager(fn, torch.tensor(value))


def test_reduction_of_a_0d_tensor_casts_to_the_requested_dtype():
    check_against_eager(lambda t: torch.sum(t, dtype=torch.float32), torch.tensor(1.0078125, dtype=torch.bfloat16))
    check_against_eager(lambda t: torch.sum(t, dtype=torch.bfloat16), torch.tensor(1.0078125))


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: t.sum(1),
        lambda t: t.sum(),
        lambda t: t.sum(dim=(0, 1)),
        lambda t: t.prod(1),
        lambda t: t.mean(1, keepdim=True),
        lambda t: t.mean(),
        lambda t: torch.var(t, 1),
        lambda t: torch.var(t, 1, correction=0),
        lambda t: t.sum(1, dtype=torch.bfloat16),
    ],
)
def test_reduction_over_no_elements_is_its_identity(fn):
    check_against_eager(fn, random_tensor((129, 0)))


@pytest.mark.parametrize("m, n", [(1, 1), (3, 4), (129, 513)])
def test_matmul_with_k_0_is_zeros_or_scaled_bias(m, n):
    a, b = random_tensor((m, 0)), random_tensor((0, n), seed=1)
    bias = random_tensor((n,), seed=2)
    bias[0] = float("nan")
    check_against_eager(torch.mm, a, b)
    check_against_eager(lambda x, y: torch.bmm(x.expand(2, m, 0), y.expand(2, 0, n)), a, b)
    check_against_eager(lambda c, x, y: torch.addmm(c, x, y), bias, a, b)
    check_against_eager(lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), bias, a, b)
    check_against_eager(lambda c, x, y: torch.addmm(c, x, y, beta=0.0), bias, a, b)


def test_new_empty_of_an_empty_tensor():
    x = random_tensor((0, 3))
    region, (out,) = compile_and_run(lambda t: t.new_empty_strided((4, 3), (1, 4)), x)
    assert (out.shape, out.stride()) == ((4, 3), (1, 4))


def test_addmm_k_0_with_infinite_alpha_keeps_a_reason():
    a, b, bias = random_tensor((3, 0)), random_tensor((0, 4), seed=1), random_tensor((4,), seed=2)
    gm = trace(lambda c, x, y: torch.addmm(c, x, y, alpha=float("inf")), bias, a, b)
    assert "alpha" in unsupported_reason(_node(gm, torch.ops.aten.addmm.default))


def test_region_called_with_another_dtype_than_traced_raises_a_named_error():
    x = random_tensor((4, 5))
    gm = trace(lambda t: t * 2.0, x)
    from neuron_compile.pipeline import compile_region
    from neuron_compile.lowering import LoweringError

    region = compile_region(gm, [x])
    with pytest.raises(LoweringError, match="compiled for dtype float32, called with torch.bfloat16"):
        region(x.to(torch.bfloat16))


def test_lifted_constant_tensor_is_copied():
    # Through the backend: the constant is a get_attr outside the region, so the region reads it as an input.
    import neuron_compile

    def fn(t):
        return t * torch.tensor([1.5, float("nan"), -0.0, 2.0])

    x = random_tensor((3, 4))
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    out = torch.compile(fn, backend="neuron", options={"fallback": "raise"})(x)
    torch.testing.assert_close(out, fn(x), rtol=0, atol=0, equal_nan=True)
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] >= 2, stats
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_functional_copy_broadcasts_and_casts_src(dtype):
    target = torch.zeros((129, 5), dtype=dtype)
    source = random_tensor((5,), seed=3)
    source[0], source[1] = float("nan"), 0.0
    check_against_eager(lambda a, b: torch.ops.aten.copy.default(a, b), target, source)


def test_empty_input_with_other_strides_than_traced():
    # eye's decomposition traces an empty (0, 1) mask with strides (1, 1); eager hands it over as (1, 0).
    x = random_tensor((0, 1))
    gm = trace(lambda t: t * 2.0, x)
    from neuron_compile.pipeline import compile_region

    region = compile_region(gm, [x])
    (out,) = region(torch.empty_strided((0, 1), (1, 0)))
    assert out.shape == (0, 1)


@pytest.mark.parametrize("shape, dims", [((2, 3, 1, 2, 2, 3), (0, 1, 4, 2, 5, 3)), ((2,) * 8, (7, 0, 6, 1, 5, 2, 4, 3))])
def test_permuted_copy_of_rank_6_to_8(shape, dims):
    # pixel_shuffle is a 6-D view -> permute -> clone; the unmergeable dims become outer loops.
    x = random_tensor(shape)
    check_against_eager(lambda t: (t.permute(dims) * 1.5).contiguous(), x)
    check_against_eager(lambda t: torch.nn.functional.pixel_shuffle(t, 2), random_tensor((1, 8, 3, 5), seed=4))


def test_rank_beyond_the_limit_keeps_a_reason():
    gm = trace(lambda t: t * 2.0, random_tensor((1,) * 9))
    assert "rank 9 beyond the 8-D limit" in unsupported_reason(_node(gm, torch.ops.aten.mul.Tensor))


def _compiled_stats(fn, *inputs):
    import neuron_compile

    torch._dynamo.reset()
    neuron_compile.reset_stats()
    out = torch.compile(fn, backend="neuron", options={"fallback": "raise"})(*inputs)
    stats = neuron_compile.stats()
    torch._dynamo.reset()
    return out, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_into_a_graph_input_writes_the_input(dtype):
    # aot_autograd keeps input mutations as a final copy_ (batch norm's running stats): the region writes them.
    def fn(stats, x):
        stats.mul_(0.5).add_(x.sum(0))
        return x * 2.0

    x = random_tensor((129, 7), dtype=dtype)
    stats, expected_stats = random_tensor((7,), dtype=dtype, seed=1), None
    expected_stats = stats.clone()
    expected = fn(expected_stats, x)
    out, counts = _compiled_stats(fn, stats, x)
    torch.testing.assert_close(out, expected, equal_nan=True)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(stats, expected_stats, rtol=rtol, atol=atol)
    assert counts["fallback_nodes"] == 0, counts


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_computed_value_of_the_inputs_dtype_is_written_into_it_with_no_copy_kernel(state_dtype):
    """AdamW's state update: the region writes the new moment into the input from the buffer the kernels compute
    (a copy kernel stored it a second time); a value of another dtype is still cast by a copy."""
    from neuron_compile.lowering import lower_graph

    def fn(state, g):
        new = state * 0.9 + g.float()  # fp32: state's dtype only when state is fp32
        state.copy_(new)
        return new * 2.0

    state, g = random_tensor((129, 7), state_dtype, seed=2), random_tensor((129, 7), torch.bfloat16, seed=3)
    lowered = lower_graph(trace(fn, state.clone(), g))
    (_, written), = lowered.mutations
    copies = [node for node in lowered.nodes if any(store.buffer.name == written.buffer for store in node.stores)
              and isinstance(node.stores[0].expr, ir.Op) and node.stores[0].expr.op == "cast"]
    assert bool(copies) == (state_dtype != torch.float32)
    expected_state = state.clone()
    expected = fn(expected_state, g)
    out, counts = _compiled_stats(fn, state, g)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, expected_state)
    assert counts["fallback_nodes"] == 0, counts


def test_copy_into_a_strided_input_leaves_the_gaps():
    base = random_tensor((6, 8))
    expected_base = base.clone()

    def fn(view):
        view.copy_(torch.full_like(view, 3.0))
        return view.sum()

    fn(expected_base[:, ::2])
    out, counts = _compiled_stats(fn, base[:, ::2])
    torch.testing.assert_close(base, expected_base)
    assert counts["fallback_nodes"] == 0, counts


def test_copy_into_a_non_input_keeps_a_reason():
    x = random_tensor((3, 4))
    gm = trace(lambda t: torch.ops.aten.copy_.default(t * 2.0, t), x)
    assert "not a graph input" in unsupported_reason(_node(gm, torch.ops.aten.copy_.default))


def test_region_failing_its_output_check_leaves_the_mutated_input_for_eager(monkeypatch):
    # stats <- stats * 0.5 + x.sum(0): written twice (region, then the eager rerun) it would be wrong.
    import neuron_compile
    from neuron_compile.runtime import region_module

    def broken_check(outputs, expected, region):
        raise neuron_compile.NeuronCompileError("test: output check fails")

    monkeypatch.setattr(region_module, "_check_outputs", broken_check)

    def fn(stats, x):
        stats.mul_(0.5).add_(x.sum(0))
        return x * 2.0

    x, stats = random_tensor((129, 7)), random_tensor((7,), seed=1)
    expected_stats = stats.clone()
    expected = fn(expected_stats, x)
    torch._dynamo.reset()
    out = torch.compile(fn, backend="neuron", options={"fallback": "silent"})(stats, x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(stats, expected_stats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_var_mean_over_no_elements_is_nan(dtype):
    x = torch.empty((129, 0), dtype=dtype)
    check_against_eager(lambda t: torch.var_mean(t, dim=1, correction=0), x)
    check_against_eager(lambda t: torch.var_mean(t, dim=1), x)


def test_split_with_an_empty_piece_is_views():
    x = random_tensor((6, 129))
    # One region for the whole graph (check_against_eager raises on a node it cannot lower), the empty piece too.
    check_against_eager(lambda t: [p * 2 for p in torch.split(t, [2, 0, 4], dim=0)], x)


def test_region_reads_an_input_whose_size_one_dims_have_other_strides():
    # Eager may give an intermediate other strides on its size-1 dims than the fake tensor the region was compiled
    # for (AnyFlow's rotary: [1, 2, 32, 12] with stride 24 where 768 was traced): the same elements are read.
    from neuron_compile.pipeline import compile_region

    x = random_tensor((1, 2, 32, 12))
    region = compile_region(trace(lambda t: t * 2.0 + 1.0, x), [x])
    restrided = torch.as_strided(x.clone(), (1, 2, 32, 12), (24, 384, 12, 1))
    restrided.copy_(x)
    torch.testing.assert_close(region(restrided)[0], x * 2.0 + 1.0)


def test_region_called_with_other_strides_on_a_real_dim_raises_a_named_error():
    from neuron_compile.lowering import LoweringError
    from neuron_compile.pipeline import compile_region

    x = random_tensor((1, 2, 32, 12))
    region = compile_region(trace(lambda t: t * 2.0, x), [x])
    with pytest.raises(LoweringError, match=r"called with \[1, 2, 32, 12\] \[768, 12, 24, 1\]"):
        region(x.transpose(1, 2).contiguous().transpose(1, 2))
