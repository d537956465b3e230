"""max.dim / min.dim (values and indices), argmax and argmin vs eager: ties, nan, inf, -0.0, layouts, bf16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_through_backend, random_tensor, trace

from neuron_compile.lowering import unsupported_reason


def _special(shape, dtype=torch.float32, seed=0):
    x = random_tensor(shape, dtype=dtype, seed=seed)
    flat = x.view(-1)
    if len(flat) > 8:
        flat[::7] = 1.5  # ties: the first position must win
        flat[3] = float("inf")
        flat[len(flat) // 2] = float("-inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (129, 3), (5, 700), (3, 128, 5)])
def test_max_min_dim_values_and_first_index(shape, dtype):
    x = _special(shape, dtype, seed=len(shape))
    for dim in range(len(shape)):
        check_through_backend(lambda a, d=dim: tuple(torch.max(a, d)), x)
        check_through_backend(lambda a, d=dim: tuple(torch.min(a, d, keepdim=True)), x)


def test_nan_wins_and_points_at_the_first_nan():
    x = _special((130, 40), seed=3)
    x[5, 7] = x[5, 20] = float("nan")  # row 5: the first nan (column 7)
    x[:, 11] = float("nan")  # every row: column 11 (unless an earlier one)
    check_through_backend(lambda a: tuple(torch.max(a, 1)), x)
    check_through_backend(lambda a: tuple(torch.min(a, 0)), x)
    check_through_backend(lambda a: (torch.argmax(a), torch.argmin(a, 1)), x)


def test_argmax_argmin_over_a_transposed_input_and_flat():
    x = _special((9, 300), seed=4).t()  # (300, 9), strides (1, 300)
    check_through_backend(lambda a: (torch.argmax(a, 0), torch.argmin(a, 1, keepdim=True), torch.argmax(a)), x)
    zeros = torch.tensor([[-0.0, 0.0, -0.0], [0.0, -0.0, 0.0]])  # equal values: the first position
    check_through_backend(lambda a: (torch.argmax(a, 1), torch.argmin(a, 0), torch.argmax(a)), zeros)


@settings(max_examples=12, deadline=None)
@given(rows=st.sampled_from([1, 2, 127, 128, 129]), cols=st.sampled_from([1, 3, 512, 513]),
       dim=st.integers(0, 1), seed=st.integers(0, 99))
def test_random_shapes(rows, cols, dim, seed):
    x = _special((rows, cols), seed=seed)
    check_through_backend(lambda a: (*torch.max(a, dim), torch.argmin(a, dim)), x)


def test_0d_source_is_its_own_extremum_at_index_0():
    for value in (3.5, float("nan"), -0.0):
        x = torch.tensor(value)
        check_through_backend(lambda a: (*torch.max(a, 0), torch.argmin(a), torch.argmax(a, 0, keepdim=True)), x)


def test_declined_cases_name_the_rule():
    def reason(fn, x):
        gm = trace(fn, x)
        (node,) = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.argmax.default, torch.ops.aten.max.dim)]
        return unsupported_reason(node)

    assert reason(lambda a: torch.argmax(a), torch.tensor(3.0)) is None  # 0-d: itself, at index 0
    assert "only float32, bfloat16" in reason(lambda a: torch.max(a, 0), torch.arange(5))
    assert "2**24" in reason(lambda a: torch.argmax(a), torch.zeros(1).expand(2**24))
