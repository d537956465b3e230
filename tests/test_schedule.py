"""The cost model's schedule (runtime/simulator/schedule.py) on real simulated kernels: overlap is earned by
the kernel, not assumed. One buffer serializes a load -> compute -> store loop; two buffers overlap it down
to the busiest engine; the NKI matmul tutorial's optimization ladder ranks as on the device; with lnc=2 the
two programs run on two cores. Every kernel's output is checked before its cost is looked at."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from neuron_compile import demo_kernels
from neuron_compile.hardware import TRN2
from neuron_compile.runtime import simulator
from neuron_compile.runtime.simulator import isa as nisa
from neuron_compile.runtime.simulator import language as nl

ROWS, COLS, TILES = 128, 2048, 8


@simulator.jit
def scale_rows_kernel(x, buffers):
    """out = 2 * x in TILES column tiles, through ``buffers`` SBUF slots per stage (allocated up front and
    reused round robin, as a kernel with explicit buffers does)."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    loaded = [nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf) for _ in range(buffers)]
    scaled = [nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf) for _ in range(buffers)]
    for t in range(TILES):
        columns = slice(t * COLS, (t + 1) * COLS)
        nisa.dma_copy(dst=loaded[t % buffers], src=x[:, columns])
        nisa.tensor_scalar(dst=scaled[t % buffers], data=loaded[t % buffers], op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out[:, columns], src=scaled[t % buffers])
    return out


def run_scale_rows(buffers):
    x = np.random.default_rng(0).standard_normal((ROWS, COLS * TILES), dtype=np.float32)
    run = simulator.run_kernel(scale_rows_kernel, (x, buffers), target="trn2")
    np.testing.assert_array_equal(run.outputs[0], 2 * x)
    return run.report


def test_one_buffer_costs_about_the_serial_sum_two_buffers_about_the_busiest_engine():
    single, double = run_scale_rows(1), run_scale_rows(2)
    assert single.flops == double.flops and single.hbm_bytes == double.hbm_bytes
    # one buffer: the next load waits for the scale to read the slot, the next scale for the store
    assert single.device_time_s >= 0.85 * (single.serial_time_s - single.launch_s)
    # two buffers: loads, scales and stores of neighbouring tiles overlap
    busiest = double.est_lower_bound_s - double.launch_s
    assert double.device_time_s <= 1.3 * busiest
    assert double.device_time_s < 0.75 * single.device_time_s
    # the lower bound holds for both, and the schedule never beats it
    for report in (single, double):
        assert report.est_lower_bound_s <= report.est_time_s <= report.serial_time_s


# ---- the NKI matmul tutorial's ladder: the same 2048^3 bf16 product, each step reloading less ----------
K = M = N = 2048


