"""The activation-range pass: log / sqrt / rsqrt / reciprocal and division by tensors match eager on every fp32
special value while the instructions only see their valid ranges (the simulator refuses anything else)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import check_against_eager, random_tensor

from neuron_compile import ir, op_table
from neuron_compile.passes.activation_ranges import guard_expression

SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 1e-38, 2.0**-126, 3.4e38, -3.4e38,
            2.0**-43, 2.0**43, 2.0**-117, 2.0**119, 1.0, -2.5, 2.0**100, 2.0**126, 2.0**127, 1e30, -1e-30, 7.0]


def _specials(dtype):
    values = torch.tensor(SPECIALS).repeat(130, 1)  # > 128 rows: two partition tiles
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(op_table.range_limited()))  # log, reciprocal, rsqrt, sqrt
def test_guarded_functions_on_special_values(name, dtype):
    check_against_eager(getattr(torch, name), _specials(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_division_by_every_special_value(dtype):
    x = _specials(dtype)
    check_against_eager(lambda a: a / a.flip(1), x)
    check_against_eager(lambda a: a.flip(1) / a[:, 3:4], x)  # a row-vector denominator
    check_against_eager(lambda a: 1.0 / a, x)


@settings(max_examples=15, deadline=None)
@given(exponent=st.integers(-149, 127), scale=st.floats(1.0, 2.0, exclude_max=True), negative=st.booleans())
def test_reciprocal_of_any_magnitude(exponent, scale, negative):
    value = torch.tensor([(-1.0 if negative else 1.0) * scale * 2.0**exponent], dtype=torch.float32)
    check_against_eager(lambda a: (1.0 / a, a.abs().sqrt(), a.abs().rsqrt(), a.abs().log()), value.repeat(3, 5))


def test_the_pass_leaves_in_range_instructions_alone_and_rewrites_the_rest():
    x = ir.Load("x", ir.Layout((4,), (1,), 0), "float32")
    bare = ir.Op("log_in_range", (x,))
    assert guard_expression(bare) is bare
    guarded = guard_expression(ir.Op("div", (x, ir.Op("sqrt", (x,)))))
    text = str(guarded)
    # sqrt without a floor: x * rsqrt(x) on the ALU; the division: VectorE's reciprocal (ALU operators have no range)
    assert "sqrt_alu(" in text and "reciprocal_alu(" in text
    assert " sqrt(" not in f" {text}" and "(sqrt(" not in text and "div(" not in text
    assert guard_expression(ir.Op("div", (x, ir.Scalar(3.0)))) == ir.Op("div", (x, ir.Scalar(3.0)))


def test_normalizations_with_zero_epsilon_and_huge_inputs():
    x = random_tensor((130, 40), seed=3)
    x[0] = 0.0  # variance 0 and eps 0: rsqrt(0) = inf, 0 * inf = nan, as eager
    x[1] = 3e38
    check_against_eager(lambda a: torch.nn.functional.layer_norm(a, (40,), eps=0.0), x)
    check_against_eager(lambda a: torch.linalg.vector_norm(a, dim=1), x)


def _rms_norm(a: torch.Tensor, eps: float) -> torch.Tensor:
    variance = a.float().pow(2).mean(-1, keepdim=True)
    return (a.float() * torch.rsqrt(variance + eps)).to(a.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_a_floor_on_special_rows(dtype):
    """mean(x * x) + eps has a floor of eps, but no ceiling: its rsqrt is GpSimd's ALU rsqrt (one instruction, no
    range), its root mean square ScalarE's sqrt with only the large-input scaling; every special row still matches
    eager (the simulator refuses a ScalarE input outside its range)."""
    x = random_tensor((130, 48), seed=5)
    x[0] = 0.0  # mean 0: rsqrt(eps)
    x[1] = 3e38  # mean(x * x) overflows to inf: rsqrt(inf) = 0, then 3e38 * 0 = 0
    x[2] = 2.0**60  # mean 2**120: above the instruction's range, scaled
    x[3, 7] = float("nan")
    x[4] = 1e-30  # tiny squares: the floor is eps, not the squares
    x = x.to(dtype)
    for eps in (1e-6, 2.0**-80):
        region = check_against_eager(lambda a: _rms_norm(a, eps), x)
        sources = "".join(kernel.source for kernel in region.kernels)
        assert "op0=nl.rsqrt" in sources and "op=nl.rsqrt" not in sources  # the ALU's, not ScalarE's
    root_mean_square = check_against_eager(lambda a: torch.sqrt(a.float().pow(2).mean(-1) + 1e-5), x)
    sources = "".join(kernel.source for kernel in root_mean_square.kernels)
    assert "nl.sqrt" in sources and f"op0=nl.less, operand0={2.0**-100!r}" not in sources  # no small-value test
    region = check_against_eager(lambda a: _rms_norm(a, 0.0), x)  # no eps, no floor: GpSimd's ALU rsqrt as well
    assert "op0=nl.rsqrt" in "".join(kernel.source for kernel in region.kernels)


def test_a_mean_of_squares_plus_eps_has_a_floor_but_its_rsqrt_is_the_alus():
    from neuron_compile.expression_floors import Floors

    x = ir.Load("x", ir.Layout((4,), (1,), 0), "float32")
    mean_plus_eps = ir.Op("add", (ir.Result(), ir.Scalar(1e-6)))
    floors = Floors(results=(0.0,))
    assert 0.0 < floors.of(mean_plus_eps) <= 1e-6
    floored = str(guard_expression(ir.Op("rsqrt", (mean_plus_eps,)), floors=floors))
    # the floor bounds rsqrt's input from below only: GpSimd's ALU rsqrt (no range) either way, one instruction
    assert floored == str(guard_expression(ir.Op("rsqrt", (mean_plus_eps,)))) and floored.startswith("rsqrt_alu(")
    # sqrt above a floor: ScalarE's with the large-value scaling; with none, 1 / rsqrt on the ALU
    floored_sqrt = str(guard_expression(ir.Op("sqrt", (mean_plus_eps,)), floors=floors))
    assert "sqrt_in_range" in floored_sqrt and "rsqrt_alu" not in floored_sqrt
    assert "sqrt_in_range" not in str(guard_expression(ir.Op("sqrt", (ir.Result(),)), floors=floors))
    assert Floors().of(ir.Op("add", (x, ir.Scalar(1.0)))) is None  # a load nobody bounded
    assert Floors().of(ir.Op("sub", (ir.Op("mul", (x, x)), ir.Scalar(1.0)))) is None
    assert Floors(buffers={"x": 2.0}).of(ir.Op("cast", (x,), "bfloat16")) < 2.0  # a bf16 rounding may go down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqrt_of_a_value_with_a_floor_gives_inf_and_nan_back(dtype):
    """``x * x + 1`` has a floor of 1: its sqrt takes the floored form, which hands inf (x = +-inf or x * x
    overflowing) and nan back as they are, as eager's sqrt does."""
    check_against_eager(lambda a: torch.sqrt(a * a + 1.0), _specials(dtype))
