"""Pointwise math lowerings (lowering/pointwise_math.py) on the simulator against eager PyTorch: rounding, sign
bits, logical ops, nan-aware min/max, tensor clamps, exp/log variants, elu / hardtanh / leaky_relu and their
backward ops. Special values (signed zeros, halves, nan, infinities, huge and subnormal magnitudes) everywhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile.lowering import unsupported_reason

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1,), (127,), (128, 3), (129, 5), (3, 130), (2, 3, 5), (7, 600)]

# Halves (ties to even), values next to them, fp32 integers beyond 2**22 / 2**23, tiny, huge and special.
SPECIAL = [0.0, -0.0, 0.3, -0.3, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 1.0000001, 3.7, -3.7,
           4194304.5, -4194304.5, 8388607.5, -8388607.5, 8388609.0, 16777218.0, 1e30, -1e30, 3e38, 1e-30, -1e-30,
           1e-40, -1e-40, 1e-3, 1e-8, -1e-8, 0.7, -0.7, 50.0, -50.0, 100.0, -100.0, NAN, INF, -INF]


def special_values(dtype, rows=135):
    """SPECIAL repeated over 135 rows (more than one partition tile)."""
    return torch.tensor(SPECIAL).repeat(rows, 1).to(dtype)


def assert_same_bits(got, want):
    """Equal values, nan where eager has nan, and the same sign on zeros (assert_close treats -0.0 == 0.0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if want.is_floating_point():
        finite = ~want.isnan()
        assert torch.equal(got[finite].signbit(), want[finite].signbit())


EXACT = {
    "round": torch.round,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "trunc": torch.trunc,
    "frac": torch.frac,
    "sign": torch.sign,
    "sgn": torch.sgn,
    "signbit": torch.signbit,
    "isinf": torch.isinf,
    "copysign": lambda x: torch.copysign(x[:, 1:], x[:, :-1]),
    "copysign_scalar": lambda x: torch.copysign(x, -2.0),
    "copysign_one": lambda x: torch.copysign(torch.ones_like(x), x),
    "softshrink": lambda x: torch.nn.functional.softshrink(x, 0.5),
    "leaky_relu": lambda x: torch.nn.functional.leaky_relu(x, 0.125),
    "hardtanh": lambda x: torch.nn.functional.hardtanh(x, -2.0, 3.0),
    "relu6": torch.nn.functional.relu6,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_ops_match_eager_bit_for_bit(name, dtype):
    x = special_values(dtype)
    fn = EXACT[name]
    got = compile_and_run(fn, x)[1][0]
    want = fn(x)
    if name in ("hardtanh", "relu6", "softshrink"):  # signed zeros: min/max unspecified; softshrink decomposes
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        assert_same_bits(got, want)


@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000),
       magnitude=st.sampled_from([3.0, 1e4, 1e7, 3e7]), name=st.sampled_from(["round", "floor", "ceil", "trunc"]))
def test_rounding_matches_eager_on_random_magnitudes(shape, dtype, seed, magnitude, name):
    x = random_tensor(shape, dtype, seed, -magnitude, magnitude)
    fn = EXACT[name]
    assert_same_bits(compile_and_run(fn, x)[1][0], fn(x))


@pytest.mark.parametrize("decimals", [0, 1, 3])
def test_round_decimals_matches_eager(decimals):
    x = torch.cat([special_values(torch.float32, 3).flatten(), random_tensor((129, 7), seed=3, low=-50, high=50)
                   .flatten()])
    check_against_eager(lambda t: torch.round(t, decimals=decimals), x)


def test_negative_round_decimals_is_declined():
    # 2500 / 1000 = 2.5 rounds to 2; 2500 * fp32(0.001) = 2.5000001 would round to 3: not claimed.
    gm = trace(lambda t: torch.round(t, decimals=-3), torch.tensor([2500.0]))
    (node,) = [node for node in gm.graph.nodes if node.op == "call_function"]
    assert "negative decimals" in unsupported_reason(node)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("name", ["logical_and", "logical_or", "logical_xor"])
