"""Normalization lowerings (group norm, batch norm) on the simulator vs eager, and their declined arguments."""

from __future__ import annotations

import pytest
import torch

from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile.lowering.normalization import _check_batch_norm_training
from neuron_compile.lowering import unsupported_reason

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]
# A row of C / G * HxW elements summed in a different order than ATen's kernel: a few ulps of the row mean.
NORM_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _group_norm(shape, groups, eps=1e-5, affine=True):
    def fn(x, weight, bias):
        hw = x[0, 0].numel()
        return tuple(aten.native_group_norm(x, weight if affine else None, bias if affine else None, shape[0],
                                            shape[1], hw, groups, eps))

    return fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, groups", [((1, 6, 3), 2), ((2, 4), 4), ((3, 256, 5, 7), 32), ((1, 129, 1, 1), 3),
                                            ((2, 130, 3, 4, 2), 5), ((2, 128, 1), 1), ((4, 64, 3, 3), 32),
                                            ((65, 4, 5), 2)])
def test_group_norm_matches_eager(shape, groups, dtype):
    x = random_tensor(shape, dtype, seed=1)
    weight, bias = random_tensor((shape[1],), dtype, seed=2), random_tensor((shape[1],), dtype, seed=3)
    region = check_against_eager(_group_norm(shape, groups), x, weight, bias, tolerances=NORM_TOLERANCES)
    assert region.kernels


