"""Matmul lowerings (mm, bmm, addmm / linear) on the simulator vs eager.

fp32 tolerance here is rtol 1e-4 / atol 1e-4 rather than the pointwise 1e-5: a K-long dot product summed in a
different order than ATen's blocked kernel differs by up to about K * 2**-24 relative to sum(|a * b|).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor
from neuron_compile.runtime import stats

MATMUL_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
SIZES = st.sampled_from([1, 2, 5, 127, 128, 129])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@settings(max_examples=15, deadline=None)
@given(m=SIZES, k=SIZES, n=SIZES, dtype=DTYPES)
def test_mm_matches_eager(m, k, n, dtype):
    a, b = random_tensor((m, k), dtype, seed=1), random_tensor((k, n), dtype, seed=2)
    check_against_eager(torch.mm, a, b, tolerances=MATMUL_TOLERANCES)


@settings(max_examples=10, deadline=None)
@given(batch=st.sampled_from([1, 3]), m=SIZES, k=SIZES, n=SIZES, dtype=DTYPES)
def test_bmm_matches_eager(batch, m, k, n, dtype):
    a, b = random_tensor((batch, m, k), dtype, seed=3), random_tensor((batch, k, n), dtype, seed=4)
    check_against_eager(torch.bmm, a, b, tolerances=MATMUL_TOLERANCES)


def test_linear_with_bias_large_and_ragged():
    # M = 300 (3 stationary tiles), K = 260 (3 chunks accumulated in PSUM), N = 600 (a 512 tile and a ragged one).
    x, w, b = random_tensor((300, 260), seed=5), random_tensor((600, 260), seed=6), random_tensor((600,), seed=7)
    check_against_eager(torch.nn.functional.linear, x, w, b, tolerances=MATMUL_TOLERANCES)


def test_addmm_alpha_beta_and_bf16_linear():
    a, b, c = random_tensor((17, 33), seed=8), random_tensor((33, 9), seed=9), random_tensor((17, 9), seed=10)
    check_against_eager(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), c, a, b,
                        tolerances=MATMUL_TOLERANCES)
    x, w = random_tensor((64, 96), torch.bfloat16, seed=11), random_tensor((40, 96), torch.bfloat16, seed=12)
    check_against_eager(torch.nn.functional.linear, x, w, tolerances=MATMUL_TOLERANCES)


def test_activation_epilogue_fuses_into_the_matmul_kernel():
    x, w, b = random_tensor((64, 32), seed=13), random_tensor((48, 32), seed=14), random_tensor((48,), seed=15)

    def mlp(x, w, b):
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)) * 2

    region, _ = compile_and_run(mlp, x, w, b)
    assert len(region.kernels) == 1
    assert "nc_matmul" in region.kernels[0].source and "nl.gelu" in region.kernels[0].source
    check_against_eager(mlp, x, w, b, tolerances=MATMUL_TOLERANCES)


def test_linear_transposes_on_tensor_engine_and_stays_near_roofline():
    # x @ W.T with W stored [N, K]: both operands have K contiguous, so both are loaded as whole rows and
    # transposed on TensorE; element-strided DMAs would make this kernel about 15x slower in the cost model.
    x, w = random_tensor((256, 512), torch.bfloat16, seed=16), random_tensor((1024, 512), torch.bfloat16, seed=17)
    before = stats.snapshot()
    region = check_against_eager(torch.nn.functional.linear, x, w, tolerances=MATMUL_TOLERANCES)
    after = stats.snapshot()
    assert region.kernels[0].source.count("nisa.nc_transpose") == 2
    assert after["est_time_s"] - before["est_time_s"] < 3 * (after["roofline_s"] - before["roofline_s"])
