"""Complete NKI kernels in the style of the NKI tutorials, run on the simulator and checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from neuron_compile.runtime import simulator as nki

nl = nki.language
nisa = nki.isa
F32 = np.float32
P = 128


def _random(shape, dtype=F32, seed=0, low=-2.0, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(F32).astype(dtype)


def _row_tiles(rows):
    """(start, size) of each partition tile of ``rows`` rows; the last one is ragged."""
    return [(start, min(P, rows - start)) for start in range(0, rows, P)]


@nki.jit
def tiled_add(a, b):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    rows, cols = a.shape
    for start, size in _row_tiles(rows):
        ta = nl.ndarray((size, cols), a.dtype, buffer=nl.sbuf)
        tb = nl.ndarray((size, cols), b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ta, src=a[start:start + size, :])
        nisa.dma_copy(dst=tb, src=b[start:start + size, :])
        tc = nl.ndarray((size, cols), a.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=tc, data1=ta, data2=tb, op=nl.add)
        nisa.dma_copy(dst=out[start:start + size, :], src=tc)
    return out


@pytest.mark.parametrize("dtype", [np.dtype(F32), nl.bfloat16])
def test_tiled_add_with_ragged_last_tile(dtype):
    a, b = _random((300, 130), dtype, 1), _random((300, 130), dtype, 2)
    np.testing.assert_array_equal(tiled_add(a, b), (a.astype(F32) + b.astype(F32)).astype(dtype))


@nki.jit
def blocked_matmul(a, b):
    """C[M, N] = A[M, K] @ B[K, N]: A tiles are transposed on TensorE to put K on partitions, K accumulates in
    PSUM, N is blocked by the moving limit (512)."""
    m_size, k_size = a.shape
    _, n_size = b.shape
    out = nl.ndarray((m_size, n_size), nl.float32, buffer=nl.shared_hbm)
    n_block = nl.tile_size.gemm_moving_fmax
    for m0, m in _row_tiles(m_size):
        # stationary tiles A[m, k].T, loaded once per row block and kept resident across the N loop
        stationary = []
        for k0, k in _row_tiles(k_size):
            a_tile = nl.ndarray((m, k), a.dtype)
            nisa.dma_copy(a_tile, a[m0:m0 + m, k0:k0 + k])
            a_t_psum = nl.ndarray((k, m), a.dtype, buffer=nl.psum)
            nisa.nc_transpose(a_t_psum, a_tile)
            a_t = nl.ndarray((k, m), a.dtype)
            nisa.tensor_copy(a_t, a_t_psum)
            stationary.append((k0, k, a_t))
        for n0 in range(0, n_size, n_block):
            n = min(n_block, n_size - n0)
            acc = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
            for k0, k, a_t in stationary:
                b_tile = nl.ndarray((k, n), b.dtype)
                nisa.dma_copy(b_tile, b[k0:k0 + k, n0:n0 + n])
                nisa.nc_matmul(acc, a_t, b_tile)
            result = nl.ndarray((m, n), nl.float32)
            nisa.tensor_copy(result, acc)
            nisa.dma_copy(out[m0:m0 + m, n0:n0 + n], result)
    return out


@pytest.mark.parametrize("dtype", [np.dtype(F32), nl.bfloat16])
def test_blocked_matmul_accumulates_k_in_psum(dtype):
    a, b = _random((200, 300), dtype, 3), _random((300, 640), dtype, 4)
    golden = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(blocked_matmul(a, b), golden, rtol=1e-5, atol=1e-4)
    names = [r.name for r in blocked_matmul.last_run.trace]
    assert names.count("nc_matmul") == 2 * 2 * 3  # M tiles x N blocks x K tiles


@nki.jit
def transpose_2d(x):
    rows, cols = x.shape
    out = nl.ndarray((cols, rows), x.dtype, buffer=nl.shared_hbm)
    for r0, r in _row_tiles(rows):
        for c0, c in _row_tiles(cols):
            tile = nl.ndarray((r, c), x.dtype)
            nisa.dma_copy(tile, x[r0:r0 + r, c0:c0 + c])
            flipped = nl.ndarray((c, r), x.dtype, buffer=nl.psum)
            nisa.nc_transpose(flipped, tile)
            staged = nl.ndarray((c, r), x.dtype)
            nisa.tensor_copy(staged, flipped)
            nisa.dma_copy(out[c0:c0 + c, r0:r0 + r], staged)
    return out


def test_transpose_kernel():
    x = _random((150, 260), nl.bfloat16, 5)
    np.testing.assert_array_equal(transpose_2d(x), x.T)


@nki.jit
def softmax_rows(x):
    """The Neuron compiler's own softmax sequence: max -> exp(x - max) with a sum -> reciprocal -> multiply."""
    rows, cols = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for start, size in _row_tiles(rows):
        tile = nl.ndarray((size, cols), nl.float32)
        nisa.dma_copy(tile, x[start:start + size, :])
        neg_max = nl.ndarray((size, 1), nl.float32)
        nisa.tensor_reduce(neg_max, nl.maximum, tile, axis=1, negate=True)
        exps = nl.ndarray((size, cols), nl.float32)
        total = nl.ndarray((size, 1), nl.float32)
        nisa.activation(exps, nl.exp, tile, bias=neg_max, reduce_op=nl.add, reduce_res=total)
        inverse = nl.ndarray((size, 1), nl.float32)
        nisa.reciprocal(inverse, total)
        result = nl.ndarray((size, cols), x.dtype)
        nisa.tensor_scalar(result, exps, nl.multiply, inverse)
        nisa.dma_copy(out[start:start + size, :], result)
    return out


