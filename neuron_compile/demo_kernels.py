"""Demo stage: three hand-written NKI kernels (tiled add, tiled matmul, row softmax) run on the built-in
simulator. Input: nothing (fixed shapes, seeded inputs); output: ``run_demo_kernels()`` returns a text
report, each kernel's check against numpy and its cost-model report.

The kernels are plain modern NKI (``nki.jit``, dst-first ``nki.isa`` calls on explicitly allocated
``nl.ndarray`` buffers): the same source runs on a Neuron device with the real ``nki``. Here ``nki``,
``nl`` and ``nisa`` are the simulator's modules of the same names.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from neuron_compile.runtime import simulator as nki
from neuron_compile.runtime.simulator import isa as nisa
from neuron_compile.runtime.simulator import language as nl

# ---------------------------------------------------------------------------------------------------------
# 1. Tiled elementwise add: rows on the 128 partitions, columns in chunks along the free axis.
# ---------------------------------------------------------------------------------------------------------


@nki.jit
def tiled_add_kernel(a, b):
    """out = a + b for [rows, cols] tensors; rows a multiple of 128, cols a multiple of COLS_PER_TILE."""
    rows, cols = a.shape
    ROWS_PER_TILE = nl.tile_size.pmax  # 128 partitions
    COLS_PER_TILE = min(cols, 2048)  # 8 KiB of fp32 per partition: large enough for efficient DMA
    assert rows % ROWS_PER_TILE == 0, f"rows={rows} must be a multiple of {ROWS_PER_TILE}"
    assert cols % COLS_PER_TILE == 0, f"cols={cols} must be at most, or a multiple of, {COLS_PER_TILE}"
    out = nl.ndarray((rows, cols), dtype=a.dtype, buffer=nl.shared_hbm)

    for r in nl.affine_range(rows // ROWS_PER_TILE):
        for c in nl.affine_range(cols // COLS_PER_TILE):
            row_slice = slice(r * ROWS_PER_TILE, (r + 1) * ROWS_PER_TILE)
            col_slice = slice(c * COLS_PER_TILE, (c + 1) * COLS_PER_TILE)
            a_tile = nl.ndarray((ROWS_PER_TILE, COLS_PER_TILE), dtype=a.dtype, buffer=nl.sbuf)
            b_tile = nl.ndarray((ROWS_PER_TILE, COLS_PER_TILE), dtype=b.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a_tile, src=a[row_slice, col_slice])
            nisa.dma_copy(dst=b_tile, src=b[row_slice, col_slice])

            sum_tile = nl.ndarray((ROWS_PER_TILE, COLS_PER_TILE), dtype=a.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=sum_tile, data1=a_tile, data2=b_tile, op=nl.add)
            nisa.dma_copy(dst=out[row_slice, col_slice], src=sum_tile)
    return out


# ---------------------------------------------------------------------------------------------------------
# 2. Tiled matmul, result = lhsT.T @ rhs. TensorE contracts over the partition axis, so both operands
#    arrive with K first (lhsT is the left operand already transposed, as in the NKI tutorial).
# ---------------------------------------------------------------------------------------------------------


@nki.jit
def matmul_kernel(lhsT, rhs):
    """[K, M] x [K, N] -> [M, N]: stationary tiles 128x128, moving tiles 128x512, K accumulated in PSUM.

    Each operand crosses HBM once and the loads overlap TensorE. For every block of BLOCK_M result rows, the
    loop runs over 512-column strips of rhs: a strip (all of K, one transfer of K/128 x 512 per partition) is
    loaded, then every 128-row slice of lhsT multiplies it. lhsT's slices (all of K, one transfer each) are
    loaded the first time they are needed, during the first strip, and stay resident for the others. So the
    first matmul waits for one strip and one slice only; the next strip is prefetched before the current one
    is used (two strips live: the allocator gives each fresh memory, so the prefetch does not wait for the
    current strip's readers). SBUF per partition: (K / 128) * (BLOCK_M + 2 * 512) * itemsize bytes (96 KiB at
    K = 2048, bf16).
    """
    K, M = lhsT.shape
    K_, N = rhs.shape
    assert K == K_, f"contraction dims differ: lhsT has K={K}, rhs has K={K_}"
    TILE_K = nl.tile_size.pmax  # 128: contraction on the partitions
    TILE_M = nl.tile_size.gemm_stationary_fmax  # 128: stationary free size, the result's partitions
    TILE_N = nl.tile_size.gemm_moving_fmax  # 512: moving free size, one PSUM bank of fp32
    BLOCK_M = min(M, 2048)
    K_TILES = K // TILE_K
    assert K % TILE_K == 0 and M % BLOCK_M == 0 and BLOCK_M % TILE_M == 0, f"K={K}, M={M} must tile by 128"
    assert N % TILE_N == 0, f"N={N} must tile by 512"
    result = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)

    def load_rhs_strip(n):
        # rhs[k_tile * 128 + p, n * 512 + j] -> strip[p, k_tile, j]
        strip = nl.ndarray((TILE_K, K_TILES, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=strip, src=rhs.ap([[N, TILE_K], [TILE_K * N, K_TILES], [1, TILE_N]], n * TILE_N))
        return strip

    for m_block in nl.affine_range(M // BLOCK_M):
        lhsT_slices = {}  # m -> [128 (k within a tile), K/128 (k tile), 128 (m)], loaded on first use
        next_strip = load_rhs_strip(0)
        for n in nl.affine_range(N // TILE_N):
            rhs_strip = next_strip
            for m in nl.affine_range(BLOCK_M // TILE_M):
                row = m_block * BLOCK_M + m * TILE_M
                if m not in lhsT_slices:
                    lhsT_slice = nl.ndarray((TILE_K, K_TILES, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=lhsT_slice, src=lhsT.ap([[M, TILE_K], [TILE_K * M, K_TILES], [1, TILE_M]], row))
                    lhsT_slices[m] = lhsT_slice
                if m == 0 and n + 1 < N // TILE_N:
                    next_strip = load_rhs_strip(n + 1)  # prefetch: it lands while TensorE works on this strip
                # The first matmul into a PSUM tile overwrites it; the following ones accumulate.
                result_psum = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
                for k in nl.affine_range(K_TILES):
                    nisa.nc_matmul(dst=result_psum, stationary=lhsT_slices[m][:, k, :], moving=rhs_strip[:, k, :])
                # PSUM -> SBUF, casting fp32 to the output dtype on the way; then SBUF -> HBM.
                result_tile = nl.ndarray((TILE_M, TILE_N), dtype=result.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=result_tile, src=result_psum)
                nisa.dma_copy(dst=result[row:row + TILE_M, n * TILE_N:(n + 1) * TILE_N], src=result_tile)
    return result


# ---------------------------------------------------------------------------------------------------------
# 3. Row softmax: rows on partitions, the reduced axis on the free axis (the sequence the Neuron compiler
#    emits: max -> exp(x - max) with the row sum on the side -> reciprocal -> multiply).
# ---------------------------------------------------------------------------------------------------------


@nki.jit
def softmax_kernel(x):
    """softmax(x, axis=-1) for [rows, cols] fp32, rows a multiple of 128, cols <= 64K elements."""
    rows, cols = x.shape
    P = nl.tile_size.pmax
    assert rows % P == 0, f"rows={rows} must be a multiple of {P}"
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)

    for r in nl.affine_range(rows // P):
        x_tile = nl.ndarray((P, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_tile, src=x[r * P:(r + 1) * P, :])

        # -max per row, so that it can be the activation's bias: exp(x + (-max)) never overflows.
        neg_row_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_row_max, op=nl.maximum, data=x_tile, axis=1, negate=True, keepdims=True)

        # ScalarE computes exp and, in the same pass, adds each row into row_sum.
        exp_tile = nl.ndarray((P, cols), dtype=x.dtype, buffer=nl.sbuf)
        row_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=exp_tile, op=nl.exp, data=x_tile, bias=neg_row_max, reduce_op=nl.add,
                        reduce_res=row_sum)

        inverse_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inverse_sum, data=row_sum)
        out_tile = nl.ndarray((P, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out_tile, data=exp_tile, op0=nl.multiply, operand0=inverse_sum)
        nisa.dma_copy(dst=out[r * P:(r + 1) * P, :], src=out_tile)
    return out


# ---------------------------------------------------------------------------------------------------------
# Running them
# ---------------------------------------------------------------------------------------------------------


def numpy_softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def demo_cases(rng: np.random.Generator) -> list[tuple[str, object, tuple, np.ndarray, float]]:
    """(name, kernel, inputs, numpy reference, tolerance) for each demo kernel, at demo sizes."""
    a = rng.standard_normal((256, 4096), dtype=np.float32)
    b = rng.standard_normal((256, 4096), dtype=np.float32)
    lhsT = rng.standard_normal((512, 256), dtype=np.float32).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((512, 1024), dtype=np.float32).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((256, 1024), dtype=np.float32)
    matmul_reference = lhsT.astype(np.float32).T @ rhs.astype(np.float32)
    # The bf16 output is rounded once: at most half an ulp, 2^-8 = 3.9e-3 relative; fp32 accumulation order
    # adds ~1e-6 on top.
    return [
        ("tiled add [256x4096] fp32", tiled_add_kernel, (a, b), a + b, 1e-6),
        ("matmul [512x256]^T @ [512x1024] bf16", matmul_kernel, (lhsT, rhs), matmul_reference, 5e-3),
        ("softmax [256x1024] fp32", softmax_kernel, (x,), numpy_softmax(x), 1e-5),
    ]


def run_demo_kernels(target: str | None = None) -> str:
    """Run the three kernels on the simulator; return, for each, its max error vs numpy and cost report."""
    sections = []
    for name, kernel, inputs, reference, tolerance in demo_cases(np.random.default_rng(0)):
        run = nki.run_kernel(kernel, inputs, target=target)
        output = np.asarray(run.outputs[0] if isinstance(run.outputs, (tuple, list)) else run.outputs)
        error = float(np.max(np.abs(output.astype(np.float32) - reference) / (1.0 + np.abs(reference))))
        verdict = "ok" if error <= tolerance else "MISMATCH"
        sections.append(f"{name}: max relative error vs numpy {error:.2e} (tolerance {tolerance:.0e}) {verdict}\n"
                        f"{run.report.format()}")
    return "\n\n".join(sections)


if __name__ == "__main__":
    print(run_demo_kernels())
