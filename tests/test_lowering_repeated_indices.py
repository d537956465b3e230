"""Nearest upsampling by integer factors (``index.Tensor`` with constant indices ``o // k``) as one strided copy
(lowering/repeated_indices.py) on the simulator vs eager; other constant or computed indices stay gathers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowering_harness import check_against_eager, random_tensor, trace
from neuron_compile.lowering.repeated_indices import repeat_factors

aten = torch.ops.aten


def index_node(fn, *inputs) -> torch.fx.Node:
    gm = trace(fn, *inputs)
    return next(node for node in gm.graph.nodes if node.target is aten.index.Tensor)


def nearest(scale=None, size=None):
    return lambda x: F.interpolate(x, scale_factor=scale, size=size, mode="nearest")


CASES = [
    ((1, 3, 5, 7), nearest(2.0), {2: 2, 3: 2}),  # odd sizes
    ((2, 130, 3, 4), nearest(2.0), {2: 2, 3: 2}),  # over 128 channels
    ((1, 1, 1, 1), nearest(3.0), {2: 3, 3: 3}),  # one pixel
    ((1, 2, 4, 5), nearest(size=(8, 15)), {2: 2, 3: 3}),  # by size, a factor per dim
    ((1, 2, 3, 4, 5), nearest((1.0, 2.0, 2.0)), {2: 1, 3: 2, 4: 2}),  # a video's frames kept, pixels doubled
    ((2, 3, 9), nearest(4.0), {2: 4}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, fn, factors", CASES)
def test_nearest_upsampling_is_a_strided_copy(shape, fn, factors, dtype):
    x = random_tensor(shape, dtype, seed=len(shape))
    assert repeat_factors(index_node(fn, x)) == factors
    region = check_against_eager(fn, x)
    assert "indirect" not in "".join(kernel.source for kernel in region.kernels)  # no gather: a copy


def test_channels_last_input_keeps_eager_strides():
    x = random_tensor((1, 6, 5, 3), seed=3).contiguous(memory_format=torch.channels_last)
    check_against_eager(nearest(2.0), x)


@pytest.mark.parametrize("channels", [127, 129, 256])
def test_channels_last_upsampling_puts_the_channels_on_partitions(channels):
    # A VAE decoder's upsampler after its attention block: 16 x 2 x 16 x 2 output pixels per channel, the channels
    # the widest dim. They go on partitions (the copy was 16-row tiles, one per channel and row: 16x the tiles).
    x = random_tensor((1, channels, 16, 16), seed=4).contiguous(memory_format=torch.channels_last)
    region = check_against_eager(nearest(2.0), x)
    assert f"partition {channels}/{min(channels, 128)}" in region.kernels[0].source


def test_uneven_and_computed_indices_stay_gathers():
    x = random_tensor((1, 2, 4, 5))
    assert repeat_factors(index_node(nearest(1.7), x)) is None  # floor(o / 1.7) is not o // k
    assert repeat_factors(index_node(nearest(size=(7, 10)), x)) is None  # 7 rows from 4: uneven
    # Indices read from a graph input are not constants: an ordinary gather.
    index = torch.tensor([0, 0, 1, 1])
    assert repeat_factors(index_node(lambda t, i: t[:, :, i], x, index)) is None
    # A constant index that is not a repeat (reversed) is a gather too.
    assert repeat_factors(index_node(lambda t: t[:, :, torch.arange(3, -1, -1)], x)) is None
