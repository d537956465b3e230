"""Pooling lowerings (avg_pool2d, avg_pool3d, avg_pool1d through avg_pool2d) on the simulator vs eager.

Every padding / ceil_mode / count_include_pad / divisor_override combination of the OpInfo samples, shapes with
1, 127-129 and > 128 leading rows, non-contiguous inputs, special values, and the declined window.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile.lowering import unsupported_reason

DTYPES = [torch.float32, torch.bfloat16]
POOL2D_CASES = [
    ((1, 3, 9, 9), dict(kernel_size=3, stride=1, padding=1, ceil_mode=True, count_include_pad=False,
                        divisor_override=2)),
    ((1, 3, 9, 9), dict(kernel_size=(4, 4), stride=(2, 3), padding=1, ceil_mode=True, count_include_pad=False)),
    ((1, 3, 9, 9), dict(kernel_size=(6, 6), stride=(3, 3), padding=(2, 3), ceil_mode=True, count_include_pad=True)),
    ((1, 1, 4, 4), dict(kernel_size=2, divisor_override=-2)),
    ((1, 2, 6, 6), dict(kernel_size=4, stride=2, padding=2, ceil_mode=True)),
    ((3, 9, 9), dict(kernel_size=3)),
    # 129 channels x 2 batches: 75 s of the suite on 2 cores, run by `make test-all`
    pytest.param((2, 129, 5, 7), dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1), count_include_pad=False),
                 marks=pytest.mark.slow),
    ((1, 1, 127, 130), dict(kernel_size=(1, 4), stride=(1, 3), padding=(0, 2), ceil_mode=True)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, kwargs", POOL2D_CASES)
def test_avg_pool2d_matches_eager(shape, kwargs, dtype):
    check_against_eager(lambda x: F.avg_pool2d(x, **kwargs), random_tensor(shape, dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_pool1d_and_3d_match_eager(dtype):
    x = random_tensor((2, 3, 9), dtype, seed=2)
    check_against_eager(lambda x: F.avg_pool1d(x, 3, stride=1, padding=1, ceil_mode=True, count_include_pad=False), x)
    check_against_eager(lambda x: F.avg_pool1d(x, 6, stride=3, padding=2, ceil_mode=True), x)
    if dtype == torch.bfloat16:
        return  # eager's CPU avg_pool3d has no bf16 kernel
    y = random_tensor((1, 2, 5, 5, 5), dtype, seed=3)
    check_against_eager(lambda y: F.avg_pool3d(y, (2, 3, 4), stride=(1, 2, 2), padding=(0, 1, 2), ceil_mode=True,
                                               count_include_pad=True, divisor_override=2), y)
    check_against_eager(lambda y: F.avg_pool3d(y, 2, stride=1, padding=1, ceil_mode=True, count_include_pad=False), y)
    check_against_eager(lambda y: F.avg_pool3d(y, (2, 2, 3), stride=(2, 2, 1)), y)


def test_avg_pool2d_non_contiguous_and_special_values():
    x = random_tensor((2, 8, 6, 5), seed=4).permute(0, 1, 3, 2)  # transposed spatial dims
    check_against_eager(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False), x)
    special = random_tensor((1, 2, 4, 4), seed=5)
    special[0, 0, 0, 0], special[0, 0, 3, 3], special[0, 1, 1, 2] = float("inf"), float("nan"), -0.0
    special[0, 1, 2, 2] = 3e38  # 3e38 + 3e38 overflows to inf in fp32, in eager too
    check_against_eager(lambda x: F.avg_pool2d(x, 2, stride=1, padding=1), special)


def test_avg_pool2d_declines_a_window_wholly_in_the_padding():
    x = random_tensor((1, 1, 3, 3))
    # kernel 1 with padding: the first and last windows see only padding (ATen writes 0 there, not 0/0)
    gm = trace(lambda x: torch.ops.aten.avg_pool2d(x, [1, 1], [1, 1], [0, 0]), x)
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten.avg_pool2d.default)
    assert unsupported_reason(node) is None
    node.args = (node.args[0], [1, 1], [2, 2], [1, 1])  # eager refuses pad > kernel / 2, the check must too
    node.meta["val"] = torch.empty(1, 1, 3, 3)
    assert "wholly in the padding" in unsupported_reason(node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn, shape, output_size", [
    (F.adaptive_avg_pool2d, (1, 8, 8, 8), (4, 2)),
    (F.adaptive_avg_pool2d, (8, 8, 8), (8, 4)),  # one dim unchanged: windows of one row
    (F.adaptive_avg_pool2d, (2, 130, 9, 9), (3, 3)),
    (F.adaptive_avg_pool2d, (1, 1, 129, 600), (1, 1)),
    (F.adaptive_avg_pool1d, (3, 8, 8), (4,)),
    (F.adaptive_avg_pool3d, (1, 2, 6, 6, 8), (3, 2, 4)),
    (F.adaptive_avg_pool3d, (1, 2, 3, 3, 3), (3, 3, 3)),  # all windows one element
])
def test_adaptive_avg_pool_matches_eager(fn, shape, output_size, dtype):
    x = random_tensor(shape, dtype, seed=6)
    check_against_eager(lambda x: fn(x, output_size), x)
    if shape[-1] == shape[-2]:
        check_against_eager(lambda x: fn(x.transpose(-1, -2), output_size), x)  # non-contiguous


def test_adaptive_avg_pool_keeps_other_windows_finite():
    # An inf in one window must not reach the others (a 0-weighted pooling matmul would make them 0 * inf = nan).
    x = torch.ones(1, 1, 4, 4)
    x[0, 0, 0, 0] = float("inf")
    x[0, 0, 3, 3] = float("nan")
    check_against_eager(lambda t: F.adaptive_avg_pool2d(t, (2, 2)), x)


def test_adaptive_avg_pool_declines_uneven_windows():
    gm = trace(lambda x: F.adaptive_avg_pool2d(x, (3, 2)), random_tensor((1, 2, 5, 5)))
    node = next(node for node in gm.graph.nodes if node.target is torch.ops.aten._adaptive_avg_pool2d.default)
    assert "uneven windows" in unsupported_reason(node)
