"""Reduction lowerings (sum, mean, amax, amin, prod, var; softmax, log_softmax) on the simulator vs eager."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile.hardware import get_target
from neuron_compile.pipeline import compile_region
from neuron_compile.lowering import LoweringError, unsupported_reason
from neuron_compile.passes.partition import partition_graph
from neuron_compile.runtime import stats

SIZES = st.sampled_from([1, 2, 5, 127, 128, 129])
# A reduction of N fp32 terms summed in another order than ATen's differs by up to ~N * 2**-24 of sum(|x|):
# for the <= 30000-element rows drawn here that is 1e-4 (bf16 as in lowering_harness).
REDUCTION_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@st.composite
def shape_and_dims(draw, max_rank=4):
    rank = draw(st.integers(1, max_rank))
    shape = [draw(SIZES) for _ in range(rank)]
    while torch.Size(shape).numel() > 30_000:
        shape[shape.index(max(shape))] = 5
    dims = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    return tuple(shape), sorted(dims)


REDUCTIONS = {
    "sum": lambda x, dims, keep: x.sum(dims, keepdim=keep),
    "mean": lambda x, dims, keep: x.mean(dims, keepdim=keep),
    "amax": lambda x, dims, keep: x.amax(dims, keepdim=keep),
    "amin": lambda x, dims, keep: x.amin(dims, keepdim=keep),
    "var": lambda x, dims, keep: x.var(dims, keepdim=keep),
    "var_biased": lambda x, dims, keep: x.var(dims, keepdim=keep, correction=0),
}


@pytest.mark.filterwarnings(r"ignore:var\(\). degrees of freedom")  # var of one element is nan, as in eager
@settings(max_examples=25, deadline=None)
@given(case=shape_and_dims(), dtype=DTYPES, name=st.sampled_from(sorted(REDUCTIONS)), keep=st.booleans())
def test_reductions_over_any_dims_match_eager(case, dtype, name, keep):
    shape, dims = case
    x = random_tensor(shape, dtype)
    gm = trace(lambda x: REDUCTIONS[name](x, dims, keep), x)
    reasons = [unsupported_reason(node) for node in gm.graph.nodes if node.op == "call_function"]
    # Long rows over dims that do not merge are declined up front (the partitioner keeps them eager).
    assume(all(reason is None for reason in reasons))
    check_against_eager(lambda x: REDUCTIONS[name](x, dims, keep), x, tolerances=REDUCTION_TOLERANCES)


def test_prod_and_full_reductions():
    x = random_tensor((5, 7, 3), low=0.5, high=1.5)
    check_against_eager(lambda x: (x.prod(1), x.prod(), x.sum(), x.mean(), x.amax()), x)


def test_variance_sums_squared_deviations_on_scalar_e_in_chunks_and_whole_rows():
    """The second pass of a variance is one ScalarE activation per chunk, square(x - mean) with its row sum in
    reduce_res; an inf in the row gives nan, a constant row 0, as eager."""
    x = random_tensor((3, 70_000), seed=3)
    x[1, 5] = float("inf")
    x[2] = 7.0
    region = check_against_eager(lambda x: x.var(1), x, tolerances={torch.float32: (1e-4, 1e-3)})
    source = "".join(kernel.source for kernel in region.kernels)
    assert "if f0 == 0:" in source and "op=nl.square" in source and "bias=negated_mean" in source
    whole = check_against_eager(lambda x: x.var(1, correction=0), x[:, :1000])
    assert whole.kernels[0].source.count("nisa.dma_copy(dst=arg0_1_tile") == 1  # the row is loaded once


def test_reductions_of_widened_bf16_rows_read_the_bf16_tile():
    """``x.float().sum(-1)`` of a bf16 x: tensor_reduce and ScalarE's activation compute in fp32 from the bf16 tile,
    so no fp32 copy of the row is made first."""
    x = random_tensor((300, 1000), torch.bfloat16, seed=4)
    region = check_against_eager(lambda a: (a.float().sum(-1), a.float().amax(-1), a.float().var(-1)), x,
                                 tolerances=REDUCTION_TOLERANCES)
    assert "tensor_copy" not in "".join(kernel.source for kernel in region.kernels)


def test_long_rows_reduce_in_chunks_with_partials():
    # 70000 columns do not fit one SBUF tile per partition: the kernel carries partial sums across chunks.
    x = random_tensor((3, 70_000), seed=2)
    region = check_against_eager(lambda x: (x.sum(1), x.amax(1)), x, tolerances={torch.float32: (1e-4, 1e-3)})
    assert any("if f0 == 0:" in kernel.source for kernel in region.kernels)


@settings(max_examples=15, deadline=None)
@given(case=shape_and_dims(3), dtype=DTYPES, log=st.booleans())
def test_softmax_over_any_dim_matches_eager(case, dtype, log):
    shape, dims = case
    fn = torch.log_softmax if log else torch.softmax
    check_against_eager(lambda x: fn(x * 3, dims[0]), random_tensor(shape, dtype))


def test_softmax_of_a_transposed_input():
    x = random_tensor((129, 40), seed=3).t()
    check_against_eager(lambda x: torch.softmax(x, -1), x)


def test_softmax_row_too_wide_for_sbuf_is_an_unsupported_reason_and_a_lowering_error():
    x = random_tensor((2, 100_000))
    gm = trace(lambda x: torch.softmax(x, -1), x)
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten._softmax.default)
    assert "shape beyond tiling: a softmax row of 100000 elements" in unsupported_reason(node)
    with pytest.raises(LoweringError, match="shape beyond tiling"):
        compile_region(gm, [x])


def test_softmax_row_limit_is_the_configured_targets():
    # 4500 fp32 elements: within trn2's SBUF budget per partition (212984 usable bytes) but not trn1's (180224).
    x = random_tensor((2, 4500))
    gm = trace(lambda x: torch.softmax(x, -1), x)
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten._softmax.default)
    assert unsupported_reason(node, "trn2") is None
    assert unsupported_reason(node, get_target("trn2")) is None
    reason = "shape beyond tiling: a softmax row of 4500 elements exceeds 4224 per partition"
    assert reason in unsupported_reason(node, "trn1")
    claimed = partition_graph(gm, "trn2").report
    assert [placement.op for placement in claimed.eager] == []
    declined = partition_graph(gm, "trn1").report
    assert [(placement.op, placement.reason) for placement in declined.eager] == [
        ("aten._softmax.default", f"aten._softmax.default: {reason}")
    ]


def test_mean_epilogue_and_square_prologue_fuse_into_one_kernel():
    x = random_tensor((256, 64), seed=4)
    region, _ = compile_and_run(lambda x: torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6), x)
    assert len(region.kernels) == 1
    check_against_eager(lambda x: torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6), x)


@settings(max_examples=10, deadline=None)
@given(rows=SIZES, cols=SIZES, dtype=DTYPES, affine=st.booleans())
def test_layer_norm_matches_eager(rows, cols, dtype, affine):
    x = random_tensor((2, rows, cols), dtype, seed=5)
    weight, bias = random_tensor((cols,), dtype, seed=6), random_tensor((cols,), dtype, seed=7)

    def layer_norm(x, weight, bias):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], weight if affine else None,
                                                           bias if affine else None, 1e-5)
        return out, mean, rstd

    check_against_eager(layer_norm, x, weight, bias)


@settings(max_examples=10, deadline=None)
@given(case=shape_and_dims(3), dtype=DTYPES, log=st.booleans())
def test_softmax_backward_matches_eager(case, dtype, log):
    shape, dims = case
    aten = torch.ops.aten

    def backward(grad, x):
        if log:
            return aten._log_softmax_backward_data(grad, aten._log_softmax(x, dims[0], False), dims[0], dtype)
        return aten._softmax_backward_data(grad, aten._softmax(x, dims[0], False), dims[0], dtype)

    check_against_eager(backward, random_tensor(shape, dtype, seed=1), random_tensor(shape, dtype, seed=2))


@settings(max_examples=8, deadline=None)
@given(rows=SIZES, cols=st.sampled_from([1, 5, 130]), dtype=DTYPES, mask=st.sampled_from([(True, True, True),
                                                                                        (True, False, False)]))
def test_layer_norm_backward_matches_eager(rows, cols, dtype, mask):
    x, grad = random_tensor((3, rows, cols), dtype, seed=8), random_tensor((3, rows, cols), dtype, seed=9)
    weight, bias = random_tensor((cols,), dtype, seed=10), random_tensor((cols,), dtype, seed=11)
    aten = torch.ops.aten
    # The saved statistics are inputs (as in a real backward graph), the same values for both sides.
    _, mean, rstd = aten.native_layer_norm(x.float(), [cols], None, None, 1e-5)
    mean, rstd = mean.to(dtype), rstd.to(dtype)

    def backward(grad, x, mean, rstd, weight, bias):
        results = aten.native_layer_norm_backward(grad, x, [cols], mean, rstd, weight, bias, list(mask))
        return tuple(result for result in results if result is not None)

    # The weight/bias gradients sum 3 * rows products: fp32 summation order differs from ATen's. Eager's bf16
    # CPU kernel sums grad_bias in bf16 (0.1 off for 381 terms), so bf16 is checked against fp32 eager.
    check_against_eager(backward, grad, x, mean, rstd, weight, bias,
                        tolerances={torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)},
                        fp32_reference=dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leading_dim_and_full_reductions_use_tensor_engine_and_stay_near_roofline(dtype):
    # sum over rows: TensorE sums 128-row tiles against ones; a full sum spreads the row over partitions and
    # reduces across them at the end. Both are contiguous DMAs; element-strided ones cost ~15x / ~100x more.
    # 2048 x 2048: large enough that filling and draining the load -> reduce pipeline (the first chunk's DMA
    # latency, the cross-partition tail) is a small part of the kernel's time
    x = random_tensor((2048, 2048), dtype, seed=12)
    for fn, instruction in ((lambda x: x.sum(0) * 2, "nisa.nc_matmul"), (lambda x: x.amax(), "nisa.nc_transpose"),
                            (lambda x: x.mean(), "nisa.nc_transpose")):
        before = stats.snapshot()
        region = check_against_eager(fn, x, tolerances={torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})
        after = stats.snapshot()
        assert len(region.kernels) == 1 and instruction in region.kernels[0].source
        device = (after["est_time_s"] - after["launch_s"]) - (before["est_time_s"] - before["launch_s"])
        assert device < 2 * (after["roofline_s"] - before["roofline_s"])  # the kernel's own time, not its launch


def test_unchunkable_long_rows_are_unsupported_reasons():
    # Reducing dims 0 and 2 of a (60, 3, 70) tensor: they do not merge, and 4200 elements is a long row.
    gm = trace(lambda x: x.sum([0, 2]), random_tensor((60, 3, 70)))
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten.sum.dim_IntList)
    assert "shape beyond tiling: a row of 4200 elements over 2 non-mergeable dims" in unsupported_reason(node)


def test_full_reduction_of_a_transposed_tensor_walks_memory_order():
    x = random_tensor((130, 3, 17), seed=13).permute(2, 0, 1)
    region = check_against_eager(lambda x: (x.sum(), x.amax(), x.var([0, 1, 2])), x, tolerances=REDUCTION_TOLERANCES)
    assert len(region.kernels) == 3  # each a chunked walk over one merged dim, none rejected


NORM_ORDERS = [2, 1, float("inf"), float("-inf"), 0, 3, 0.5]


@pytest.mark.parametrize("order", NORM_ORDERS)
@pytest.mark.parametrize("shape, dim, keepdim", [((129,), None, False), ((5, 129), -1, True), ((128, 3), 0, False),
                                                 ((2, 3, 4, 5), (1, -1), False), ((1,), None, True)])
def test_vector_norm_orders_and_dims_match_eager(order, shape, dim, keepdim):
    x = random_tensor(shape, seed=len(shape))
    x.view(-1)[::7] = 0.0  # zeros: counted out by ord 0, 0 ** p for the general order
    check_against_eager(lambda x: torch.linalg.vector_norm(x, order, dim, keepdim), x,
                        tolerances=REDUCTION_TOLERANCES)


@pytest.mark.parametrize("order", NORM_ORDERS)
def test_vector_norm_special_values_0d_bf16_and_non_contiguous(order):
    special = torch.tensor([[1.0, float("inf"), -0.0, 3e30], [float("nan"), -2.0, 0.0, 1e-30], [-1e30, 4.0, 0.5, -7.0]])
    check_against_eager(lambda x: torch.linalg.vector_norm(x, order, 1), special)
    check_against_eager(lambda x: torch.linalg.vector_norm(x, order), torch.tensor(-1.5))
    x = random_tensor((129, 6))
    check_against_eager(lambda x: torch.linalg.vector_norm(x.t(), order, -1), x, tolerances=REDUCTION_TOLERANCES)
    check_against_eager(lambda x: torch.linalg.vector_norm(x, order, 0), x.to(torch.bfloat16),
                        tolerances=REDUCTION_TOLERANCES)
    check_against_eager(lambda x: torch.linalg.vector_norm(x, order, 0, dtype=torch.float32), x.to(torch.bfloat16),
                        tolerances=REDUCTION_TOLERANCES)


def test_vector_norm_negative_order_is_an_unsupported_reason():
    gm = trace(lambda x: torch.linalg.vector_norm(x, -2), random_tensor((4, 5)))
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linalg_vector_norm.default)
    assert "negative orders unsupported" in unsupported_reason(node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, dim, correction, keepdim", [((129,), None, 1, False), ((5, 129), -1, 0, True),
                                                             ((128, 3, 2), (0, 2), 1, False), ((1, 4), 0, 0, False)])
def test_var_mean_and_std_mean_match_eager(dtype, shape, dim, correction, keepdim):
    x = random_tensor(shape, dtype, seed=3)
    check_against_eager(lambda x: torch.var_mean(x, dim, correction=correction, keepdim=keepdim), x,
                        tolerances=REDUCTION_TOLERANCES)
    check_against_eager(lambda x: torch.std_mean(x.transpose(0, -1), dim, correction=correction), x,
                        tolerances=REDUCTION_TOLERANCES)


def test_max_and_min_over_everything_propagate_nan():
    x = random_tensor((129, 5))
    check_against_eager(lambda x: (torch.max(x), torch.min(x.t()), torch.max(x[:, 1])), x)
    special = torch.tensor([[1.0, float("nan")], [float("inf"), -1.0]])
    check_against_eager(lambda x: (torch.max(x), torch.min(x), torch.max(x[1]), torch.min(x[1])), special)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_any_and_all_match_eager(dtype):
    x = random_tensor((129, 7), torch.float32, seed=5)
    x = torch.where(x > 1.5, x, torch.zeros_like(x))  # mostly zeros: rows with and without a truthy element
    x[3, 2] = float("nan")  # nan is truthy
    x = x.to(dtype)
    check_against_eager(lambda t: torch.any(t), x)
    check_against_eager(lambda t: torch.any(t, dim=1), x)
    check_against_eager(lambda t: torch.all(t, dim=0), x)
    check_against_eager(lambda t: torch.any(t, dim=(0,), keepdim=True), x)


def test_any_of_nothing_and_of_a_0d_tensor():
    check_against_eager(lambda t: torch.any(t, dim=1), torch.empty(4, 0))
    check_against_eager(lambda t: torch.any(t), torch.tensor(float("nan")))
    check_against_eager(lambda t: torch.all(t), torch.tensor(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safe_softmax_gives_zero_on_fully_masked_rows(dtype):
    x = random_tensor((130, 700), dtype=dtype, low=-3, high=3)
    x[3] = float("-inf")  # a fully masked row: 0, not nan
    x[5, :600] = float("-inf")  # partly masked: an ordinary softmax
    x[7, 2] = float("nan")  # nan still spreads over its row, as eager
    check_against_eager(lambda a: torch.ops.aten._safe_softmax(a, 1), x)
    check_against_eager(lambda a: torch.ops.aten._safe_softmax(a, 0), x[:, :9])


@settings(max_examples=6, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), cols=st.sampled_from([1, 96, 600]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_sum_over_rows_reads_a_per_row_factor_once_per_partition(rows, cols, dtype):
    """An RMSNorm weight's gradient: sum over the tokens of grad * x * rsqrt, the rsqrt one value per row. The
    TensorE column sum reads it as a (P, 1) column, not as a broadcast DMA moving every repeated element (that
    DMA made the kernel 7.6x its roofline at hidden 2048)."""

    def weight_gradient(grad, x, inverse_rms):
        return (grad * (x * inverse_rms).to(grad.dtype)).sum(dim=(0, 1))

    grad, x = random_tensor((1, rows, cols), dtype, seed=13), random_tensor((1, rows, cols), dtype, seed=14)
    inverse_rms = random_tensor((1, rows, 1), torch.float32, seed=15, low=0.5, high=2.0)
    region = check_against_eager(weight_gradient, grad, x, inverse_rms,
                                 tolerances={torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})
    source = "\n".join(kernel.source for kernel in region.kernels)
    if rows > 1 and cols > 1:
        assert "nisa.nc_matmul" in source and "arg2_1.ap([[1, rows], [0, 1]]" in source
        assert "[0, cols]" not in source