def test_group_norm_channels_last_no_affine_and_large_offset():
    x = random_tensor((2, 12, 3, 4), seed=4).contiguous(memory_format=torch.channels_last)
    weight, bias = random_tensor((12,), seed=5), random_tensor((12,), seed=6)
    check_against_eager(_group_norm((2, 12, 3, 4), 4), x, weight, bias)
    check_against_eager(_group_norm((2, 12, 3, 4), 3, affine=False), x, weight, bias)
    # rows off zero with a large eps (the OpInfo sample's 0.5). Further off (+1000) the fp32 row mean itself is
    # a few ulps of 1000 from eager's, which x - mean turns into 1e-4 absolute (layer norm shares that).
    shifted = random_tensor((2, 6, 40), seed=7) + 10.0
    check_against_eager(_group_norm((2, 6, 40), 2, eps=0.5), shifted, weight[:6], bias[:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_of_long_channels_last_rows_copies_them_contiguous(dtype):
    # A VAE decoder after its attention block: each group's row is 4 channels (stride 1) x 1024 pixels (stride
    # 32), two dims too long to walk unchunked (this ran eagerly), so the rows are read from a contiguous copy.
    shape = (1, 32, 32, 32)
    x = random_tensor(shape, dtype, seed=8).contiguous(memory_format=torch.channels_last)
    weight, bias = random_tensor((32,), dtype, seed=9), random_tensor((32,), dtype, seed=10)
    node = _group_norm_node(_group_norm(shape, 8), x, weight, bias)
    assert unsupported_reason(node) is None
    check_against_eager(_group_norm(shape, 8), x, weight, bias, tolerances=NORM_TOLERANCES)


@pytest.mark.parametrize("dtype", DTYPES)
def test_few_group_rows_take_statistics_per_channel_first(dtype):
    # A VAE's group norm: 32 (n, group) rows would use a quarter of the partitions; 64 channel rows are taken first
    # and combined per group: the group variance is the mean of the channel variances plus that of the channel
    # means.
    shape = (1, 64, 9, 13)
    x = random_tensor(shape, dtype, seed=11) + 10.0
    weight, bias = random_tensor((64,), dtype, seed=12), random_tensor((64,), dtype, seed=13)
    region = check_against_eager(_group_norm(shape, 32), x, weight, bias, tolerances=NORM_TOLERANCES)
    assert any("channel_var" in kernel.source for kernel in region.kernels)
    many = (4, 64, 3, 3)  # 128 group rows: one pass per group row, as before
    inputs = (random_tensor(many, dtype, seed=14), weight, bias)
    region = check_against_eager(_group_norm(many, 32), *inputs, tolerances=NORM_TOLERANCES)
    assert not any("channel_var" in kernel.source for kernel in region.kernels)


def _assert_as_accurate_as_eager(fn, *inputs):
    """Each output within twice eager's own largest error against a float64 run (eager computes x * scale + shift,
    whose rounding is its own; the statistics must not add to ours)."""
    _, outputs = compile_and_run(fn, *inputs)
    exact = fn(*(value.double() for value in inputs))
    for ours, theirs, reference in zip(outputs, fn(*inputs), exact, strict=True):
        assert (ours.double() - reference).abs().max() <= 2 * (theirs.double() - reference).abs().max() + 1e-6


def test_group_statistics_per_channel_first_are_as_accurate_as_eagers():
    shape = (1, 64, 8, 16)  # rows of 2**k elements: a mean is the sum times 1 / count (NKI has no division)
    weight, bias = random_tensor((64,), seed=16), random_tensor((64,), seed=17)
    # one group constant (variance 0: its output is its bias), one whose channels are constants of their own (all
    # its variance between channels), the others noise around 10
    x = random_tensor(shape, seed=15) + 10.0
    x[0, 0:2] = 3.0
    x[0, 2] = -1.0
    x[0, 3] = 5.0
    _assert_as_accurate_as_eager(_group_norm(shape, 32), x, weight, bias)
    # std 0.01 around 100: the output's own rounding is ~1e-3 here
    _assert_as_accurate_as_eager(_group_norm(shape, 32), random_tensor(shape, seed=18) * 0.01 + 100.0, weight, bias)


def _group_norm_node(fn, *inputs):
    gm = trace(fn, *inputs)
    return next(node for node in gm.graph.nodes if node.target is aten.native_group_norm.default)


def test_group_norm_declines_eps_below_the_rsqrt_range():
    x, weight, bias = random_tensor((2, 4, 3)), random_tensor((4,)), random_tensor((4,))
    node = _group_norm_node(_group_norm((2, 4, 3), 2, eps=0.0), x, weight, bias)
    assert "rsqrt(var + eps) needs eps >= 2**-87" in unsupported_reason(node)
    assert unsupported_reason(_group_norm_node(_group_norm((2, 4, 3), 2), x, weight, bias)) is None


def _batch_norm(momentum=0.5, eps=0.6, training=True):
    def fn(x, weight, bias, running_mean, running_var):
        return tuple(aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training,
                                                               momentum, eps))

    return fn


@pytest.mark.parametrize("shape, dtype, stats_dtype", [((5, 5, 5), torch.float32, torch.float32),
                                                       ((3, 1), torch.float32, torch.float32),
                                                       ((2, 130, 4, 3), torch.float32, torch.float32),
                                                       ((2, 3, 2, 2, 2), torch.float32, torch.float32),
                                                       ((129, 2), torch.float32, torch.float32),
                                                       ((4, 6, 7), torch.bfloat16, torch.bfloat16),
                                                       ((4, 6, 7), torch.bfloat16, torch.float32)])
def test_batch_norm_training_matches_eager(shape, dtype, stats_dtype):
    channels = shape[1]
    x = random_tensor(shape, dtype, seed=1)
    weight, bias = random_tensor((channels,), stats_dtype, seed=2), random_tensor((channels,), stats_dtype, seed=3)
    running_mean = random_tensor((channels,), stats_dtype, seed=4)
    running_var = random_tensor((channels,), stats_dtype, seed=5, low=0.5, high=2.0)
    check_against_eager(_batch_norm(), x, weight, bias, running_mean, running_var, tolerances=NORM_TOLERANCES)
    check_against_eager(lambda x, m, v: _batch_norm(0.1, 1e-5)(x, None, None, m, v), x, running_mean, running_var,
                        tolerances=NORM_TOLERANCES)


def test_batch_norm_declines_eval_mode_and_a_single_value_per_channel():
    stats = random_tensor((3,)), random_tensor((3,), low=0.5, high=2.0)
    gm = trace(lambda x, m, v: _batch_norm()(x, None, None, m, v), random_tensor((1, 3)), *stats)
    node = next(node for node in gm.graph.nodes if node.target is aten._native_batch_norm_legit_functional.default)
    assert "one value per channel" in unsupported_reason(node)
    gm = trace(lambda x, m, v: _batch_norm(training=False)(x, None, None, m, v), random_tensor((2, 3)), *stats)
    node = next(node for node in gm.graph.nodes if node.target is aten._native_batch_norm_legit_functional.default)
    # The registry already declines it for its empty statistic outputs; the lowering's own check says why too.
    assert unsupported_reason(node) is not None
    assert "training=False" in _check_batch_norm_training(node)


@pytest.mark.parametrize("shape, dtype", [((3, 2, 4), torch.float32), ((2, 130, 3, 3), torch.float32),
                                          ((4, 6, 7), torch.bfloat16)])
def test_batch_norm_eval_mode_decomposes_to_lowered_pointwise_ops(shape, dtype):
    channels = shape[1]
    x = random_tensor(shape, dtype, seed=6)
    weight, bias = random_tensor((channels,), dtype, seed=7), random_tensor((channels,), dtype, seed=8)
    running_mean = random_tensor((channels,), dtype, seed=9)
    running_var = random_tensor((channels,), dtype, seed=10, low=0.1, high=3.0)

    def eval_batch_norm(x, weight, bias, running_mean, running_var):
        # what aot_autograd makes of F.batch_norm(training=False); its two statistic outputs are empty
        return aten._native_batch_norm_legit_no_training(x, weight, bias, running_mean, running_var, 0.1, 1e-5)[0]

    gm = trace(eval_batch_norm, x, weight, bias, running_mean, running_var)
    assert not any("batch_norm" in str(node.target) for node in gm.graph.nodes)
    # One region with every node lowered (compile_region raises on an unsupported node).
    check_against_eager(eval_batch_norm, x, weight, bias, running_mean, running_var, tolerances=NORM_TOLERANCES)
