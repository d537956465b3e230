"""Trigonometry lowerings (lowering/trigonometry.py) on the simulator against eager PyTorch: sin, cos and tan for
every fp32 magnitude (the Payne-Hanek reduction), the closest fp32 approaches to multiples of pi/2 (tan's poles),
signed zeros, infinities and nan; sinc, and the cosine window through the backend. The simulator refuses a sin
activation fed outside [-pi, pi], so every test here also checks that the reduction keeps it in range."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import neuron_compile
from lowering_harness import TOLERANCES, check_against_eager, compile_and_run, random_tensor
from neuron_compile import ir
from neuron_compile.lowering import trigonometry
from neuron_compile.runtime import simulator as nki

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.bfloat16]


def _neighbours(value: float) -> list[float]:
    v = np.float32(value)
    return [float(np.nextafter(v, np.float32(-INF))), float(v), float(np.nextafter(v, np.float32(INF)))]


# Multiples of pi/2 (and their fp32 neighbours), the closest fp32 approaches to multiples of pi/2 (16367173 * 2**72
# is the worst case over all fp32), powers of two around the 2**22 .. 2**25 thresholds of the reduction, huge,
# tiny, subnormal and special values.
SPECIAL = sorted({v for k in range(-8, 9) for v in _neighbours(k * math.pi / 2)}) + [
    -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 2.0**-12, 2.0**-13, 1e-3, 0.75, 9.0, -9.0, 1e4, -1e4, 1e6, 2.0**20,
    2.0**22 + 1, 2.0**23 + 1, 2.0**24, 2.0**24 + 2, 2.0**25, 2.0**25 + 4, -2.0**26, 1e10, 16367173 * 2.0**72,
    10741887 * 2.0**11, 16573937 * 2.0**-16, 1e30, -1e30, 3e38, -3e38, 3.4028235e38, NAN, INF, -INF,
]


def special_values(dtype, rows=130):
    """SPECIAL repeated over 130 rows (more than one partition tile)."""
    return torch.tensor(SPECIAL).repeat(rows, 1).to(dtype)


def trigonometric(t):
    return torch.sin(t), torch.cos(t), torch.tan(t)


def compare(x):
    """sin, cos and tan of ``x`` compiled once (one kernel each), against eager at the harness tolerances; the
    compiled results."""
    got = compile_and_run(trigonometric, x)[1]
    for value, want in zip(got, trigonometric(x)):
        assert value.dtype == want.dtype and value.shape == want.shape and value.stride() == want.stride()
        rtol, atol = TOLERANCES[want.dtype]
        torch.testing.assert_close(value, want, rtol=rtol, atol=atol, equal_nan=True)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_match_eager(dtype):
    x = special_values(dtype)
    sin, cos, tan = compare(x)
    # assert_close treats -0.0 == 0.0: sin and tan keep the sign of zero (sin(-0.0) = -0.0), cos(+-0.0) = 1.
    zeros = x == 0
    assert torch.equal(sin[zeros].signbit(), x[zeros].signbit())
    assert torch.equal(tan[zeros].signbit(), x[zeros].signbit())
    assert (cos[zeros] == 1).all()
    for value in (sin, cos, tan):
        assert torch.isnan(value[~torch.isfinite(x)]).all()


def test_every_scale_of_fp32_matches_eager():
    # 2**-20 .. 2**127 in steps of 2**7, 129 rows per scale: measured errors (vs float64 of the input) 1.2e-7
    # absolute for sin and cos, 5e-7 relative for tan.
    x = torch.cat([random_tensor((129, 8), seed=e + 200, low=-1.0, high=1.0) * 2.0**e for e in range(-20, 128, 7)])
    sin, cos, tan = compare(x)
    want_sin, want_cos, want_tan = trigonometric(x.double())
    assert (sin.double() - want_sin).abs().max() < 2e-7 and (cos.double() - want_cos).abs().max() < 2e-7
    assert ((tan.double() - want_tan).abs() / want_tan.abs().clamp_min(1.0)).max() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_ranges_bf16_and_fp32(dtype):
    x = torch.cat([random_tensor((70, 9), seed=1, low=-4, high=4), random_tensor((70, 9), seed=2, low=-1e3, high=1e3),
                   random_tensor((70, 9), seed=3, low=-1e20, high=1e20)]).to(dtype)
    compare(x)


def test_non_contiguous_input_and_fused_neighbours():
    base = random_tensor((40, 150), seed=4, low=-50, high=50)
    x = base.t()[::2]  # (75, 40), strided
    check_against_eager(lambda t: torch.sin(t) * torch.cos(t * 3) + torch.tan(t), x)


@settings(max_examples=4, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_any_fp32_values_match_eager(values):
    compare(torch.tensor(values, dtype=torch.float32))


def test_sinc_goes_through_sin():
    x = torch.cat([torch.linspace(-20, 20, 333), torch.tensor([0.0, -0.0, 1e-3, 1e6, 3e7])])
    check_against_eager(torch.sinc, x)
    check_against_eager(torch.sinc, x.bfloat16())


def test_backend_lowers_sin_cos_and_tan_without_fallback():
    x = random_tensor((130, 17), seed=5, low=-1e5, high=1e5)

    def fn(t):
        return torch.sin(t) + torch.cos(t) * torch.signal.windows.cosine(17) + torch.tan(t)

    neuron_compile.reset_stats()
    with neuron_compile.config.patch(fallback="raise"):
        got = torch.compile(fn, backend="neuron")(x)
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=1e-5)
    stats = neuron_compile.stats()
    assert stats["fallback_nodes"] == 0 and stats["nki_nodes"] > 0


def test_tan_at_its_poles_keeps_relative_accuracy():
    # The closest fp32 approaches to odd multiples of pi/2 (|tan| up to 6e8) and every fp32 next to k * pi/2 for
    # odd k up to 2001: tan ~ -1 / r there, so the reduced argument needs its relative accuracy.
    odd = torch.arange(1, 2002, 2, dtype=torch.float64) * (math.pi / 2)
    near = odd.float()
    x = torch.cat([torch.tensor([16367173 * 2.0**72, 10741887 * 2.0**11, 16573937 * 2.0**-16, 10057457 * 2.0**62]),
                   near, torch.nextafter(near, torch.tensor(0.0)), torch.nextafter(near, torch.tensor(INF))])
    got = compile_and_run(torch.tan, x)[1][0]
    want = torch.tan(x.double())
    assert want.abs().max() > 5e8
    assert ((got.double() - want).abs() / want.abs()).max() < 1e-6
    torch.testing.assert_close(got, torch.tan(x), rtol=1e-5, atol=1e-5)


def test_sin_activation_sees_the_reduced_range(monkeypatch):
    from neuron_compile.runtime.simulator import isa_activation

    seen = []
    check = isa_activation.check_activation_range

    def watch(op, function, x):
        if function == "sin":
            seen.append(float(np.abs(x).max()))
        check(op, function, x)

    monkeypatch.setattr(isa_activation, "check_activation_range", watch)
    x = special_values(torch.float32, rows=1).flatten()
    for fn, limit in ((torch.sin, math.pi / 2), (torch.cos, math.pi / 2), (torch.tan, 3 * math.pi / 4)):
        seen.clear()
        compile_and_run(fn, x)
        assert seen and max(seen) <= limit + 2e-4, (fn, max(seen))


def test_shared_subexpressions_print_once():
    from neuron_compile import ir

    x = ir.Load("x", ir.Layout((4,), (1,), 0), "float32")
    twice = trigonometry.add(trigonometry.absolute(x), trigonometry.absolute(x))
    assert str(twice) == "{%0 = abs(" + str(x) + "); add(%0, %0)}"
    assert hash(twice) == hash(trigonometry.add(trigonometry.absolute(x), trigonometry.absolute(x)))


def test_two_over_pi_pieces_are_exact_fp32_and_sum_to_two_over_pi():
    mpmath.mp.prec = 300
    total = mpmath.mpf(0)
    for j in range(trigonometry.PIECES):
        piece = trigonometry.two_over_pi_piece(j)
        assert float(np.float32(piece)) == piece  # an exact fp32
        mantissa, _ = math.frexp(piece)
        assert (mantissa * 2**12).is_integer()  # at most 12 significant bits
        total += mpmath.ldexp(piece, -trigonometry.SCALE_EXPONENT)
    assert abs(total - 2 / mpmath.pi) < mpmath.ldexp(1, -180)


def test_simulator_refuses_sin_outside_its_valid_range():
    nl, nisa = nki.language, nki.isa

    def kernel(a):
        tile = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(tile, a)
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(out, nl.sin, tile)
        result = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(result, out)
        return result

    inside = np.array([[-np.float32(np.pi), -1.0, 0.0, 3.0, np.float32(np.pi)]], dtype=np.float32)
    np.testing.assert_allclose(nki.run_kernel(kernel, [inside]).outputs[0], np.sin(inside), rtol=1e-6, atol=1e-7)
    for bad in (9.0, -3.2, NAN, INF):
        with pytest.raises(nki.NkiValidationError, match=r"err_activation_input_out_of_range.*\[-pi, pi\]"):
            nki.run_kernel(kernel, [np.array([[0.5, bad]], dtype=np.float32)])


# ---------------------------------------------------------------- bounded arguments (Cody-Waite, direct)


def _bounded_region(fn, x, bound):
    """``fn(x)`` compiled as one region whose input carries the value range [-bound, bound] (what the call-time
    guard of passes/input_ranges.py gives a float input), run on ``x``; the region and its outputs."""
    from lowering_harness import trace
    from neuron_compile.passes.value_range import RANGE_KEY, Interval
    from neuron_compile.pipeline import compile_region

    gm = trace(fn, x)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[RANGE_KEY] = Interval(-bound, bound)
    region = compile_region(gm, [x], neuron_compile.config.get())
    return region, region(x)


def _activation_count(region) -> int:
    return sum(kernel.source.count("nisa.") for kernel in region.kernels)


def _near_multiples_of_half_pi(limit: float) -> torch.Tensor:
    k = torch.arange(-int(limit / (math.pi / 2)), int(limit / (math.pi / 2)) + 1, dtype=torch.float64)
    near = (k * (math.pi / 2)).float()
    return torch.cat([near, torch.nextafter(near, torch.tensor(-INF)), torch.nextafter(near, torch.tensor(INF))])


@pytest.mark.parametrize("fn", [torch.sin, torch.cos])
def test_cody_waite_form_within_its_limit_is_accurate_and_cheap(fn):
    # Every fp32 next to a multiple of pi/2 up to the limit, the limit itself, random values over every scale:
    # within 2e-7 absolute of float64 (as the full reduction), from ~20 instructions instead of ~400.
    limit = trigonometry.CODY_WAITE_LIMIT
    scales = [random_tensor((4096,), seed=e + 300, low=-1.0, high=1.0) * 2.0**e for e in range(-30, 13, 3)]
    x = torch.cat([_near_multiples_of_half_pi(limit), torch.tensor([limit, -limit, 0.0, -0.0, 1e-40]), *scales])
    x = x[x.abs() <= limit].reshape(1, -1)
    region, (got,) = _bounded_region(fn, x, limit)
    assert (got.double() - fn(x.double())).abs().max() < 2e-7
    assert torch.equal(got[x == 0].signbit(), fn(x[x == 0]).signbit())  # sin(-0.0) = -0.0
    assert _activation_count(region) * 8 < _activation_count(_bounded_region(fn, x[:, :8], INF)[0])


def _hardest_below(limit: float, count: int) -> torch.Tensor:
    """The ``count`` fp32 values of (0, limit] nearest a multiple of pi/2 (ranked in float64, whose error at these
    magnitudes is ~1e-10), with their negatives."""
    near = _near_multiples_of_half_pi(limit)
    near = near[(near > 0) & (near <= limit)]
    distance = (near.double() - torch.round(near.double() / (math.pi / 2)) * (math.pi / 2)).abs()
    hardest = near[distance.argsort()[:count]]
    return torch.cat([hardest, -hardest])


@pytest.mark.parametrize("fn", [torch.sin, torch.cos])
def test_summed_tail_form_up_to_the_positions_limit_is_accurate_and_cheap(fn):
    # A decode step's rotary angles: positions up to the integer guard's 2**20 times frequencies up to 1. The 1500
    # fp32 nearest a multiple of pi/2 up to the limit, rotary-like products, random values over every scale: within
    # 2e-7 absolute of float64 (as the full reduction), from a tenth of its instructions.
    limit = trigonometry.POSITION_LIMIT
    positions = torch.randint(0, int(limit), (2048,), generator=torch.Generator().manual_seed(7)).float()
    frequencies = torch.tensor([1.0, 0.1, 0.01, 1e-4]).repeat(512)
    scales = [random_tensor((512,), seed=e + 400, low=-1.0, high=1.0) * 2.0**e for e in range(-30, 21, 3)]
    x = torch.cat([_hardest_below(limit, 1500), positions * frequencies, *scales,
                   torch.tensor([limit, -limit, 4096.0, -4096.0, 4095.9995, 0.0, -0.0, 1e-40])])
    x = x[x.abs() <= limit].reshape(1, -1)
    region, (got,) = _bounded_region(fn, x, limit)
    assert (got.double() - fn(x.double())).abs().max() < 2e-7
    assert torch.equal(got[x == 0].signbit(), fn(x[x == 0]).signbit())  # sin(-0.0) = -0.0
    assert _activation_count(region) * 10 < _activation_count(_bounded_region(fn, x[:, :8], INF)[0])


def test_sin_within_pi_goes_to_the_activation_directly():
    x = torch.cat([torch.linspace(-3.0, 3.0, 1001), torch.tensor([0.0, -0.0, 1e-30])]).reshape(1, -1)
    region, (got,) = _bounded_region(torch.sin, x, 3.0)
    torch.testing.assert_close(got, torch.sin(x), rtol=1e-6, atol=1e-7)
    assert "nl.sin" in region.kernels[0].source and _activation_count(region) < 8


@pytest.mark.parametrize("bound", [math.pi, 1.0, 100.0, trigonometry.CODY_WAITE_LIMIT, trigonometry.POSITION_LIMIT])
def test_bounded_forms_are_chosen_by_the_bound_only_within_their_limits(bound):
    aten = torch.ops.aten
    assert trigonometry.bounded_form(aten.cos.default, bound) is not None
    assert trigonometry.bounded_form(aten.tan.default, bound) is None  # its poles need the full form
    for target in (aten.sin.default, aten.cos.default):
        assert trigonometry.bounded_form(target, trigonometry.POSITION_LIMIT * 1.001) is None
    # past CODY_WAITE_LIMIT, the summed tail (cos keeps the piece-by-piece form below it)
    x = ir.Load("x", ir.Layout((1,), (1,)), "float32")
    past = trigonometry.CODY_WAITE_LIMIT * 1.001
    assert trigonometry.bounded_form(aten.sin.default, past)(x) == trigonometry.summed_tail_sine(x, False)
    assert trigonometry.bounded_form(aten.cos.default, past) is trigonometry.cosine_up_to_positions
    # the bare activation only where the bound, with its rounding slack, stays inside [-pi, pi]
    direct = trigonometry.bounded_form(aten.sin.default, 3.0)
    chosen = trigonometry.bounded_form(aten.sin.default, bound)
    assert chosen is not None and (chosen is direct) == (bound < math.pi)


@settings(max_examples=6, deadline=None)
@given(exponent=st.integers(-4, 12), values=st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=64),
       cosine=st.booleans())
def test_any_values_within_the_bound_match_float64(exponent, values, cosine):
    fn = torch.cos if cosine else torch.sin
    bound = 2.0**exponent
    x = (torch.tensor(values, dtype=torch.float32) * bound).reshape(1, -1)
    _, (got,) = _bounded_region(fn, x, bound)
    assert (got.double() - fn(x.double())).abs().max() < 2e-7


def test_pi_pieces_give_exact_products_and_the_error_bound_holds():
    mpmath.mp.prec = 300
    most = trigonometry.multiplier_max(trigonometry.CODY_WAITE_LIMIT)
    q = torch.arange(0, 2 * math.ceil(most) + 1, dtype=torch.float64) / 2
    for shift in (False, True):
        pieces = trigonometry.pi_pieces(trigonometry.CODY_WAITE_LIMIT, shift)
        for piece in pieces[:-1]:  # every multiple of 1/2 up to `most` times the piece is an exact fp32
            assert torch.equal((q * piece).float().double(), q * piece)
        assert all(piece > 0 for piece in pieces) or shift  # sin's: x - 0 * C keeps -0.0
        assert abs(sum(mpmath.mpf(piece) for piece in pieces) - mpmath.pi) * most < 2.0**-30
        assert trigonometry.reduction_error(trigonometry.CODY_WAITE_LIMIT, shift) <= trigonometry.REDUCTION_ERROR_MAX
    assert trigonometry.reduction_error(2.0**20, True) > trigonometry.REDUCTION_ERROR_MAX  # why the limit is there


def test_summed_tail_pieces_give_exact_products_and_the_error_bound_holds():
    mpmath.mp.prec = 300
    limit = trigonometry.POSITION_LIMIT
    most = trigonometry.multiplier_max(limit)
    q = torch.arange(0, 2 * math.ceil(most) + 1, dtype=torch.float64) / 2
    for shift in (False, True):
        pieces = trigonometry.pi_pieces(limit, shift)
        for piece in pieces[:-1]:
            assert torch.equal((q * piece).float().double(), q * piece)
        assert abs(sum(mpmath.mpf(piece) for piece in pieces) - mpmath.pi) * most < 2.0**-30
        lowest = trigonometry.SUMMED_TAIL_LOWEST[shift]
        split = trigonometry.TAIL_SPLITS[shift]
        assert split == trigonometry.best_tail_split(shift)
        assert trigonometry.summed_tail_error(limit, shift, split, lowest) <= trigonometry.REDUCTION_ERROR_MAX
        # piece by piece (no summed tail) the bound would not hold: what the tail is for
        assert trigonometry.summed_tail_error(limit, shift, len(pieces) - 1, lowest) > trigonometry.REDUCTION_ERROR_MAX
    # cos from CODY_WAITE_LIMIT on only: below it, q = +-1/2 and the steps round on x's fine grid
    assert trigonometry.summed_tail_error(limit, True, trigonometry.TAIL_SPLITS[True], 2.0**-149) > 2.0**-23
