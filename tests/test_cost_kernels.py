"""Cost model on real simulated kernels: a well-tiled 2048^3 bf16 matmul reaches TensorE peak, badly tiled
ones (operands reloaded per tile, fp32 inputs) and narrow transfers do not. Every kernel's output is checked
against numpy before its cost is looked at."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from neuron_compile import demo_kernels
from neuron_compile.runtime import simulator
from neuron_compile.runtime.simulator import isa as nisa
from neuron_compile.runtime.simulator import language as nl
from neuron_compile.hardware import TRN2


@simulator.jit
def reload_per_tile_matmul_kernel(lhsT, rhs):
    """Badly tiled on purpose: both operands are reloaded from HBM for every (m, n, k) tile, as 128x128 and
    128x512 transfers (256 B and 1 KiB per partition), so DMA, not TensorE, sets the pace."""
    K, M = lhsT.shape
    _, N = rhs.shape
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // 128):
        for n in nl.affine_range(N // 512):
            result_psum = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // 128):
                lhsT_tile = nl.ndarray((128, 128), dtype=lhsT.dtype, buffer=nl.sbuf)
                rhs_tile = nl.ndarray((128, 512), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=lhsT_tile, src=lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                nisa.dma_copy(dst=rhs_tile, src=rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                nisa.nc_matmul(dst=result_psum, stationary=lhsT_tile, moving=rhs_tile)
            result_tile = nl.ndarray((128, 512), dtype=result.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=result_tile, src=result_psum)
            nisa.dma_copy(dst=result[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512], src=result_tile)
    return result


def matmul_inputs(k, m, n, dtype=ml_dtypes.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    lhsT = rng.standard_normal((k, m), dtype=np.float32).astype(dtype)
    rhs = rng.standard_normal((k, n), dtype=np.float32).astype(dtype)
    return lhsT, rhs


def run_and_check_matmul(kernel, lhsT, rhs):
    run = simulator.run_kernel(kernel, (lhsT, rhs), target="trn2")
    output = np.asarray(run.outputs[0] if isinstance(run.outputs, (tuple, list)) else run.outputs)
    lhsT64, rhs64 = lhsT.astype(np.float64), rhs.astype(np.float64)
    reference = lhsT64.T @ rhs64
    # Error bound of a K-term fp32 sum (gamma_K = K * 2^-24 times the sum of |terms|), plus, for a bf16
    # output, its one rounding (half an ulp: 2^-8 relative).
    bound = lhsT.shape[0] * 2**-24 * (np.abs(lhsT64).T @ np.abs(rhs64))
    if output.dtype == ml_dtypes.bfloat16:
        bound += 2**-8 * np.abs(reference)
    assert np.all(np.abs(output.astype(np.float64) - reference) <= bound)
    return run.report


def tensor_peak_fraction(report):
    return report.achieved_flops_per_s / (TRN2.tensor_bf16_tflops * 1e12)


@pytest.fixture(scope="module")
def well_tiled_2048_report():
    return run_and_check_matmul(demo_kernels.matmul_kernel, *matmul_inputs(2048, 2048, 2048))


def test_well_tiled_2048_cubed_bf16_matmul_reaches_80_percent_of_tensor_peak(well_tiled_2048_report):
    report = well_tiled_2048_report
    assert report.flops == 2 * 2048**3
    assert report.hbm_bytes_read == 2 * 2048 * 2048 * 2  # each operand loaded exactly once
    assert report.hbm_bytes_written == 2048 * 2048 * 2
    assert report.instructions_per_engine["tensor"] == (2048 // 128) * (2048 // 512) * (2048 // 128)
    assert report.bottleneck == "tensor"
    assert tensor_peak_fraction(report) >= 0.8
    assert report.utilization >= 0.8
    assert report.est_time_s <= report.serial_time_s


def test_reloading_operands_per_tile_is_dma_bound():
    lhsT, rhs = matmul_inputs(512, 512, 512)
    bad = run_and_check_matmul(reload_per_tile_matmul_kernel, lhsT, rhs)
    good = run_and_check_matmul(demo_kernels.matmul_kernel, lhsT, rhs)
    assert bad.flops == good.flops == 2 * 512**3
    assert bad.bottleneck == "dma"
    assert bad.hbm_bytes_read == (512 // 512) * 512 * 512 * 2 + (512 // 128) * 512 * 512 * 2  # lhsT per n, rhs per m
    assert tensor_peak_fraction(bad) < 0.5
    # twice the bytes (3 MiB against 1.5 MiB) on the engine that sets the pace: about twice the device time
    # (the launch cost is the same for both)
    assert bad.device_time_s > 1.8 * good.device_time_s


def test_fp32_matmul_runs_at_a_quarter_of_the_bf16_rate():
    bf16 = run_and_check_matmul(demo_kernels.matmul_kernel, *matmul_inputs(512, 256, 1024))
    fp32 = run_and_check_matmul(demo_kernels.matmul_kernel, *matmul_inputs(512, 256, 1024, np.float32))
    assert fp32.cycles_per_engine["tensor"] == 4 * bf16.cycles_per_engine["tensor"]
    assert tensor_peak_fraction(fp32) < 0.3


def test_bigger_real_matmul_costs_more():
    small = run_and_check_matmul(demo_kernels.matmul_kernel, *matmul_inputs(128, 128, 512))
    big = run_and_check_matmul(demo_kernels.matmul_kernel, *matmul_inputs(256, 256, 1024))
    assert big.est_time_s > small.est_time_s
    assert (small.flops, big.flops) == (2 * 128 * 128 * 512, 2 * 256 * 256 * 1024)


def test_small_transfers_make_a_kernel_overhead_bound():
    rng = np.random.default_rng(1)
    narrow = [rng.standard_normal((1024, 16), dtype=np.float32) for _ in range(2)]  # 64 B per partition
    # 8 KiB per partition, 16 tiles: enough that filling and draining the load -> add -> store pipeline (one
    # tile's loads before the first add, its store after the last) is a small part of the time
    wide = [rng.standard_normal((1024, 4096), dtype=np.float32) for _ in range(2)]
    reports = {}
    for name, (a, b) in {"narrow": narrow, "wide": wide}.items():
        run = simulator.run_kernel(demo_kernels.tiled_add_kernel, (a, b), target="trn2")
        output = np.asarray(run.outputs[0] if isinstance(run.outputs, (tuple, list)) else run.outputs)
        np.testing.assert_array_equal(output, a + b)
        reports[name] = run.report
    assert reports["narrow"].bottleneck == reports["wide"].bottleneck == "dma"
    assert reports["narrow"].utilization < 0.25
    assert reports["wide"].utilization > 0.8


@simulator.jit
def copy_through_sbuf_kernel(x, transpose):
    """HBM -> SBUF -> HBM; with transpose=True the load reads x.T through a strided access pattern."""
    source = x.permute((1, 0)) if transpose else x
    tile = nl.ndarray(source.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=source)
    out = nl.ndarray(source.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def test_transposing_through_a_strided_dma_costs_more_than_a_contiguous_load():
    x = np.random.default_rng(2).standard_normal((128, 1024), dtype=np.float32)[:, :128].copy()
    reports = {}
    for transpose in (False, True):
        run = simulator.run_kernel(copy_through_sbuf_kernel, (x, transpose), target="trn2")
        np.testing.assert_array_equal(run.outputs[0], x.T if transpose else x)
        load = run.trace[0]
        assert load.srcs[0].innermost_stride_bytes == (128 * 4 if transpose else 4)
        reports[transpose] = run.report
    assert reports[True].hbm_bytes == reports[False].hbm_bytes  # the same bytes, moved less efficiently
    assert reports[True].cycles_per_engine["dma"] > 2 * reports[False].cycles_per_engine["dma"]
    assert reports[True].est_time_s > reports[False].est_time_s