@pytest.mark.parametrize("dtype", [np.dtype(F32), nl.bfloat16])
def test_softmax(dtype):
    x = _random((300, 1000), dtype, 6, -5, 5)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    golden = e / e.sum(axis=1, keepdims=True)
    tol = 8e-3 if dtype == nl.bfloat16 else 1e-6
    np.testing.assert_allclose(softmax_rows(x).astype(np.float64), golden, rtol=tol, atol=1e-7)


@nki.jit
def rmsnorm(x, weight, eps):
    rows, dim = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for start, size in _row_tiles(rows):
        # the weight row broadcast to every partition by a stride-0 partition step on HBM
        w = nl.ndarray((size, dim), nl.float32)
        nisa.dma_copy(w, weight.ap([[0, size], [1, dim]]))
        tile = nl.ndarray((size, dim), nl.float32)
        nisa.dma_copy(tile, x[start:start + size, :])
        squares = nl.ndarray((size, dim), nl.float32)
        sum_sq = nl.ndarray((size, 1), nl.float32)
        nisa.activation(squares, nl.square, tile, reduce_op=nl.add, reduce_res=sum_sq)
        mean_sq = nl.ndarray((size, 1), nl.float32)
        nisa.tensor_scalar(mean_sq, sum_sq, nl.multiply, 1.0 / dim, op1=nl.add, operand1=eps)
        rstd = nl.ndarray((size, 1), nl.float32)
        nisa.activation(rstd, nl.rsqrt, mean_sq)
        normed = nl.ndarray((size, dim), nl.float32)
        nisa.tensor_scalar(normed, tile, nl.multiply, rstd)
        result = nl.ndarray((size, dim), x.dtype)
        nisa.tensor_tensor(result, normed, w, nl.multiply)
        nisa.dma_copy(out[start:start + size, :], result)
    return out


def test_rmsnorm():
    x, w = _random((260, 96), F32, 7), _random((96,), F32, 8)
    golden = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rmsnorm(x, w, 1e-6), golden, rtol=1e-5, atol=1e-6)


@nki.jit
def layernorm(x, gamma, beta, eps):
    rows, dim = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    chunk = nl.tile_size.bn_stats_fmax
    chunks = [(c0, min(chunk, dim - c0)) for c0 in range(0, dim, chunk)]
    for start, size in _row_tiles(rows):
        g = nl.ndarray((size, dim), nl.float32)
        b = nl.ndarray((size, dim), nl.float32)
        nisa.dma_copy(g, gamma.ap([[0, size], [1, dim]]))
        nisa.dma_copy(b, beta.ap([[0, size], [1, dim]]))
        tile = nl.ndarray((size, dim), nl.float32)
        nisa.dma_copy(tile, x[start:start + size, :])
        stats = nl.ndarray((size, 6 * len(chunks)), nl.float32)
        for i, (c0, c) in enumerate(chunks):
            nisa.bn_stats(stats[:, 6 * i:6 * (i + 1)], tile[:, c0:c0 + c])
        mean_var = nl.ndarray((size, 2), nl.float32)
        nisa.bn_aggr(mean_var, stats)
        var_eps = nl.ndarray((size, 1), nl.float32)
        nisa.tensor_scalar(var_eps, mean_var[:, 1:2], nl.add, eps)
        rstd = nl.ndarray((size, 1), nl.float32)
        nisa.activation(rstd, nl.rsqrt, var_eps)
        normed = nl.ndarray((size, dim), nl.float32)
        nisa.tensor_scalar(normed, tile, nl.subtract, mean_var[:, 0:1], op1=nl.multiply, operand1=rstd)
        scaled = nl.ndarray((size, dim), nl.float32)
        nisa.tensor_tensor(scaled, normed, g, nl.multiply)
        result = nl.ndarray((size, dim), x.dtype)
        nisa.tensor_tensor(result, scaled, b, nl.add)
        nisa.dma_copy(out[start:start + size, :], result)
    return out


def test_layernorm_with_bn_stats_and_bn_aggr():
    x = _random((140, 1100), F32, 9, -3, 5)
    gamma, beta = _random((1100,), F32, 10), _random((1100,), F32, 11)
    x64 = x.astype(np.float64)
    golden = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5) * gamma + beta
    np.testing.assert_allclose(layernorm(x, gamma, beta, 1e-5), golden, rtol=1e-4, atol=1e-4)


