"""``(x * c) * x`` as one ScalarE ``activation(square, x, scale=sqrt(c))`` (ir.py ``scaled_square``,
codegen/expressions.py ``_emit_scaled_square``).

Against eager over sizes 1, 127, 128, 129, 300 and ragged two-dimensional shapes, fp32 and bf16 inputs, with the
special values (signed zeros, inf, nan, values near fp32's overflow and underflow); the kernel text has the
activation and no tensor_tensor multiply; the pattern's limits (``c`` outside (0, 1], two different tiles, a row
vector) keep the products. AdamW's update, whose ``(1 - beta2) * g * g`` this is, against eager's foreach AdamW
(fp32 and bf16 parameters, weight decay on and off, amsgrad), with the activation in its kernel."""

from __future__ import annotations

import math

import pytest
import torch
from adamw_harness import adamw_step
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_harness import TOLERANCES, check_against_eager, compile_and_run, random_tensor

import neuron_compile
from neuron_compile import ir

SHAPES = [(1,), (127,), (128,), (129,), (300,), (3, 129), (129, 130), (2, 65, 33)]


def _sources(region) -> str:
    return "\n".join(kernel.source for kernel in region.kernels)


def _scaled_square(c):
    def fn(x, y):
        return y + x * c * x
    return fn


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       c=st.sampled_from([1e-3, 0.1, 0.5, 1.0, 2.0**-100]))
def test_a_scaled_square_equals_eager_and_is_one_activation(shape, dtype, c):
    x, y = random_tensor(shape, dtype, seed=1, low=-3.0, high=3.0), random_tensor(shape, dtype, seed=2)
    region = check_against_eager(_scaled_square(c), x.float(), y)
    source = _sources(region)
    scale = float(torch.tensor(math.sqrt(float(torch.tensor(c)))).item())
    if x.numel() == 1:  # one element: loaded as a (P, 1) row vector and computed once (the plain products)
        assert "op=nl.square" not in source
        return
    assert "op=nl.square, data=" in source and f"scale={scale!r}" in source
    assert "op=nl.multiply)" not in source  # no tensor_tensor multiply left


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_are_those_of_the_two_products(dtype):
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.8e19, -1.9e19, 3.0e38, 1e-20, 1e-38, 1e-45, 2.0]
    x = torch.tensor(specials * 11, dtype=torch.float32)
    y = torch.zeros_like(x, dtype=dtype)
    region, (got,) = compile_and_run(_scaled_square(1e-3), x, y)
    want = _scaled_square(1e-3)(x, y)
    assert "op=nl.square" in _sources(region)
    torch.testing.assert_close(got, want, rtol=TOLERANCES[torch.float32][0], atol=0.0, equal_nan=True)
    # inf where eager overflows, nan where it gives nan, zero with eager's sign
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(want[want == 0]))


@pytest.mark.parametrize("fn, reason", [
    (lambda x, y: y + x * 2.0 * x, "a factor over 1"),
    (lambda x, y: y + x * -0.5 * x, "a negative factor"),
    (lambda x, y: y + x * 0.5 * y, "two different tiles"),
])
def test_outside_the_pattern_the_products_stay(fn, reason):
    x, y = random_tensor((129, 130), seed=1), random_tensor((129, 130), seed=2)
    region = check_against_eager(fn, x, y)
    assert "op=nl.square" not in _sources(region), reason


def test_the_pattern_matcher():
    tile, other = ir.Op("exp", (ir.Scalar(0.0),)), ir.Op("exp", (ir.Scalar(1.0),))  # stand-ins for tiles
    c = ir.Scalar(1e-3)
    assert ir.scaled_square(ir.Op("mul", (ir.Op("mul", (tile, c)), tile))) == (tile, 1e-3)
    assert ir.scaled_square(ir.Op("mul", (tile, ir.Op("mul", (c, tile))))) == (tile, 1e-3)
    assert ir.scaled_square(ir.Op("mul", (ir.Op("mul", (tile, c)), other))) is None
    for factor in (0.0, -1e-3, 1.5, math.inf, math.nan):
        assert ir.scaled_square(ir.Op("mul", (ir.Op("mul", (tile, ir.Scalar(factor))), tile))) is None
    # a product rounded to bf16 is not the fp32 product the activation computes
    rounded = ir.Op("cast", (ir.Op("mul", (tile, c)),), dtype="bfloat16")
    assert ir.scaled_square(ir.Op("mul", (rounded, tile))) is None


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       options=st.sampled_from([(False, 0.0), (False, 0.1), (True, 0.1), (True, 0.0)]))
def test_adamw_with_its_scaled_square_equals_eager(shape, dtype, options, tmp_path_factory):
    dump = tmp_path_factory.mktemp("dump")
    with neuron_compile.config.patch(dump_dir=str(dump)):
        got = adamw_step(shape, dtype, *options, compiled=True)
    want = adamw_step(shape, dtype, *options, compiled=False)
    rtol, atol = TOLERANCES[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    if math.prod(shape) > 1:  # one element: (P, 1) row vectors, the plain products
        sources = "\n".join(path.read_text() for path in dump.rglob("*.py"))
        assert "op=nl.square" in sources and "scale=0.0316227" in sources  # sqrt(1 - beta2)