def test_logical_ops_are_truth_tests(name, dtype):
    x = special_values(dtype) if dtype != torch.bool else special_values(torch.float32) > 0
    y = x.flip(0).roll(3, dims=1).contiguous()
    fn = getattr(torch, name)
    assert_same_bits(compile_and_run(fn, x, y)[1][0], fn(x, y))
    # mixed operand dtypes, broadcast
    assert_same_bits(compile_and_run(fn, x, y[:1].float())[1][0], fn(x, y[:1].float()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["fmax", "fmin", "maximum_clamp", "clamp_min", "clamp_max", "clamp_low_only"])
def test_nan_aware_min_max_and_tensor_clamps(name, dtype):
    x = special_values(dtype)
    y = x.roll(5, dims=1)
    z = x.roll(11, dims=1).flip(0)
    functions = {
        "fmax": lambda x, y, z: torch.fmax(x, y),
        "fmin": lambda x, y, z: torch.fmin(x, y[:1]),
        "maximum_clamp": lambda x, y, z: torch.clamp(x, min=y, max=z),
        "clamp_min": lambda x, y, z: torch.clamp_min(x, y),
        "clamp_max": lambda x, y, z: torch.clamp_max(x, z[:, :1]),
        "clamp_low_only": lambda x, y, z: torch.clamp(x, min=y),
    }
    got = compile_and_run(functions[name], x, y, z)[1][0]
    torch.testing.assert_close(got, functions[name](x, y, z), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(), (1,), (5, 1)])
def test_selects_over_one_column_domains(shape):
    # one-column domains load every operand as a (P, 1) row vector: where and copysign work there too
    x, y = torch.full(shape, NAN), torch.full(shape, -0.0)
    check_against_eager(lambda x, y: (torch.fmax(x, y), torch.copysign(y + 1, y), torch.round(y)), x, y)


# Accurate forms: each compared over ranges where a naive formula would miss rtol 1e-5 (cancellation near 0 for
# expm1 / log1p, huge and subnormal arguments for the logs, which the log instruction must never see).
ACCURATE = {
    "expm1": (torch.expm1, [-1e-6, 1e-6, -1e-3, 1e-3, -0.4999, 0.4999, 0.50001, -0.6, 3.0, -30.0, 88.0, 89.0]),
    "log1p": (torch.log1p, [-1e-7, 1e-7, 1e-4, -0.5, -0.9999, -1.0, -1.5, 2.0**24, 2.0**25, 1e30, 3e38, -1e-30]),
    "log2": (torch.log2, [0.0, -1.0, 1e-40, 1e-30, 0.999, 1.0, 1.001, 5.0, 2.0**63, 2.0**64, 1e38, 3e38]),
    "log10": (torch.log10, [0.0, -1.0, 1e-40, 1e-20, 0.5, 1.0, 10.0, 1e10, 2.0**70, 3e38, 1e-44, 7.0]),
    "exp2": (torch.exp2, [-149.0, -126.5, -10.3, -1.0, 0.0, 0.3, 1.0, 12.7, 100.0, 127.9, 128.0, 200.0]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ACCURATE))
def test_exp_log_variants_match_eager(name, dtype):
    fn, extremes = ACCURATE[name]
    x = torch.cat([special_values(torch.float32, 2).flatten(), torch.tensor(extremes),
                   random_tensor((129, 5), seed=4, low=-0.9, high=3.0).flatten()]).to(dtype)
    check_against_eager(fn, x)


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from(SHAPES), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 1000),
       scale=st.sampled_from([1e-4, 0.4, 0.6, 5.0, 60.0]), name=st.sampled_from(["expm1", "log1p", "log2"]))
def test_exp_log_variants_on_random_ranges(shape, dtype, seed, scale, name):
    low = -scale if name == "expm1" else -min(scale, 0.99)
    check_against_eager(ACCURATE[name][0], random_tensor(shape, dtype, seed, low, scale))


