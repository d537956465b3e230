"""max_pool1d/2d/3d with indices and adaptive max pooling vs eager: values and eager's index rule (the first
maximum, or the last nan; padding never chosen), padding, dilation, ceil_mode, bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_through_backend, random_tensor, trace

from neuron_compile.lowering import unsupported_reason


def _awkward(shape, dtype=torch.float32, seed=0):
    x = random_tensor(shape, dtype=dtype, seed=seed)
    flat = x.view(-1)
    flat[::11] = 1.5  # ties: the first maximum wins
    flat[5] = flat[9] = float("nan")  # two nans in one window: the last one is the index
    flat[-40:] = float("-inf")  # all -inf windows point at their first real element
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_pool2d_padding_dilation_ceil_mode(dtype):
    x = _awkward((2, 3, 9, 11), dtype)
    check_through_backend(lambda a: F.max_pool2d(a, 3, 2, padding=1, return_indices=True), x)
    check_through_backend(lambda a: F.max_pool2d(a, (3, 2), (2, 1), padding=(1, 1), dilation=(1, 2),
                                                 return_indices=True), x)
    check_through_backend(lambda a: F.max_pool2d(a, 3, 2, ceil_mode=True, return_indices=True), x)
    check_through_backend(lambda a: F.max_pool2d(a[0], 2), x)  # unbatched, values only


@pytest.mark.slow  # 28 s on 2 cores; the 2-D and random-window tests cover the same kernel in `make test`
def test_max_pool1d_and_3d_and_adaptive():
    x = _awkward((2, 4, 5, 6, 7), seed=1)
    check_through_backend(lambda a: F.max_pool1d(a[:, 0, 0], 3, 2, padding=1, return_indices=True), x)
    check_through_backend(lambda a: F.max_pool3d(a, 2, 2, ceil_mode=True, return_indices=True), x)
    check_through_backend(lambda a: F.max_pool3d(a, 3, (1, 2, 2), padding=1, dilation=(1, 1, 2),
                                                 return_indices=True), x)
    check_through_backend(lambda a: F.adaptive_max_pool2d(a[0], (3, 2), return_indices=True), x[:, :, :, :, :6])
    check_through_backend(lambda a: F.adaptive_max_pool3d(a, (5, 3, 7), return_indices=True), x)


@settings(max_examples=10, deadline=None)
@given(size=st.integers(3, 140), kernel=st.integers(1, 3), stride=st.integers(1, 3), ceil=st.booleans(),
       seed=st.integers(0, 50))
def test_random_windows(size, kernel, stride, ceil, seed):
    padding = kernel // 2
    x = _awkward((2, 3, 5, size), seed=seed) if size > 30 else random_tensor((2, 3, 5, size), seed=seed)
    check_through_backend(lambda a: F.max_pool2d(a, (1, kernel), (1, stride), padding=(0, padding), ceil_mode=ceil,
                                                 return_indices=True), x)


def test_declined_cases_name_the_rule():
    def reason(fn, x):
        node = next(n for n in trace(fn, x).graph.nodes if "max_pool" in str(n.target))
        return unsupported_reason(node)

    assert "uneven windows" in reason(lambda a: F.adaptive_max_pool2d(a, (3, 5), return_indices=True),
                                      torch.zeros(1, 2, 8, 8))
    assert "positions" in reason(lambda a: F.max_pool2d(a, 2), torch.zeros(1, 1, 1, 2**24).expand(1, 1, 2, 2**24))


def test_iota_layouts_count_in_the_tile_plan():
    # A position iota with stride 0 on a kept dim that the data would merge with the next: the plan must not
    # merge them, or every channel after the first reads its positions shifted (wrong indices).
    x = random_tensor((1, 2, 3, 6, 5), seed=4)
    check_through_backend(lambda a: F.max_pool3d(a, 2, 2, ceil_mode=True, return_indices=True), x)
    check_through_backend(lambda a: torch.argmax(a.flatten(2), 2), x)
