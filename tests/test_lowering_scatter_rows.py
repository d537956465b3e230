"""The accumulating row scatter (kinds/scatter_rows.py) vs eager: index_put with accumulate of whole rows into a
constant fill, the embedding gradient's form. Duplicates summed on TensorE; inf, nan and -0.0 among the values give
eager's results; vocabularies and token counts around the tile edges (1, 127, 128, 129, ragged); rows over several
PSUM chunks; where the form would not be exact (a base that may hold -0.0) the element form, still eager's result."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace

from neuron_compile.lowering import unsupported_reason
from neuron_compile.pipeline import compile_region

INF, NAN = float("inf"), float("nan")
FP32 = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


def summed_into_zeros(vocab: int):
    """The embedding gradient's index_put: rows of ``values`` added into zeros at ``index``."""
    return lambda index, values: torch.zeros(vocab, values.shape[-1], dtype=values.dtype).index_put(
        (index,), values, accumulate=True)


def scatter_kernel_source(region) -> str:
    (kernel,) = [kernel for kernel in region.kernels if kernel.name.startswith("scatter_kernel")]
    return kernel.source


def with_specials(values: torch.Tensor, seed: int) -> torch.Tensor:
    """``values`` with about one element in ten replaced by inf, -inf, nan or -0.0."""
    generator = torch.Generator().manual_seed(seed)
    specials = torch.tensor([INF, -INF, NAN, -0.0], dtype=values.dtype)
    picks = torch.randint(0, 40, values.shape, generator=generator)
    return torch.where(picks < 4, specials[picks.clamp(max=3)], values)


@settings(max_examples=10, deadline=None)
@given(vocab=st.sampled_from([1, 127, 128, 129]), tokens=st.sampled_from([1, 5, 127, 128, 129, 300]),
       width=st.sampled_from([1, 7, 64, 513, 600]), distinct=st.sampled_from([1, 3, 1000]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), specials=st.booleans(), seed=st.integers(0, 99))
def test_duplicate_rows_sum_like_eager(vocab, tokens, width, distinct, dtype, specials, seed):
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, min(vocab, distinct), (tokens,), generator=generator)  # 1 or 3 rows: all duplicates
    values = random_tensor((tokens, width), dtype, seed=seed)
    if specials:
        values = with_specials(values, seed)
    # bf16: eager's CPU kernel adds in bf16 one by one; the kernel sums in fp32 and rounds once
    region = check_against_eager(summed_into_zeros(vocab), index, values, tolerances=FP32,
                                 fp32_reference=dtype == torch.bfloat16)
    assert "nc_matmul(dst=sums" in scatter_kernel_source(region)


def test_specials_in_one_group_follow_ieee():
    """A group's +inf and finite values give +inf, +inf and -inf nan, nan anything nan; -0.0 alone +0.0 (eager:
    0.0 + -0.0); the other rows' specials never reach a row (no 0 * inf in the matmul)."""
    values = torch.tensor([[INF, 1.0, -0.0, NAN], [2.0, -INF, -0.0, 1.0], [3.0, 4.0, 5.0, 6.0],
                           [-INF, 1.0, 1.0, 1.0]])
    index = torch.tensor([0, 0, 1, 2])
    region, (got,) = compile_and_run(summed_into_zeros(3), index, values)
    assert "nc_matmul(dst=sums" in scatter_kernel_source(region)
    want = summed_into_zeros(3)(index, values)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert not torch.signbit(got[0, 2])  # 0.0 + -0.0 + -0.0 is +0.0 in eager too
    torch.testing.assert_close(got[1], values[2])


def test_embedding_gradient_of_the_goal_point_is_one_tile_per_128_tokens():
    """1024 x 2048, 256 tokens with repeats: two tiles, where the element form needed 4097 (over the limit)."""
    index = torch.randint(0, 1024, (1, 256), generator=torch.Generator().manual_seed(3))
    index[0, 100:140] = 7
    values = random_tensor((1, 256, 2048), torch.bfloat16, seed=4)
    region = check_against_eager(summed_into_zeros(1024), index, values, fp32_reference=True)
    assert "for p0 in range(0, 256, 128)" in scatter_kernel_source(region)


def test_a_base_that_may_hold_negative_zero_keeps_the_element_form():
    """-0.0 + -0.0 stays -0.0 in eager where the matmul's sum of zeros is +0.0: over any base but a constant fill
    the element form runs (its exact -0.0 sum), and the tile limit still names its rule."""
    base = torch.full((3, 4), -0.0)
    index = torch.tensor([1, 1, 2])
    values = torch.full((3, 4), -0.0)
    region, (got,) = compile_and_run(lambda a, i, v: a.index_put((i,), v, accumulate=True), base, index, values)
    assert "nc_matmul" not in scatter_kernel_source(region)
    assert torch.signbit(got).all()
    graph = trace(lambda a, i, v: a.index_put((i,), v, accumulate=True), torch.zeros(10, 5000),
                  torch.zeros(1000, dtype=torch.int64), torch.ones(1000, 5000))
    (reason,) = [unsupported_reason(node) for node in graph.graph.nodes if node.op == "call_function"]
    assert "copy and scatter tiles (> 4096)" in reason


@pytest.mark.parametrize("fill", [-0.0, 2.5])
def test_fills_other_than_negative_zero_take_the_row_form(fill):
    index = torch.tensor([0, 2, 2, 2, 1])
    values = random_tensor((5, 6), seed=9)

    def scatter(i, v):
        return torch.full((3, 6), fill).index_put((i,), v, accumulate=True)

    region = check_against_eager(scatter, index, values, tolerances=FP32)
    source = scatter_kernel_source(region)
    assert ("nc_matmul(dst=sums" in source) == (fill != 0)
    # the constant base is stored from one memset tile (no HBM -> HBM copy of a filled buffer, no fill kernel)
    assert ("nisa.memset(dst=fill, value=2.5)" in source) == (fill != 0)
    assert len(region.kernels) == (1 if fill != 0 else 2)


def test_rows_of_several_dims_and_a_batch_of_index_rows():
    index = torch.randint(0, 5, (2, 70), generator=torch.Generator().manual_seed(11))
    values = random_tensor((2, 70, 3, 4), seed=12)
    region = check_against_eager(lambda i, v: torch.zeros(5, 3, 4).index_put((i,), v, accumulate=True), index,
                                 values, tolerances=FP32)
    assert "nc_matmul(dst=sums" in scatter_kernel_source(region)


@pytest.mark.parametrize("bad", [[0, 6, 1], [0, -7, 1]])
def test_out_of_range_rows_fail_the_dma_never_another_row(bad):
    scatter = summed_into_zeros(6)
    values = random_tensor((3, 4), seed=33)
    region = compile_region(trace(scatter, torch.tensor([0, 1, 2]), values), [torch.tensor(bad), values])
    assert "nc_matmul(dst=sums" in scatter_kernel_source(region)
    with pytest.raises(Exception, match="err_tensor_access_out_of_bound"):
        region(torch.tensor(bad), values)
