"""LTX's q / k path: an RMSNorm across heads, then the rotary ``x * cos + stack([-x2, x1], -1).flatten(-2) * sin``
(passes/fusion.py ``detach_epilogues``, kinds/concat.py ``producer_value``). ``x * cos`` used to join the norm as a
row epilogue, whose fp32 product went to HBM and back into the rotary's concat; the concat now takes it as a
prologue, a slice of it per part (the even and the odd elements), recomputed from the normed ``x`` it reads anyway.
Against eager under hypothesis (tokens 1 / 127 / 128 / 129 / 200, widths 64 / 256, fp32 and bf16), the kernels'
stores, and the product kept in the norm when something else reads it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, random_tensor


def rms_norm(x, weight):
    statistic = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    return (x.float() * statistic * weight).to(x.dtype)


def rotary(x, cos, sin):
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def ltx_query(x, weight, cos, sin):
    return rotary(rms_norm(x, weight), cos, sin)


def inputs(tokens: int, width: int, dtype, seed: int = 0):
    return (random_tensor((1, tokens, width), dtype, seed=seed), random_tensor((width,), dtype, seed=seed + 1),
            random_tensor((1, tokens, width), seed=seed + 2), random_tensor((1, tokens, width), seed=seed + 3))


def stored_dtypes(region) -> dict[str, list[str]]:
    """Kernel name -> the dtypes of the HBM buffers it declares for its outputs."""
    found = {}
    for kernel in region.kernels:
        lines = [line for line in kernel.source.splitlines() if "buffer=nl.shared_hbm" in line]
        found[kernel.name] = [line.split("dtype=nl.")[1].split(",")[0] for line in lines]
    return found


@settings(max_examples=16, deadline=None)
@given(tokens=st.sampled_from([1, 127, 128, 129, 200]), width=st.sampled_from([64, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_rotary_after_a_norm_matches_eager(tokens, width, dtype):
    check_against_eager(ltx_query, *inputs(tokens, width, dtype, seed=tokens + width))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_through_the_norm_and_the_rotary_match_eager(dtype):
    x, weight, cos, sin = inputs(130, 128, dtype, seed=5)
    x[0, 3, 7], x[0, 9, 0], x[0, 17] = float("inf"), float("nan"), 0.0
    cos[0, 20, 4], sin[0, 21, 5] = float("inf"), float("nan")
    check_against_eager(ltx_query, x, weight, cos, sin)


def test_the_product_with_cos_is_recomputed_in_the_rotary_not_stored():
    region = check_against_eager(ltx_query, *inputs(256, 1024, torch.bfloat16, seed=6))
    stores = stored_dtypes(region)
    assert sorted(len(dtypes) for dtypes in stores.values()) == [1, 1]  # the normed x, the rotated output
    assert all(dtypes == ["bfloat16"] for dtypes in stores.values())  # no fp32 x * cos through HBM
    concat = next(kernel.source for kernel in region.kernels if "Concat" in kernel.source)
    assert concat.count("arg2_1.ap(") == 1  # cos: one span load, read at both phases


def test_a_product_read_elsewhere_stays_in_the_norm():
    def query_and_product(x, weight, cos, sin):
        normed = rms_norm(x, weight)
        return rotary(normed, cos, sin), normed.float() * cos

    region = check_against_eager(query_and_product, *inputs(129, 128, torch.bfloat16, seed=7))
    assert any("float32" in dtypes for dtypes in stored_dtypes(region).values())
