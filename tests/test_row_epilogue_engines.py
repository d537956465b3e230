"""A norm's row epilogue spread over the engines (kinds/reduction.py ``_planned_row_balance``, codegen/expressions.py
``_subtraction``): Wan's and Flux's layer norm + modulation, ``(x - mean) * rstd * (1 + scale) + shift``, has two
tensor_tensors that only VectorE and GpSimd run; the subtract of the mean goes to ScalarE as an add of the negated
mean (the same IEEE value), and the epilogue's engines are planned longest first on top of the reduction's own
VectorE work; so are those of Flux's q / k RMSNorm over rows grouped per partition. Against eager under hypothesis
(rows 1 / 127 / 128 / 129 / 200, widths 64 / 256 / 1024, fp32 and bf16), on special values, and the engines the
mid-size kernels take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import TOLERANCES, check_against_eager, compile_and_run, random_tensor


EPS = 1e-6


def wan_modulated_norm(x, scale, shift):
    """Wan's FP32LayerNorm then its modulation, rounded back to x's dtype."""
    normalized = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=EPS)
    return (normalized * (1 + scale) + shift).to(x.dtype)


def flux_modulated_norm(x, scale, shift):
    """Flux's AdaLayerNormZero: a layer norm in x's dtype, then the modulation."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=EPS) * (1 + scale) + shift


NORMS = {"wan": wan_modulated_norm, "flux": flux_modulated_norm}


def modulation(width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) of one [1, 1, width] row each: Wan's are fp32 whatever x is, Flux's x's dtype."""
    return random_tensor((1, 1, width), dtype, seed=seed), random_tensor((1, 1, width), dtype, seed=seed + 1)


@settings(max_examples=24, deadline=None)
@given(rows=st.sampled_from([1, 127, 128, 129, 200]), width=st.sampled_from([64, 256, 1024]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), name=st.sampled_from(sorted(NORMS)))
def test_modulated_norms_match_eager(rows, width, dtype, name):
    x = random_tensor((1, rows, width), dtype, seed=rows + width)
    scale, shift = modulation(width, torch.float32 if name == "wan" else dtype, seed=width)
    check_against_eager(NORMS[name], x, scale, shift)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modulated_norms_of_special_rows_match_eager(dtype):
    """A row with inf, one with -inf, one with nan, a constant row (variance 0: rstd = rsqrt(eps)), a row of large
    values: eager's nan, inf and finite values, element for element."""
    x = random_tensor((1, 130, 256), seed=3)
    x[0, 1, 5] = float("inf")
    x[0, 2, 7] = -float("inf")
    x[0, 3, 9] = float("nan")
    x[0, 4] = 1.5
    x[0, 128] = 1e15 * x[0, 128]
    x = x.to(dtype)
    for name, fn in NORMS.items():
        scale, shift = modulation(256, torch.float32 if name == "wan" else dtype, seed=5)
        check_against_eager(fn, x, scale, shift)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mean_subtracted_on_scalar_e_keeps_eagers_signed_zeros_inf_and_nan(dtype):
    """x - mean run as x + (-mean) on ScalarE: -0.0 - 0.0 is -0.0 and 0.0 - 0.0 is 0.0, a finite value minus an
    inf mean is -inf, inf minus it nan: eager's values, sign bits included."""
    x = random_tensor((129, 512), dtype, seed=11)
    x[3] = 0.0
    x[3, ::2] = -0.0
    x[5, 7] = float("inf")

    def centered(a):
        return a - a.mean(-1, keepdim=True)

    region, outputs = compile_and_run(centered, x)
    expected = centered(x)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(outputs[0], expected, rtol=rtol, atol=atol, equal_nan=True)
    assert torch.equal(torch.signbit(outputs[0][3]), torch.signbit(expected[3]))  # zeros minus a 0.0 mean
    torch.testing.assert_close(outputs[0][5], expected[5], rtol=0, atol=0, equal_nan=True)  # -inf, and nan at inf
    assert "op0=nl.add, operand0=negated" in region.kernels[0].source


def test_the_wan_norm_subtracts_its_mean_on_scalar_e_and_balances_its_modulation():
    """The mid size's norm + modulation ([1, 1024, 1024] bf16, fp32 modulation): the mean's subtraction on ScalarE,
    the rstd product and the scale's product one scalar_tensor_tensor (codegen/expressions.py
    ``_emit_scaled_product``), the shift's add on the other of GpSimd and VectorE."""
    x = random_tensor((1, 1024, 1024), torch.bfloat16, seed=1)
    scale, shift = modulation(1024, torch.float32, seed=2)
    region = check_against_eager(wan_modulated_norm, x, scale, shift)
    epilogue = [kernel.source for kernel in region.kernels if "(over the row)" in kernel.source]
    assert len(epilogue) == 1
    lines = [line for line in epilogue[0].splitlines() if "[0:rows, 0:cols]" in line and "dma_copy" not in line]
    subtract = [line for line in lines if "op0=nl.add, operand0=negated" in line]
    assert len(subtract) == 1 and "engine=nisa.engine.scalar" in subtract[0]
    products = [line for line in lines if line.lstrip().startswith(("nisa.tensor_tensor(", "nisa.scalar_tensor_tensor("))]
    assert [line.lstrip().split("(")[0] for line in products] == ["nisa.scalar_tensor_tensor", "nisa.tensor_tensor"]
    assert sorted("engine=nisa.engine.gpsimd" in line for line in products) == [False, True]


def flux_qk_norm(x, weight):
    """Flux's q / k RMSNorm with an fp32 weight: rows of 128 several to a partition (codegen/grouped_rows.py)."""
    statistic = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    return (x.float() * statistic * weight).to(x.dtype)


@settings(max_examples=12, deadline=None)
@given(tokens=st.sampled_from([1, 127, 128, 129, 200]), heads=st.sampled_from([5, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_qk_norms_with_an_fp32_weight_match_eager(tokens, heads, dtype):
    x = random_tensor((1, tokens, heads, 128), dtype, seed=tokens * heads)
    x[0, 0, 0, 0] = float("nan") if tokens > 1 else x[0, 0, 0, 0]
    check_against_eager(flux_qk_norm, x, random_tensor((128,), seed=3))


def test_the_flux_qk_norm_puts_its_weight_product_on_gpsimd():
    """VectorE holds the grouped rows' tensor_reduce and ScalarE the square and the per-row scaling: the weight's
    tensor_tensor goes to the idle GpSimd."""
    x = random_tensor((1, 1280, 8, 128), torch.bfloat16, seed=4)
    region = check_against_eager(flux_qk_norm, x, random_tensor((128,), seed=5))
    products = [line for line in region.kernels[0].source.splitlines() if "nisa.tensor_tensor(" in line]
    assert len(products) == 1 and "engine=nisa.engine.gpsimd" in products[0]
