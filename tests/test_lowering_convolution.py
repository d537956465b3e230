"""Convolution lowering (conv1d / conv2d / conv3d as one implicit-GEMM matmul) on the simulator vs eager.

fp32 tolerance rtol/atol 1e-4 as for the matmul tests: each output sums Cin/G * prod(kernel) products in a
different order than ATen's kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile import config, ir
from neuron_compile.hardware import get_target
from neuron_compile.kinds.matmul import plan_matmul
from neuron_compile.kinds.matmul_windows import TermColumns, Window, moving_windows
from neuron_compile.lowering import unsupported_reason
from neuron_compile.tiles import TilingError

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
CASES = [
    (F.conv2d, (1, 3, 9, 9), (4, 3, 3, 3), dict()),
    (F.conv2d, (2, 4, 9, 8), (6, 2, 3, 2), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)),
    (F.conv2d, (3, 9, 9), (4, 3, 3, 3), dict(padding=1)),  # unbatched
    (F.conv2d, (1, 130, 6, 6), (129, 130, 1, 1), dict()),  # channels over one partition tile
    (F.conv2d, (1, 2, 3, 600), (3, 2, 1, 2), dict(padding=(0, 1))),  # output rows over 512 columns
    (F.conv1d, (1, 3, 4), (3, 3, 3), dict(stride=(2,), padding=2)),
    (F.conv1d, (2, 4, 8), (2, 2, 3), dict(stride=3, padding=1, groups=2, dilation=2)),
    (F.conv1d, (1, 128, 5), (128, 1, 2), dict(groups=128)),  # depthwise
    (F.conv3d, (1, 2, 5, 5, 5), (3, 2, 2, 3, 2), dict(padding=1)),
    # Stride 1, wide rows: over 128 channels both sides, many 512-column tiles, dilation, 3-D, one output row.
    (F.conv2d, (1, 130, 5, 7), (129, 130, 3, 3), dict(padding=1)),
    (F.conv2d, (2, 4, 30, 31), (3, 4, 3, 3), dict(padding=1)),
    (F.conv2d, (1, 3, 9, 8), (2, 3, 3, 2), dict(padding=(2, 1), dilation=(2, 3))),
    (F.conv3d, (1, 3, 3, 5, 6), (2, 3, 3, 3, 3), dict(padding=1)),
    (F.conv2d, (1, 2, 1, 9), (2, 2, 1, 3), dict()),
    (F.conv2d, (1, 4, 6, 6), (4, 2, 3, 3), dict(padding=1, groups=2)),
    # Depthwise (one input channel per group): one pointwise kernel summing the positions.
    (F.conv2d, (2, 130, 5, 7), (130, 1, 3, 3), dict(padding=1, groups=130)),
    (F.conv2d, (1, 3, 9, 8), (6, 1, 3, 2), dict(stride=2, padding=(1, 0), dilation=(2, 1), groups=3)),  # x2 channels
    (F.conv3d, (1, 4, 3, 5, 5), (4, 1, 3, 3, 3), dict(padding=1, groups=4)),
    (F.conv2d, (1, 1, 1), (2, 1, 1, 1), dict()),  # unbatched, one pixel, one input channel
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conv, x_shape, w_shape, kwargs", CASES)
def test_convolution_matches_eager(conv, x_shape, w_shape, kwargs, dtype):
    x, weight = random_tensor(x_shape, dtype, seed=1), random_tensor(w_shape, dtype, seed=2)
    bias = random_tensor((w_shape[0],), dtype, seed=3)
    check_against_eager(lambda x, w, b: conv(x, w, b, **kwargs), x, weight, bias, tolerances=TOLERANCES)


def test_convolution_without_bias_and_non_contiguous_input():
    x = random_tensor((2, 6, 7, 3), seed=4).permute(0, 3, 1, 2)  # channels last
    weight = random_tensor((5, 3, 2, 2), seed=5)
    check_against_eager(lambda x, w: F.conv2d(x, w, stride=2, padding=1), x, weight, tolerances=TOLERANCES)


def test_wide_row_convolution_of_channels_last_and_sliced_inputs():
    # Channels last (the output too): the wide rows are copied out into eager's strides; a slice has rows that are
    # not contiguous, so it is copied first.
    x = random_tensor((1, 7, 6, 3), seed=6).permute(0, 3, 1, 2)
    weight = random_tensor((4, 3, 3, 3), seed=7)
    check_against_eager(lambda x, w: F.conv2d(x, w, padding=1), x, weight, tolerances=TOLERANCES)
    sliced = random_tensor((1, 3, 8, 10), seed=8)[:, :, 1:, 2:]
    check_against_eager(lambda x, w: F.conv2d(x, w), sliced, weight, tolerances=TOLERANCES)


def _convolution_node(fn, *inputs):
    gm = trace(fn, *inputs)
    return next(node for node in gm.graph.nodes if node.target is torch.ops.aten.convolution.default)


def test_convolution_declines_transposed_and_huge_kernels():
    x, weight = random_tensor((1, 2, 5, 5)), random_tensor((2, 3, 2, 2))
    node = _convolution_node(lambda x, w: F.conv_transpose2d(x, w), x, weight)
    assert "transposed convolution" in unsupported_reason(node)
    node = _convolution_node(lambda x, w: F.conv2d(x, w), random_tensor((1, 1, 12, 12)), random_tensor((1, 1, 9, 9)))
    assert "81 kernel positions" in unsupported_reason(node)
    assert unsupported_reason(_convolution_node(lambda x, w: F.conv2d(x, w), x, weight.transpose(0, 1))) is None


@settings(max_examples=12, deadline=None)
@given(channels_in=st.sampled_from([1, 3, 127, 128, 129]), channels_out=st.sampled_from([1, 3, 127, 128, 129]),
       kernel=st.sampled_from([1, 3]), padding=st.sampled_from([0, 1]), height=st.sampled_from([1, 3, 5]),
       width=st.sampled_from([3, 4, 7]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_convolution_is_one_implicit_gemm_kernel(channels_in, channels_out, kernel, padding, height, width, dtype):
    # Every kernel position and input-channel block accumulates into one PSUM tile: one matmul kernel (no fp32
    # partial sums between kernels), whatever the channels (ragged K and M blocks) and sizes.
    if height + 2 * padding < kernel:
        height = kernel
    x = random_tensor((1, channels_in, height, width), dtype, seed=9)
    weight = random_tensor((channels_out, channels_in, kernel, kernel), dtype, seed=10)
    bias = random_tensor((channels_out,), dtype, seed=11)
    region = check_against_eager(lambda x, w, b: F.conv2d(x, w, b, padding=padding), x, weight, bias,
                                 tolerances=TOLERANCES)
    matmuls = [kernel_ for kernel_ in region.kernels if "nc_matmul" in kernel_.source]
    if channels_in == 1:  # K = 1: the pointwise form (as depthwise), no matmul
        assert not matmuls
        return
    assert len(matmuls) == 1
    assert ("Implicit GEMM" in matmuls[0].source) == (kernel > 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv3d_with_frames_larger_than_a_tile_takes_several_windows(dtype):
    # A frame of 24 x 24 (26 x 26 padded: 676 columns) is wider than an N tile, so each frame position of the 3-D
    # kernel starts a window of its own; the positions within a frame share it.
    x, weight = random_tensor((1, 3, 3, 24, 24), dtype, seed=12), random_tensor((4, 3, 3, 3, 3), dtype, seed=13)
    region = check_against_eager(lambda x, w: F.conv3d(x, w, padding=1), x, weight, tolerances=TOLERANCES)
    (matmul,) = [kernel_ for kernel_ in region.kernels if "nc_matmul" in kernel_.source]
    assert "for window, (shift, span) in enumerate(((0, 54), (676, 54), (1352, 54)))" in matmul.source


def test_convolution_on_a_target_without_dma_transpose():
    # trn1 has no DMA transpose; the implicit GEMM's operands need none (K on partitions as stored).
    x, weight = random_tensor((1, 5, 6, 7), seed=14), random_tensor((4, 5, 3, 3), seed=15)
    with config.patch(target="trn1"):
        check_against_eager(lambda x, w: F.conv2d(x, w, padding=1), x, weight, tolerances=TOLERANCES)


def test_moving_windows_group_shifts_a_whole_number_of_columns_apart():
    # Column stride 1: shifts within the limit share a window; 40 is too far from 0 and starts its own.
    windows, places = moving_windows((0, 1, 40, 2, 41), column_stride=1, span_limit=32)
    assert windows == (Window(0, 2), Window(40, 1))
    assert places == (TermColumns(0, 0), TermColumns(0, 1), TermColumns(1, 0), TermColumns(0, 2), TermColumns(1, 1))
    # Column stride 2 (a strided convolution): an odd distance is not a whole number of columns.
    windows, places = moving_windows((0, 1, 2), column_stride=2, span_limit=32)
    assert windows == (Window(0, 1), Window(1, 0))
    assert places == (TermColumns(0, 0), TermColumns(1, 0), TermColumns(0, 1))


def test_implicit_gemm_over_the_sbuf_budget_is_a_tiling_error():
    # 9 terms of K = 8192 keep 9 x 64 a^T chunks of one row block resident: over the SBUF budget, an error that
    # names the rule (the region would then run eagerly), never a wrong answer.
    k, n = 8192, 100
    a = ir.Load("w", ir.Layout((1, 128, k), (0, k * 9, 9), 0), "float32")
    b = ir.Load("x", ir.Layout((1, k, n), (0, n + 20, 1), 0), "float32")
    out = ir.Buffer("out", "float32", ir.Layout((1, 128, n), (0, n, 1), 0))
    node = ir.MatMul("conv", (1, 128, n), k, a, b, (ir.Store(out, ir.Result(), out.layout),),
                     shifts=tuple((t, t) for t in range(9)))
    with pytest.raises(TilingError, match="implicit GEMM of 9 terms .* SBUF budget"):
        plan_matmul(node, get_target("trn2"))


def test_strided_convolution_of_a_channels_last_input_transposes_its_windows():
    # No padding, so the strided plan reads the channels-last input as it is: b's K (channels) is contiguous and its
    # windows come in through a DMA transpose; the positions along a row share a window (columns 2 apart).
    x = random_tensor((1, 6, 9, 11), seed=16).contiguous(memory_format=torch.channels_last)
    weight = random_tensor((5, 6, 3, 3), seed=17)
    region = check_against_eager(lambda x, w: F.conv2d(x, w, stride=2), x, weight, tolerances=TOLERANCES)
    (matmul,) = [kernel_ for kernel_ in region.kernels if "nc_matmul" in kernel_.source]
    assert "nisa.dma_transpose(dst=moving" in matmul.source and "Implicit GEMM" in matmul.source