ACTIVATIONS = {
    "elu": lambda x: torch.nn.functional.elu(x),
    "elu_alpha": lambda x: torch.nn.functional.elu(x, alpha=0.7),
    "selu": torch.nn.functional.selu,
    "celu": lambda x: torch.nn.functional.celu(x, alpha=1.5),
    "threshold": lambda x: torch.nn.functional.threshold(x, 0.25, -3.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_eager(name, dtype):
    x = torch.cat([special_values(torch.float32, 2).flatten(), random_tensor((129, 5), seed=5).flatten()]).to(dtype)
    check_against_eager(ACTIVATIONS[name], x)


BACKWARD = {
    "leaky_relu_backward": lambda g, x: aten.leaky_relu_backward(g, x, 0.2, False),
    "leaky_relu_backward_from_result": lambda g, x: aten.leaky_relu_backward(g, aten.leaky_relu(x, 0.3), 0.3, True),
    "threshold_backward": lambda g, x: aten.threshold_backward(g, x, 0.0),
    "threshold_backward_at": lambda g, x: aten.threshold_backward(g, x, 1.5),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_activation_backward_ops_match_eager(name, dtype):
    x = torch.cat([special_values(torch.float32, 1).flatten(), random_tensor((129, 6), seed=6, low=-8, high=8)
                   .flatten()]).to(dtype)
    grad = random_tensor(x.shape, dtype, seed=7)
    check_against_eager(BACKWARD[name], grad, x)


def test_training_graph_of_elu_and_leaky_relu_is_lowered():
    x = random_tensor((128, 33), seed=8).requires_grad_()

    def fn(x):
        return torch.nn.functional.elu(x) * torch.nn.functional.leaky_relu(x) + torch.nn.functional.hardtanh(x)

    compiled = torch.compile(fn, backend="neuron")
    eager_x = x.detach().clone().requires_grad_()
    fn(eager_x).sum().backward()
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, eager_x.grad, rtol=1e-5, atol=1e-5)


INVERSE_AND_HYPERBOLIC = ["erfc", "atan", "atanh", "sinh", "cosh", "asin", "acos", "asinh", "acosh"]
EDGES = [0.999, -0.999, 0.9999999, -0.9999999, 1.0, -1.0, 1.0000001, 0.5, -0.5, 0.50000006, -0.49999997, 1e-7, 19.9, 20.0, 20.1, 88.0, -88.0, 89.5, 2.0**40,
         2.0**41, 1e38, 0.75, 16.0, 127.9]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", INVERSE_AND_HYPERBOLIC)
def test_inverse_and_hyperbolic_functions_match_eager(name, dtype):
    x = torch.cat([special_values(torch.float32, 2).flatten(), torch.tensor(EDGES),
                   random_tensor((300,), seed=9, low=-20, high=20), random_tensor((129, 3), seed=10).flatten()])
    check_against_eager(getattr(torch, name), x.to(dtype))


@pytest.mark.parametrize("name", ["sinh", "cosh"])
def test_hyperbolic_near_overflow_is_the_exact_value(name):
    # exp(|x|) overflows for |x| > 88.72 but cosh(x) = exp(|x|) / 2 does not until 89.42; eager's scalar loop
    # (a 1-element tensor) returns that finite value, its vectorized loop inf: we return the finite value.
    x = torch.tensor([88.8, -89.0, 89.3, 89.41])
    got = compile_and_run(getattr(torch, name), x)[1][0]
    want = torch.stack([getattr(torch, name)(value.reshape(1))[0] for value in x])
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 1000), scale=st.sampled_from([1e-3, 0.9, 3.0, 1e3, 1e30]),
       name=st.sampled_from(["atan", "atanh", "sinh", "cosh", "asin", "acos", "asinh", "acosh"]))
def test_inverse_and_hyperbolic_on_random_ranges(shape, seed, scale, name):
    scale = min(scale, 80.0) if name in ("sinh", "cosh") else scale
    low, high = (1.0, 1.0 + scale) if name == "acosh" else (-scale, scale)
    check_against_eager(getattr(torch, name), random_tensor(shape, torch.float32, seed, low, high))


@pytest.mark.parametrize("dtype", DTYPES)
def test_atan2_over_every_pair_of_special_values(dtype):
    # signed zeros (atan2(+-0, -0) = +-pi), infinities on either side, nan, subnormals and 3e38 next to 1e-40
    values = torch.tensor(SPECIAL)
    y, x = values.repeat_interleave(len(values)), values.repeat(len(values))
    y = torch.cat([y, random_tensor((300,), seed=11, low=-1e3, high=1e3), random_tensor((129,), seed=12)])
    x = torch.cat([x, random_tensor((300,), seed=13), random_tensor((129,), seed=14, low=-1e-3, high=1e-3)])
    got = compile_and_run(torch.atan2, y.to(dtype), x.to(dtype))[1][0]
    want = torch.atan2(y.to(dtype), x.to(dtype))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, equal_nan=True)
    exact = (want == 0) | want.abs().isinf()
    assert torch.equal(got[exact].signbit(), want[exact].signbit())


def test_bool_fills_and_bitwise_ops_on_bool():
    x = random_tensor((129, 3))
    check_against_eager(lambda t: torch.full_like(t, True, dtype=torch.bool), x)
    check_against_eager(lambda t: torch.full((3, 600), True), x)
    for op in (torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor):
        check_against_eager(lambda t, op=op: op(t > 0, t < 1), x)
    check_against_eager(lambda t: ~(t > 0), x)
    check_against_eager(lambda t: t.masked_fill(~torch.ones(129, 3, dtype=torch.bool).tril(), float("-inf")), x)


def test_bitwise_ops_on_integers_keep_a_reason():
    a = torch.arange(6, dtype=torch.int32)
    gm = trace(lambda t: torch.bitwise_and(t, t), a)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.bitwise_and.Tensor)
    assert unsupported_reason(node) == "dtype int32"  # integer tensors reach only views, gathers and exact math
    node = next(n for n in trace(lambda t: ~t, a).graph.nodes if n.target is torch.ops.aten.bitwise_not.default)
    assert unsupported_reason(node) == "dtype int32"