@nki.jit
def avg_pool_2x2(x):
    """x[C, H, W] -> [C, H/2, W/2]: an access pattern exposes each 2x2 window as the last two dims."""
    channels, height, width = x.shape
    out = nl.ndarray((channels, height // 2, width // 2), x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((channels, height, width), x.dtype)
    nisa.dma_copy(tile, x)
    windows = tile.ap([[height * width, channels], [2 * width, height // 2], [2, width // 2], [width, 2], [1, 2]])
    total = nl.ndarray((channels, height // 2, width // 2), nl.float32)
    nisa.tensor_reduce(total, nl.add, windows, axis=(3, 4))
    result = nl.ndarray(total.shape, x.dtype)
    nisa.tensor_scalar(result, total, nl.multiply, 0.25)
    nisa.dma_copy(out, result)
    return out


def test_average_pooling_through_access_patterns():
    x = _random((64, 12, 10), F32, 12)
    golden = x.reshape(64, 6, 2, 5, 2).mean(axis=(2, 4))
    np.testing.assert_allclose(avg_pool_2x2(x), golden, rtol=1e-6, atol=1e-6)


@nki.jit
def cumsum_rows(x):
    """Running sum along the free dim in chunks; each chunk starts from the previous chunk's last column."""
    rows, cols = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    chunk = 256
    for start, size in _row_tiles(rows):
        ones = nl.ndarray((size, chunk), nl.float32)
        nisa.memset(ones, 1.0)
        carry = nl.ndarray((size, 1), nl.float32)
        nisa.memset(carry, 0.0)
        for c0 in range(0, cols, chunk):
            c = min(chunk, cols - c0)
            tile = nl.ndarray((size, c), nl.float32)
            nisa.dma_copy(tile, x[start:start + size, c0:c0 + c])
            sums = nl.ndarray((size, c), nl.float32)
            nisa.tensor_tensor_scan(sums, ones[:, :c], tile, carry, nl.multiply, nl.add)
            nisa.tensor_copy(carry, sums[:, c - 1:c])
            nisa.dma_copy(out[start:start + size, c0:c0 + c], sums)
    return out


def test_cumsum_via_tensor_tensor_scan():
    x = _random((130, 600), F32, 13)
    np.testing.assert_allclose(cumsum_rows(x), np.cumsum(x.astype(np.float64), axis=1), rtol=1e-4, atol=1e-4)


@nki.jit
def causal_masked_scores(scores):
    """Rows are query positions, columns key positions: keep key <= query, else -inf-like."""
    rows, cols = scores.shape
    out = nl.ndarray(scores.shape, scores.dtype, buffer=nl.shared_hbm)
    for start, size in _row_tiles(rows):
        tile = nl.ndarray((size, cols), scores.dtype)
        nisa.dma_copy(tile, scores[start:start + size, :])
        masked = nl.ndarray((size, cols), scores.dtype)
        # affine value = (start + partition) - column; keep where >= 0
        nisa.affine_select(masked, [[-1, cols]], 1, tile, -30000.0, cmp_op=nl.greater_equal, offset=start)
        nisa.dma_copy(out[start:start + size, :], masked)
    return out


def test_causal_mask_via_affine_select():
    x = _random((200, 200), F32, 14)
    golden = np.where(np.tril(np.ones((200, 200), bool)), x, F32(-30000.0))
    np.testing.assert_array_equal(causal_masked_scores(x), golden)


@nki.jit
def embedding(table, ids):
    """out[i] = table[ids[i]]: one indirect DMA gather per 128 ids."""
    vocab, dim = table.shape
    (count,) = ids.shape
    out = nl.ndarray((count, dim), table.dtype, buffer=nl.shared_hbm)
    ids_2d = ids.reshape((count, 1))
    for start, size in _row_tiles(count):
        index = nl.ndarray((size, 1), nl.int32)
        nisa.dma_copy(index, ids_2d[start:start + size, :])
        rows = nl.ndarray((size, dim), table.dtype)
        nisa.dma_copy(rows, table.ap([[dim, size], [1, dim]], offset=0, vector_offset=index, indirect_dim=0))
        nisa.dma_copy(out[start:start + size, :], rows)
    return out


def test_embedding_gather_via_indirect_dma():
    table = _random((1000, 48), nl.bfloat16, 15)
    ids = np.random.default_rng(16).integers(0, 1000, size=300).astype(np.int32)
    np.testing.assert_array_equal(embedding(table, ids), table[ids])
    assert any(r.attrs.get("indirect") for r in embedding.last_run.trace)


def test_dumped_kernel_source_runs_through_load_module():
    source = '''
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def relu_bias(x, bias):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    b = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    nisa.dma_copy(dst=b, src=bias)
    nisa.activation(dst=tile, op=nl.relu, data=tile, bias=b, scale=2.0)
    nisa.dma_copy(dst=out, src=tile)
    return out
'''
    module = nki.load_module(source, "relu_bias_module")
    x, bias = _random((100, 70), F32, 17), _random((100, 1), F32, 18)
    np.testing.assert_array_equal(module.relu_bias(x, bias), np.maximum(x * F32(2) + bias, 0))
