"""Scan lowerings (cumsum, cumprod, logcumsumexp, cummax, cummin) on the simulator vs eager: every dim of 1-D to
4-D (and 8-D) inputs, ragged partition tiles, scans longer than one free chunk, strided inputs, special values,
empty and 0-d tensors, dtype=, fusion with pointwise producers and consumers, the backend, and the reasons the
integer cases run eagerly."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import TOLERANCES, check_against_eager, compile_and_run, random_tensor, trace
from neuron_compile.lowering import unsupported_reason

SCANS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod, "logcumsumexp": torch.logcumsumexp}
# Products of values near 1 stay inside the fp32 / bf16 range over a few hundred steps.
VALUE_RANGES = {"cumsum": (-1.5, 1.5), "cumprod": (0.6, 1.4), "logcumsumexp": (-4.0, 4.0)}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(129,), (127, 129), (3, 128, 5), (2, 3, 129, 4), (1, 129), (129, 1)]
INF, NAN = float("inf"), float("nan")
EXTREMA = {"cummax": torch.cummax, "cummin": torch.cummin}
WITH_INDICES = {**TOLERANCES, torch.int64: (0, 0)}


def _values(shape, dtype, name, seed=0):
    return random_tensor(shape, dtype, seed, *VALUE_RANGES[name])


def _scan_node(gm):
    return next(node for node in gm.graph.nodes if node.op == "call_function" and "cum" in str(node.target))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCANS))
@pytest.mark.parametrize("shape", SHAPES)
def test_scan_over_every_dim_matches_eager(shape, name, dtype):
    x = _values(shape, dtype, name)
    for dim in range(len(shape)):
        region = check_against_eager(lambda t: SCANS[name](t, dim), x)
        assert "nisa.tensor_tensor_scan" in region.kernels[0].source


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCANS))
def test_long_scans_carry_the_last_column_across_chunks(name, dtype):
    low, high = (0.99, 1.01) if name == "cumprod" else (-2.0, 2.0)
    x = random_tensor((130, 5000), dtype, seed=1, low=low, high=high)
    region = check_against_eager(lambda t: SCANS[name](t, 1), x)
    chunk = re.search(r"for f0 in range\(0, 5000, (\d+)\):", region.kernels[0].source)
    assert chunk is not None and int(chunk.group(1)) < 5000
    # dim 0 of a contiguous tensor: the scanned dim is the strided one, the partitions read contiguous elements
    check_against_eager(lambda t: SCANS[name](t, 0), x.t().contiguous())


def test_fp32_cumsum_is_eagers_double_accumulation_rounded_to_fp32():
    # Eager's CPU cumsum accumulates fp32 in double. A plain fp32 running sum drifts from it by far more than the
    # test tolerance over 5000 steps; the kernel's TwoSum compensation gives eager's values bit for bit.
    x = random_tensor((64, 5000), seed=2)
    _, (got,) = compile_and_run(lambda t: torch.cumsum(t, 1), x)
    want = torch.cumsum(x, 1)
    plain = torch.from_numpy(np.cumsum(x.numpy(), axis=1, dtype=np.float32))
    assert not torch.allclose(plain, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logcumsumexp_of_large_inputs_rescales_by_the_running_max(dtype):
    # exp(x) alone would overflow at x > 88: the kernel only ever takes exp(x - running max) <= 1.
    x = random_tensor((64, 3000), dtype, seed=10, low=-1e4, high=1e4)
    check_against_eager(lambda t: torch.logcumsumexp(t, 1), x)
    check_against_eager(lambda t: torch.logcumsumexp(t, 0), (x + 500).t())


def test_fp32_cumprod_carries_its_rounding_errors_like_eagers_double():
    # TwoProduct error terms, carried by E_i = x_i * E_(i-1) + e_i: a plain fp32 running product differs from
    # eager's double on thousands of elements; the kernel on a handful, by one ulp (eager's double rounds too).
    x = random_tensor((64, 5000), seed=13, low=0.9, high=1.1)
    _, (got,) = compile_and_run(lambda t: torch.cumprod(t, 1), x)
    want = torch.cumprod(x, 1)
    plain = torch.from_numpy(np.cumprod(x.numpy(), axis=1, dtype=np.float32))
    assert (plain != want).sum() > 1000
    assert (got != want).sum() <= 10
    torch.testing.assert_close(got, want, rtol=2**-23, atol=0)


def test_bf16_scans_accumulate_in_fp32_like_eager():
    # Eager's bf16 CPU scans keep a float accumulator and round each output: the kernel does the same, exactly.
    x = random_tensor((8, 3000), torch.bfloat16, seed=3)
    _, (got,) = compile_and_run(lambda t: torch.cumsum(t, 1), x)
    assert torch.equal(got, torch.cumsum(x, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCANS))
def test_transposed_and_strided_inputs(name, dtype):
    x = random_tensor((40, 129), dtype, seed=4, low=0.7, high=1.3)
    check_against_eager(lambda t: SCANS[name](t.t(), 1), x)
    check_against_eager(lambda t: SCANS[name](t[:, ::3], 1), x)
    check_against_eager(lambda t: SCANS[name](t.unsqueeze(0).expand(3, 40, 129), 0), x)
    y = random_tensor((5, 6, 7), dtype, seed=5, low=0.7, high=1.3)
    for dim in range(3):
        check_against_eager(lambda t: SCANS[name](t.permute(2, 0, 1), dim), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCANS))
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf in the simulator, as on the device
def test_inf_nan_and_signed_zero(name, dtype):
    rows = [
        [1.0, INF, 2.0, -INF, 3.0, 1.0],
        [NAN, 1.0, 2.0, 3.0, 4.0, 5.0],
        [-0.0, -0.0, 2.0, -2.0, -0.0, 1.0],
        [2.0, -INF, 0.0, 1.0, -1.0, 0.5],
        [-0.0, 3.0, -0.0, INF, 0.0, NAN],
    ]
    x = torch.tensor(rows).to(dtype)
    _, (got,) = compile_and_run(lambda t: SCANS[name](t, 1), x)
    want = SCANS[name](x, 1)
    # Sums and products of these few values are exact; logcumsumexp's exp and log round (harness tolerances).
    exact = name != "logcumsumexp"
    torch.testing.assert_close(got, want, rtol=0 if exact else None, atol=0 if exact else None, equal_nan=True)
    numbers = ~torch.isnan(want)  # a nan's sign bit is not part of its value
    assert torch.equal(torch.signbit(got[numbers]), torch.signbit(want[numbers]))  # cumsum(-0.0) is +0.0


@pytest.mark.parametrize("name", sorted(SCANS))
def test_empty_and_zero_dim_tensors(name):
    for shape, dim in [((0, 5), 0), ((0, 5), 1), ((3, 0), 1), ((3, 0, 2), 2)]:
        check_against_eager(lambda t: SCANS[name](t, dim), random_tensor(shape))
    for value in (-0.0, 2.5, -INF):
        for dtype in DTYPES:
            x = torch.tensor(value, dtype=dtype)
            _, (got,) = compile_and_run(lambda t: SCANS[name](t, 0), x)
            want = SCANS[name](x, 0)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            assert torch.signbit(got) == torch.signbit(want)  # a 0-d scan is a copy: -0.0 stays -0.0


@pytest.mark.parametrize("name", sorted(SCANS))
def test_scan_of_a_fill(name):
    # The fused prologue folds to a number (cumsum of ones counts positions): the kernel scans a memset tile.
    region = check_against_eager(lambda t: SCANS[name](torch.full_like(t, 1.5), 1), random_tensor((5, 300)))
    assert len(region.kernels) == 1 and "value=1.5" in region.kernels[0].source


def test_rank_8_scan_over_a_middle_dim():
    x = random_tensor((2, 1, 3, 2, 5, 1, 2, 3), seed=6)
    for dim in (0, 4, 6):
        check_against_eager(lambda t: torch.cumsum(t, dim), x)


def test_dtype_argument_follows_eager():
    x = random_tensor((6, 300), seed=7)
    # dtype=bf16 rounds the input first, then accumulates in fp32 and rounds each output
    check_against_eager(lambda t: torch.cumsum(t, 1, dtype=torch.bfloat16), x)
    # bf16 input, fp32 result: exact widening, then eager's double accumulation
    xb = x.bfloat16()
    _, (got,) = compile_and_run(lambda t: torch.cumsum(t, 1, dtype=torch.float32), xb)
    assert torch.equal(got, torch.cumsum(xb, 1, dtype=torch.float32))
    check_against_eager(lambda t: torch.cumprod(t, 0, dtype=torch.float32), random_tensor((9, 4), torch.bfloat16))
    check_against_eager(lambda t: torch.cumsum(t, 1, dtype=torch.float32), x > 0)  # bool counts, as floats


@pytest.mark.parametrize("fn, reason", [
    (lambda t: torch.cumsum(t > 0, 1), "integer running sum (int64 result)"),
    (lambda t: torch.cumsum(t, 1, dtype=torch.int64), "integer running sum (int64 result)"),
    (lambda t: torch.cumprod((t * 3).to(torch.int32), 0), "integer running prod (int64 result)"),
    (lambda t: torch.cumsum(t.to(torch.int32), 1, dtype=torch.float32), "int32 input"),
])
def test_integer_scans_keep_an_eager_reason(fn, reason):
    gm = trace(fn, random_tensor((4, 5)))
    message = unsupported_reason(_scan_node(gm))
    assert message is not None and reason in message and "exact" in message


def test_pointwise_producer_and_consumer_fuse_into_the_scan_kernel():
    x, y = random_tensor((6, 300)), random_tensor((6, 300), seed=1)
    for dtype in DTYPES:
        region = check_against_eager(lambda a, b: torch.cumsum(a * 2 - b, 1) + b, x.to(dtype), y.to(dtype))
        assert len(region.kernels) == 1 and all("fused" in decision for decision in region.fusion_decisions)
    # read through another index map (transposed): the consumer is its own kernel
    region = check_against_eager(lambda a: torch.cumsum(a, 1).t() + a.t(), random_tensor((5, 5)))
    assert len(region.kernels) == 2


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.sampled_from([1, 2, 5, 127, 128, 129]), min_size=1, max_size=4), data=st.data(),
       dtype=st.sampled_from(DTYPES), name=st.sampled_from(sorted(SCANS)))
def test_scans_over_drawn_shapes(shape, data, dtype, name):
    while np.prod(shape) > 20_000:
        shape[shape.index(max(shape))] = 2
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = _values(tuple(shape), dtype, name)
    check_against_eager(lambda t: SCANS[name](t, dim), x)


def test_through_the_backend_every_node_in_kernels():
    def fn(x, y):
        return (torch.cumsum(x, -1) * torch.cumprod(y, 0), torch.cumsum(x.t(), 1, dtype=torch.bfloat16),
                torch.logcumsumexp(x, 0), *torch.cummax(y, 1))

    x, y = random_tensor((33, 700), seed=8), random_tensor((33, 700), seed=9, low=0.9, high=1.1)
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    with neuron_compile.config.patch(fallback="raise"):
        got = torch.compile(fn, backend="neuron")(x, y)
    stats = neuron_compile.stats()
    torch._dynamo.reset()
    for out, want in zip(got, fn(x, y)):
        rtol, atol = WITH_INDICES[want.dtype]
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] >= 6, stats


def _extremum(name, dim):
    return lambda t: tuple(EXTREMA[name](t, dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_cummax_cummin_values_and_indices_over_every_dim(name, dtype):
    # Rounded values tie often: eager's index is the last of equal values (x >= running max), checked exactly.
    for shape in [(127, 129), (2, 3, 129, 4)]:
        x = (random_tensor(shape, seed=11) * 4).round().to(dtype)
        for dim in range(len(shape)):
            check_against_eager(_extremum(name, dim), x, tolerances=WITH_INDICES)
    x = (random_tensor((130, 5000), seed=12) * 8).round().to(dtype)  # chunks carry the value and its index
    region = check_against_eager(_extremum(name, 1), x, tolerances=WITH_INDICES)
    assert "nisa.iota" in region.kernels[1].source
    check_against_eager(_extremum(name, 0), x.t(), tolerances=WITH_INDICES)


@pytest.mark.parametrize("name", sorted(EXTREMA))
def test_cummax_cummin_special_values_and_edge_shapes(name):
    rows = [[0.0, -0.0, 1.0, NAN, 2.0, NAN, 5.0], [-INF, -INF, -0.0, 0.0, -0.0, INF, 1.0],
            [INF, 1.0, -INF, NAN, NAN, 0.0, -0.0]]
    for dtype in DTYPES:
        x = torch.tensor(rows, dtype=dtype)
        _, (values, indices) = compile_and_run(_extremum(name, 1), x)
        want = EXTREMA[name](x, 1)
        assert torch.equal(indices, want.indices)  # a nan takes the place, later numbers do not
        torch.testing.assert_close(values, want.values, rtol=0, atol=0, equal_nan=True)
        numbers = ~torch.isnan(want.values)
        assert torch.equal(torch.signbit(values[numbers]), torch.signbit(want.values[numbers]))  # -0.0 after 0.0
    for shape, dim in [((0, 5), 1), ((3, 0), 1), ((), 0)]:
        check_against_eager(_extremum(name, dim), random_tensor(shape), tolerances=WITH_INDICES)
    gm = trace(_extremum(name, 0), torch.arange(6))
    assert "int64 input (its integers are exact in fp32 only within +-2**24)" in unsupported_reason(_scan_node(gm))
