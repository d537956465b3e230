"""Demo kernels: each checked against numpy on the simulator over drawn shapes, and run_demo_kernels()'s text."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_compile import demo_kernels
from neuron_compile.runtime import simulator


def launch(kernel, *inputs):
    run = simulator.run_kernel(kernel, inputs, target="trn2")
    return np.asarray(run.outputs[0]), run.report


@settings(max_examples=10, deadline=None)
@given(row_tiles=st.integers(1, 3), cols=st.sampled_from([1, 7, 512, 2048, 4096]), seed=st.integers(0, 2**16))
def test_tiled_add_matches_numpy(row_tiles, cols, seed):
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((128 * row_tiles, cols), dtype=np.float32) for _ in range(2))
    output, report = launch(demo_kernels.tiled_add_kernel, a, b)
    np.testing.assert_array_equal(output, a + b)  # one fp32 add, rounded once, as numpy does
    assert report.hbm_bytes_read == 2 * a.nbytes and report.hbm_bytes_written == a.nbytes


@settings(max_examples=10, deadline=None)
@given(row_tiles=st.integers(1, 2), cols=st.sampled_from([1, 3, 100, 1024]), scale=st.sampled_from([1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_softmax_matches_numpy(row_tiles, cols, scale, seed):
    x = scale * np.random.default_rng(seed).standard_normal((128 * row_tiles, cols), dtype=np.float32)
    output, _ = launch(demo_kernels.softmax_kernel, x)
    reference = demo_kernels.numpy_softmax(x.astype(np.float64))
    # fp32 exp / sum / reciprocal: a few ulps of 2^-24 per step, over at most 1024 summed terms
    np.testing.assert_allclose(output, reference, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(output.sum(axis=-1), 1.0, rtol=1e-5)


@settings(max_examples=6, deadline=None)
@given(k_tiles=st.integers(1, 3), m_tiles=st.integers(1, 2), n_tiles=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_matmul_matches_numpy(k_tiles, m_tiles, n_tiles, seed):
    rng = np.random.default_rng(seed)
    k, m, n = 128 * k_tiles, 128 * m_tiles, 512 * n_tiles
    lhsT = rng.standard_normal((k, m), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((k, n), dtype=np.float32).astype(ml_dtypes.bfloat16)
    output, report = launch(demo_kernels.matmul_kernel, lhsT, rhs)
    lhsT64, rhs64 = lhsT.astype(np.float64), rhs.astype(np.float64)
    reference = lhsT64.T @ rhs64
    # fp32 accumulation of K products (gamma_K bound) plus the one rounding to the bf16 output (2^-8 relative)
    bound = k * 2**-24 * (np.abs(lhsT64).T @ np.abs(rhs64)) + 2**-8 * np.abs(reference)
    assert output.dtype == ml_dtypes.bfloat16
    assert np.all(np.abs(output.astype(np.float64) - reference) <= bound)
    assert report.flops == 2 * k * m * n


def test_run_demo_kernels_reports_checks_and_costs():
    text = demo_kernels.run_demo_kernels()
    assert text.count(" ok\n") == 3 and "MISMATCH" not in text
    assert text.count("cost report (trn2)") == 3
    for name in ("tiled add", "matmul", "softmax"):
        assert name in text
