"""Convolution lowering (conv1d / conv2d / conv3d as one matmul per kernel position) on the simulator vs eager.

fp32 tolerance rtol/atol 1e-4 as for the matmul tests: each output sums Cin/G * prod(kernel) products in a
different order than ATen's kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile.lowering import unsupported_reason

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
