"""``(x * s) * y`` of two tiles and a number or per-row value ``s`` (a norm's normed row times its weight) is one
scalar_tensor_tensor (codegen/expressions.py ``_emit_scaled_product``): one pass over the two tiles instead of a
pass over ``x`` and another over both, in a row kernel's epilogue. The engine multiplies by ``s`` in fp32 and by ``y``
unrounded in between, which is what the fp32 product tile gave: results equal the two instructions' bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import TOLERANCES, check_against_eager, compile_and_run, random_tensor


def gemma_norm(x, weight):
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (1.0 + weight.float())).type_as(x)


def modulated_norm(x, y):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * y


@settings(max_examples=10, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 300]), width=st.sampled_from([2, 100, 129, 640]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_row_times_its_statistic_and_a_tile_equals_the_two_instruction_form(rows, width, dtype):
    x, y = random_tensor((rows, width), dtype, seed=rows), random_tensor((rows, width), dtype, seed=width)
    region, fused = compile_and_run(modulated_norm, x, y)
    (kernel,) = region.kernels
    # in bf16, eager rounds x * rsqrt to bf16 before the product: two instructions, as eager
    assert kernel.source.count("nisa.scalar_tensor_tensor(") == (dtype == torch.float32)
    torch.testing.assert_close(fused[0], modulated_norm(x, y), rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("neuron_compile.codegen.expressions._emit_scaled_product", lambda *args: None)
        _, separate = compile_and_run(modulated_norm, x, y)
    assert torch.equal(fused[0], separate[0])  # bit for bit


def test_a_pointwise_kernel_keeps_its_two_instructions():
    """Only row epilogues take the fused form: a pointwise kernel's engine plan (AdamW's update) stays as it was."""
    x, y = random_tensor((129, 100), seed=1), random_tensor((129, 100), seed=2)
    region = check_against_eager(lambda x, y: (x * 3.0) * y, x, y)
    (kernel,) = region.kernels
    assert "nisa.scalar_tensor_tensor(" not in kernel.source


def test_a_norm_times_its_weight_is_one_instruction_per_row_block():
    x, weight = random_tensor((256, 2048), torch.bfloat16, seed=0), random_tensor((2048,), torch.bfloat16, seed=1)
    region = check_against_eager(gemma_norm, x, weight)
    (kernel,) = region.kernels
    loops = kernel.source.split("for p0 in")[1]
    assert loops.count("nisa.scalar_tensor_tensor(") == 1 and "nisa.tensor_tensor(" not in loops


def test_a_normed_row_needed_elsewhere_too_still_matches_eager():
    x, y = random_tensor((129, 100), seed=1), random_tensor((129, 100), seed=2)
    check_against_eager(lambda x, y: (modulated_norm(x, y), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
                        x, y)