@simulator.jit
def tiled_matmul_kernel(lhsT, rhs):
    """Step 1: both operands reloaded for every (m, n, k) tile."""
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // 128):
        for n in range(N // 512):
            psum = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // 128):
                lhsT_tile = nl.ndarray((128, 128), dtype=lhsT.dtype, buffer=nl.sbuf)
                rhs_tile = nl.ndarray((128, 512), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=lhsT_tile, src=lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                nisa.dma_copy(dst=rhs_tile, src=rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                nisa.nc_matmul(dst=psum, stationary=lhsT_tile, moving=rhs_tile)
            store_result_tile(result, psum, m * 128, n * 512)
    return result


@simulator.jit
def hoisted_matmul_kernel(lhsT, rhs):
    """Step 2: lhsT's tiles of a row block loaded once and kept across the n loop; rhs still per tile."""
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // 128):
        lhsT_tiles = []
        for k in range(K // 128):
            tile = nl.ndarray((128, 128), dtype=lhsT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
            lhsT_tiles.append(tile)
        for n in range(N // 512):
            psum = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // 128):
                rhs_tile = nl.ndarray((128, 512), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=rhs_tile, src=rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                nisa.nc_matmul(dst=psum, stationary=lhsT_tiles[k], moving=rhs_tile)
            store_result_tile(result, psum, m * 128, n * 512)
    return result


@simulator.jit
def block_free_matmul_kernel(lhsT, rhs):
    """Step 3: rhs loaded as whole 2048-column rows per k (4 KiB per partition transfers), once per row
    block; the same bytes as step 2, in fewer and larger transfers."""
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // 128):
        lhsT_tiles, rhs_rows = [], []
        for k in range(K // 128):
            tile = nl.ndarray((128, 128), dtype=lhsT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
            lhsT_tiles.append(tile)
            row = nl.ndarray((128, N), dtype=rhs.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=rhs[k * 128:(k + 1) * 128, :])
            rhs_rows.append(row)
        for n in range(N // 512):
            psum = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // 128):
                nisa.nc_matmul(dst=psum, stationary=lhsT_tiles[k], moving=rhs_rows[k][:, n * 512:(n + 1) * 512])
            store_result_tile(result, psum, m * 128, n * 512)
    return result


def store_result_tile(result, psum, row, col):
    tile = nl.ndarray((128, 512), dtype=result.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile, src=psum)
    nisa.dma_copy(dst=result[row:row + 128, col:col + 512], src=tile)


@pytest.fixture(scope="module")
def ladder():
    rng = np.random.default_rng(3)
    lhsT = rng.standard_normal((K, M), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((K, N), dtype=np.float32).astype(ml_dtypes.bfloat16)
    reference = lhsT.astype(np.float32).T @ rhs.astype(np.float32)
    steps = {
        "tiled": tiled_matmul_kernel,
        "hoisted": hoisted_matmul_kernel,
        "block free": block_free_matmul_kernel,
        "optimized": demo_kernels.matmul_kernel,
    }
    reports = {}
    for name, kernel in steps.items():
        run = simulator.run_kernel(kernel, (lhsT, rhs), target="trn2")
        output = run.outputs[0].astype(np.float32)
        np.testing.assert_allclose(output, reference, rtol=2**-7, atol=0.1)
        reports[name] = run.report
    return reports


def test_matmul_ladder_ranks_as_the_tutorial(ladder):
    times = [report.est_time_s for report in ladder.values()]
    assert times == sorted(times, reverse=True), dict(zip(ladder, times))
    assert ladder["tiled"].est_time_s > 3 * ladder["optimized"].est_time_s


def test_matmul_ladder_bottlenecks(ladder):
    for name in ("tiled", "hoisted", "block free"):
        assert ladder[name].bottleneck == "dma", name
    optimized = ladder["optimized"]
    assert optimized.bottleneck == "tensor"
    peak_fraction = optimized.achieved_flops_per_s / (TRN2.tensor_bf16_tflops * 1e12)
    assert peak_fraction >= 0.9


def test_lnc2_runs_the_two_programs_on_two_cores():
    """One kernel whose programs each take half the rows: with lnc=2 the halves run at once."""
    x = np.random.default_rng(4).standard_normal((2 * ROWS, COLS * TILES), dtype=np.float32)
    one = simulator.run_kernel(half_per_program_kernel, (x,), target="trn2", lnc=1)
    two = simulator.run_kernel(half_per_program_kernel, (x,), target="trn2", lnc=2)
    np.testing.assert_array_equal(one.outputs[0], 2 * x)
    np.testing.assert_array_equal(two.outputs[0], 2 * x)
    assert (one.report.cores, two.report.cores) == (1, 2)
    assert two.report.hbm_bytes == one.report.hbm_bytes
    assert two.report.device_time_s < 0.6 * one.report.device_time_s


@simulator.jit
def half_per_program_kernel(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows_per_program = x.shape[0] // nl.num_programs(0)
    first = nl.program_id(0) * rows_per_program
    for row in range(first, first + rows_per_program, ROWS):
        for t in range(TILES):
            columns = slice(t * COLS, (t + 1) * COLS)
            loaded = nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=loaded, src=x[row:row + ROWS, columns])
            scaled = nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=scaled, data=loaded, op0=nl.multiply, operand0=2.0)
            nisa.dma_copy(dst=out[row:row + ROWS, columns], src=scaled)
    return out


@simulator.jit
def after_other_tiles_kernel(x, earlier_tiles):
    """``earlier_tiles`` tiles of another size allocated and released first (a finished kernel of the same
    launch, as in a region kernel), then out = (2 x + 1) / 2 through VectorE, GpSimd and ScalarE with fresh
    tiles per column tile."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for _ in range(earlier_tiles):
        wide = nl.ndarray((ROWS, 3 * COLS), dtype=x.dtype, buffer=nl.sbuf)
        nisa.memset(dst=wide[:, 0:1], value=0.0)
    for t in range(TILES):
        columns = slice(t * COLS, (t + 1) * COLS)
        loaded = nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=loaded, src=x[:, columns])
        doubled = nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=doubled, data=loaded, op0=nl.multiply, operand0=2.0)
        shifted = nl.ndarray((ROWS, COLS), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=shifted, data=doubled, op0=nl.add, operand0=1.0, engine=nisa.engine.gpsimd)
        nisa.tensor_scalar(dst=doubled, data=shifted, op0=nl.multiply, operand0=0.5, engine=nisa.engine.scalar)
        nisa.dma_copy(dst=out[:, columns], src=doubled)
    return out


def test_memory_freed_by_tiles_of_another_size_is_reused_so_later_tiles_still_overlap():
    """Released tiles of a size the later loop never allocates (16 x 24 KiB, more than SBUF holds) must not
    leave the ring full: the loop's tiles then reused the previous iteration's memory and ran one after
    another (29% longer here)."""
    x = np.random.default_rng(5).standard_normal((ROWS, COLS * TILES), dtype=np.float32)
    times = []
    for earlier_tiles in (0, 16):
        run = simulator.run_kernel(after_other_tiles_kernel, (x, earlier_tiles), target="trn2")
        np.testing.assert_array_equal(run.outputs[0], (2 * x + 1) * 0.5)
        times.append(run.report.device_time_s)
    alone, after_others = times
    assert after_others <= 1.02 * alone
