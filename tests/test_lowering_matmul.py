"""Matmul lowerings (mm, bmm, addmm / linear) on the simulator vs eager.

fp32 tolerance here is rtol 1e-4 / atol 1e-4 rather than the pointwise 1e-5: a K-long dot product summed in a
different order than ATen's blocked kernel differs by up to about K * 2**-24 relative to sum(|a * b|).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile import config
from neuron_compile.lowering import unsupported_reason
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


@pytest.mark.parametrize("target, transpose, bound", [("trn2", "nisa.dma_transpose", 1.7), ("trn1", "nisa.nc_transpose", 6)])
def test_linear_transposes_its_operands_and_stays_near_roofline(target, transpose, bound):
    # x @ W.T with W stored [N, K]: both operands have K contiguous, so both are transposed on the way to
    # K-on-partitions tiles: by the DMA engines where the target has dma_transpose (trn2+), else whole rows are
    # loaded and transposed on TensorE (element-strided DMAs would be about 15x slower in the cost model).
    x, w = random_tensor((256, 1024), torch.bfloat16, seed=16), random_tensor((2048, 1024), torch.bfloat16, seed=17)
    with config.patch(target=target):
        before = stats.snapshot()
        region = check_against_eager(torch.nn.functional.linear, x, w, tolerances=MATMUL_TOLERANCES)
        after = stats.snapshot()
    source = region.kernels[0].source
    assert source.count(transpose) == 2
    assert "nisa.nc_transpose" not in source if target == "trn2" else "nisa.dma_transpose" not in source
    device, roofline = (after[key] - before[key] for key in ("est_time_s", "roofline_s"))
    device -= after["launch_s"] - before["launch_s"]
    assert device < bound * roofline, (device, roofline)


@settings(max_examples=10, deadline=None)
@given(m=SIZES, k=st.sampled_from([1, 127, 128, 129, 300]), n=SIZES, dtype=DTYPES)
def test_linear_on_trn1_transposes_on_tensor_engine(m, k, n, dtype):
    x, w = random_tensor((m, k), dtype, seed=40), random_tensor((n, k), dtype, seed=41)
    with config.patch(target="trn1"):
        region = check_against_eager(torch.nn.functional.linear, x, w, tolerances=MATMUL_TOLERANCES)
    assert "nisa.dma_transpose" not in region.kernels[0].source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, bias_shape", [(5, 10, (5,)), (1, 1, ()), (129, 127, (1,)), (128, 300, (128,))])
def test_addmv_matches_eager(rows, k, bias_shape, dtype):
    mat, vec = random_tensor((rows, k), dtype, seed=18), random_tensor((k,), dtype, seed=19)
    bias = random_tensor(bias_shape, dtype, seed=20)
    check_against_eager(torch.addmv, bias, mat, vec, tolerances=MATMUL_TOLERANCES)
    check_against_eager(lambda b, m, v: torch.addmv(b, m, v, beta=0.2, alpha=0.6), bias, mat, vec,
                        tolerances=MATMUL_TOLERANCES)


def test_addmv_strided_operands_and_beta_zero_ignores_nan_bias():
    mat = random_tensor((40, 9), seed=21).t()  # (9, 40), column-major
    vec = random_tensor((80,), seed=22)[::2]
    bias = torch.full((9,), float("nan"))
    check_against_eager(lambda b, m, v: torch.addmv(b, m, v, beta=0.0, alpha=2.0), bias, mat, vec,
                        tolerances=MATMUL_TOLERANCES)
    c = torch.full((17, 9), float("inf"))
    a, b = random_tensor((17, 33), seed=23), random_tensor((33, 9), seed=24)
    check_against_eager(lambda c, a, b: torch.addmm(c, a, b, beta=0), c, a, b, tolerances=MATMUL_TOLERANCES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, rows, k, cols, bias_shape", [(5, 5, 5, 10, (5, 10)), (1, 1, 1, 1, ()),
                                                              (3, 129, 64, 130, (130,)), (2, 7, 128, 3, (7, 1))])
def test_addbmm_matches_eager(batch, rows, k, cols, bias_shape, dtype):
    batch1, batch2 = random_tensor((batch, rows, k), dtype, seed=25), random_tensor((batch, k, cols), dtype, seed=26)
    bias = random_tensor(bias_shape, dtype, seed=27)
    check_against_eager(lambda s, x, y: torch.addbmm(s, x, y, beta=0.6, alpha=0.2), bias, batch1, batch2,
                        tolerances=MATMUL_TOLERANCES)


def test_addbmm_declines_mixed_dtypes():
    bias, batch1 = random_tensor((2, 3)), random_tensor((2, 2, 4))
    batch2 = random_tensor((2, 4, 3), torch.bfloat16)
    gm = trace(lambda s, x, y: torch.addbmm(s, x, y.float()), bias, batch1, batch2)
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten.addbmm.default)
    assert unsupported_reason(node) is None
    gm = trace(lambda s, x, y: torch.ops.aten.addbmm(s, x, y), bias, batch1, batch2.float())
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten.addbmm.default)
    node.args[2].meta["val"] = node.args[2].meta["val"].to(torch.bfloat16)
    assert "mixed operand dtypes" in unsupported_reason(node)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("k, n, dtype", [(3072, 600, torch.float32), (6000, 600, torch.bfloat16)])
def test_large_k_matmul_fits_sbuf(k, n, dtype, target):
    # x @ W.T with K this large: on trn1 all of W^T's transposed K chunks for a 512-wide N tile would not fit
    # SBUF beside the rest, so the plan streams them (128-wide N tiles, each chunk transposed on TensorE and
    # multiplied at once); trn2 keeps the DMA-transposed form (narrower N tiles where K needs it). The error
    # against float64 must be no larger than eager's own, within a few K-scaled ulps.
    x, weight = random_tensor((130, k), dtype, seed=1), random_tensor((n, k), dtype, seed=2)
    with config.patch(target=target):
        region, (got,) = compile_and_run(lambda a, w: torch.nn.functional.linear(a, w), x, weight)
    source = region.kernels[0].source
    if target == "trn1":
        assert f"free [{n}/128] K" in source and "streamed per K chunk" in source
    else:
        assert "a^T resident per 256 rows" in source and "nisa.dma_transpose" in source
    reference = x.double() @ weight.double().t()
    eager_error = (torch.nn.functional.linear(x, weight).double() - reference).abs().max().item()
    our_error = (got.double() - reference).abs().max().item()
    assert our_error <= eager_error * 1.5, (our_error, eager_error)


@pytest.mark.parametrize("rows, cols", [(1, 600), (129, 7), (300, 513)])
def test_a_per_row_epilogue_operand_is_loaded_as_a_column(rows, cols):
    """(a @ b) * r[:, None] (an RMSNorm backward's rsqrt in the matmul's epilogue): r comes in as one element per
    partition, a (P, 1) operand, never a DMA broadcast of each repeated element."""
    a, b = random_tensor((rows, 64), seed=1), random_tensor((64, cols), seed=2)
    r = random_tensor((rows,), seed=3)
    region = check_against_eager(lambda a, b, r: (a @ b) * r[:, None], a, b, r)
    (kernel,) = region.kernels
    assert kernel.name.startswith("matmul_kernel") and "_column_" in kernel.source
    assert not re.search(r"src=\w+\.ap\(\[\[\d+, rows\], \[0, cols\]\]", kernel.source)


@pytest.mark.parametrize("m, k, n, dtype, transposed_weight", [
    (400, 5120, 600, torch.float32, False),  # ragged M and N: 3 blocks and 16 rows, a 512 tile and 88 columns
    (700, 5120, 600, torch.bfloat16, True),  # x @ W.T: b's kept tiles arrive by DMA transpose, K chunks per load
    (385, 4999, 1100, torch.float32, False),  # ragged K: one DMA per K chunk; three column groups
])
def test_matmul_keeps_b_resident_when_b_would_be_read_again(m, k, n, dtype, transposed_weight):
    # With K this long a^T of every row does not fit SBUF, so the a-resident form would read b once per row group;
    # b's tiles are kept instead (a read once per column group), and the bias, gate and residual epilogue runs on
    # every (row block, column tile) all the same. A K this long sums in another order than eager's: the error
    # against float64 must be no larger than eager's own, within a few K-scaled ulps.
    x, residual = random_tensor((m, k), dtype, seed=1), random_tensor((m, n), dtype, seed=2)
    weight = random_tensor((n, k) if transposed_weight else (k, n), dtype, seed=3)
    gate, bias = random_tensor((n,), dtype, seed=4), random_tensor((n,), dtype, seed=5)

    def gated(x, weight, residual, gate, bias):
        product = torch.nn.functional.linear(x, weight) if transposed_weight else x @ weight
        return residual + gate * (product + bias)

    before = stats.snapshot()
    region, (got,) = compile_and_run(gated, x, weight, residual, gate, bias)
    moved = stats.snapshot()["hbm_bytes"] - before["hbm_bytes"]
    inputs = (x, weight, residual, gate, bias)
    reference = gated(*(value.double() for value in inputs))
    eager_error = (gated(*inputs).double() - reference).abs().max().item()
    assert (got.double() - reference).abs().max().item() <= eager_error * 1.5
    (kernel,) = region.kernels
    group = int(re.search(r"b resident per (\d+) columns", kernel.source).group(1))
    itemsize = x.element_size()
    operands = (k * n + -(-n // group) * m * k) * itemsize
    epilogue = (2 * m * n + 2 * 128 * n * -(-m // 128)) * itemsize  # residual, output, the broadcast gate and bias
    assert moved <= operands + epilogue, (moved, operands, epilogue)


@pytest.mark.parametrize("m, k, n, dtype", [(1000, 64, 300, torch.float32), (129, 200, 600, torch.bfloat16),
                                            (1, 1024, 700, torch.bfloat16)])
def test_a_per_column_epilogue_operand_is_loaded_once_per_column_tile(m, k, n, dtype):
    """linear(x, w, bias): the bias is the same for every row; it is spread to the partitions once per N tile of a
    row group, not once per (128-row block, N tile), so the kernel moves x, w and the output once and the bias
    repeated to 128 partitions once per row group and N tile."""
    x, weight = random_tensor((m, k), dtype, seed=1), random_tensor((n, k), dtype, seed=2)
    bias = random_tensor((n,), dtype, seed=3)
    before = stats.snapshot()
    region = check_against_eager(torch.nn.functional.linear, x, weight, bias, tolerances=MATMUL_TOLERANCES)
    moved = stats.snapshot()["hbm_bytes"] - before["hbm_bytes"]
    (kernel,) = region.kernels
    row_group = int(re.search(r"a\^T resident per (\d+) rows", kernel.source).group(1))
    assert "_columns_" in kernel.source
    itemsize = x.element_size()
    once = (m * k + n * k + m * n) * itemsize
    assert moved <= once + -(-m // row_group) * min(m, 128) * n * itemsize, (moved, once)
