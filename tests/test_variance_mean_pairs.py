"""A variance and the mean of the same rows in one kernel (kinds/reduction_siblings.py): a layer norm's two
reductions load and reduce each row once; the mean is the variance kernel's ``Result(1)``, the normalizing row
epilogue reads it and the variance's rstd in place. Against eager under hypothesis (rows 1 / 127 / 128 / 129 / 200,
widths 1 / 64 / 384, fp32 and bf16), in a training step (rstd and the mean saved for the backward), for
``var_mean``, and the pairs that must stay apart."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, random_tensor

import neuron_compile


def reduction_kernels(region) -> list[str]:
    return [kernel.source for kernel in region.kernels if "Tile plan: reduction" in kernel.source]


def layer_norm(x, weight, bias):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


@settings(max_examples=20, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 200]), width=st.sampled_from([1, 64, 384]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_layer_norm_is_one_reduction_kernel_matching_eager(rows, width, dtype):
    x = random_tensor((rows, width), dtype, seed=rows * width)
    weight, bias = random_tensor((width,), dtype, seed=1), random_tensor((width,), dtype, seed=2)
    region = check_against_eager(layer_norm, x, weight, bias)
    kernels = reduction_kernels(region)
    assert len(kernels) == 1 and "var over" in kernels[0] and "result1" in kernels[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_var_mean_gives_both_from_one_kernel(dtype):
    x = random_tensor((129, 300), dtype, seed=3)
    x[6, 9] = float("nan")  # (not inf: eager's var_mean gives a nan mean for a row holding inf, mean() inf)
    region = check_against_eager(lambda a: torch.var_mean(a, -1, correction=0), x)
    assert len(reduction_kernels(region)) == 1


def test_a_training_layer_norm_saves_the_paired_statistics_and_matches_eagers_gradients():
    """The forward keeps the mean and rstd for the backward (region outputs): the paired kernel stores them."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(96)
    torch.nn.init.normal_(norm.weight)
    x, upstream = torch.randn(130, 96, requires_grad=True), torch.randn(130, 96)

    def step(module):
        x.grad, norm.weight.grad, norm.bias.grad = None, None, None
        out = module(x)
        (out * upstream).sum().backward()
        return out.detach(), x.grad, norm.weight.grad, norm.bias.grad

    neuron_compile.reset_stats()
    got = step(torch.compile(norm, backend="neuron", fullgraph=True))
    assert neuron_compile.stats()["fallback_nodes"] == 0
    for value, reference in zip(got, step(norm)):
        torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_a_variance_and_a_mean_of_other_rows_or_values_stay_apart():
    x = random_tensor((130, 64), seed=4)
    other_dim = check_against_eager(lambda a: (a.var(-1, keepdim=True), a.mean(0, keepdim=True)), x)
    other_values = check_against_eager(lambda a: (a.var(-1), (a * 2.0).mean(-1)), x)
    two_means = check_against_eager(lambda a: (a.mean(-1), (a - a.mean(-1, keepdim=True)).mean(-1)), x)
    for region in (other_dim, other_values, two_means):
        assert not any("result1" in kernel.source for kernel in region.kernels)
