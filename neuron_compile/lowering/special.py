"""Lowering stage, special functions: lgamma, digamma (polygamma n = 0), erfinv, ndtri, erfcx, the modified Bessel
functions i0 / i0e / i1 / i1e, the spherical Bessel j0 and xlog1py.

Input: an ATen FX node. Output: one ``ir.Pointwise`` (through ``emit_pointwise``) whose instructions are fp32 ALU
arithmetic, exact selects and activations fed only their valid input ranges (nki-spec §1.5): every ``log`` goes
through ``safe_log``, every division's reciprocal sees [2**-42, 2**42] (``reciprocal`` rescales by an exact power
of two), ``sqrt`` / ``rsqrt`` see [1, 2**64], ``sin`` sees [-pi/2, pi/2].

The approximations are written from the math: argument shifting by the recurrences Gamma(x + 1) = x Gamma(x),
psi(x + 1) = psi(x) + 1 / x into [1.5, 2.5], where a polynomial in p = x - 2 (least-squares fits in float64 of
lgamma(2 + p) / p and psi(2 + p), relative error 3e-10 and 7e-10) takes over; Stirling's and the digamma
asymptotic series from 8 on; the reflection formulas below -1/2. erfinv(y) / y is a polynomial in w = -log(1 - y**2)
(and in sqrt(w) in the tails, Giles' change of variable); erfcx(x) / t a polynomial in t = 2 / (2 + x); I0 and I1
their power series up to 8 and sqrt(x) e**-x I(x) a polynomial in 8 / x beyond. Each fit's coefficients were
computed here against float64 references (torch float64 and mpmath); the measured errors are in the tests.

"""

from __future__ import annotations

import math

import numpy as np
import torch

from neuron_compile import ir
from neuron_compile.lowering.math_expressions import (
    INF,
    absolute,
    add,
    both,
    copysign,
    div,
    either,
    eq,
    floor,
    ge,
    gt,
    le,
    lt,
    maximum,
    minimum,
    mul,
    ne,
    round_half_even,
    sub,
    where,
)
from neuron_compile.lowering.pointwise import emit_pointwise, load_input
from neuron_compile.lowering.pointwise_math import log1p
from neuron_compile.lowering.registry import INTEGER_OPS, TensorValue, load, register_lowering
from neuron_compile.lowering.trigonometry import sin
from neuron_compile.guarded_math import safe_log

aten = torch.ops.aten
NAN = math.nan


def keep_nan(x, value):
    """``value``, with nan wherever x is nan (selects on comparisons send nan down an arbitrary branch)."""
    return where(ne(x, x), x, value)


def polynomial(u, coefficients):
    """Horner's rule, lowest coefficient first."""
    acc = ir.Scalar(float(coefficients[-1]))
    for c in reversed(coefficients[:-1]):
        acc = add(mul(acc, u), c)
    return acc


def reciprocal(magnitude):
    """1 / a for every a >= 0 (0 -> inf, inf -> 0): a is rescaled by s = 2**(127 - E) (E its biased exponent, an
    exact power of two) into [1, 4) (subnormals into [2**-22, 1)), inside the reciprocal's range, and 1 / (a s) is
    scaled back by s (exact, or rounded once into a subnormal). nan stays nan."""
    s = ir.op("inverse_power_of_two", minimum(magnitude, 2.0**126))
    ordinary = both(gt(magnitude, 0.0), lt(magnitude, INF))
    value = mul(div(1.0, where(ordinary, mul(magnitude, s), 1.0)), s)
    return where(ordinary, value, where(eq(magnitude, 0.0), INF, where(eq(magnitude, INF), 0.0, magnitude)))


def sin_pi(r):
    """sin(pi r) for |r| <= 1/2 (nan lanes feed the activation 0)."""
    return ir.op("sin", where(eq(r, r), mul(r, math.pi), 0.0))


# ---------------------------------------------------------------- lgamma

# lgamma(2 + p) / p on [-1/2, 1/2] (degree 9, relative error 3e-10 in float64).
LGAMMA_2 = [0.422784335, 0.32246703447, -0.067352281586, 0.020580746225, -0.0073861718728, 0.002891561644,
            -0.0011858746895, 0.00050243170302, -0.00025378772167, 0.00012073366762]
HALF_LOG_TWO_PI = 0.5 * math.log(2.0 * math.pi)
# eager's lgammaf returns inf from this fp32 on (the true value, 3.3625e38, still fits): followed, as eager's.
EAGER_LGAMMA_OVERFLOW = 4.0371103e36
SHIFT_LIMIT = 8.0  # below, shift into [1.5, 2.5]; from 8 on, the asymptotic series (next term < 3e-10)
FACTOR_RANGE = range(2, 8)  # x in [m - 1/2, m + 1/2) with m <= 8 needs the factors (2 + p) ... (m - 1 + p)


def _shifted(z):
    """(zs, m, p): z clamped to SHIFT_LIMIT, its nearest integer m and p = zs - m in [-1/2, 1/2] (exact)."""
    zs = minimum(z, SHIFT_LIMIT)
    m = round_half_even(zs)
    return zs, m, sub(zs, m)


def lgamma_positive(z):
    """lgamma(z) for z > -1/2 (and nan, inf). For z < 8, with m = round(z) and p = z - m:
    lgamma(2 + p) = p * poly(p); m >= 3 adds log((2 + p) ... (m - 1 + p)), each factor z - k exact; m <= 1
    subtracts log|z|, m = 0 also log1p(z) (so p = z - 1 and p = z stay exact: no rounding of z + 1 near the zero
    at 1). For z >= 8, Stirling: (z - 1/2)(log z - 1) + log(2 pi) / 2 - 1/2 + 1/(12z) - 1/(360z^3) + 1/(1260z^5),
    written so that the product only overflows where lgamma does."""
    zs, m, p = _shifted(z)
    core = mul(p, polynomial(p, LGAMMA_2))
    product = None
    for j in FACTOR_RANGE:
        factor = where(lt(float(j), m), add(p, float(j)), 1.0)
        product = factor if product is None else mul(product, factor)
    shifted = add(core, ir.op("log", product))  # product in [1, 7!]
    shifted = sub(shifted, where(le(m, 1.0), safe_log(absolute(zs)), 0.0))
    shifted = sub(shifted, where(lt(m, 0.5), log1p(minimum(maximum(zs, -0.5), 0.5)), 0.0))
    zl = maximum(z, SHIFT_LIMIT)
    w = div(1.0, minimum(zl, 2.0**40))
    w2 = mul(w, w)
    series = mul(w, polynomial(w2, [1 / 12, -1 / 360, 1 / 1260]))
    stirling = add(add(mul(sub(zl, 0.5), sub(safe_log(zl), 1.0)), HALF_LOG_TWO_PI - 0.5), series)
    stirling = where(ge(zl, EAGER_LGAMMA_OVERFLOW), INF, stirling)
    return where(lt(z, SHIFT_LIMIT), shifted, stirling)


def _reflection(x):
    """(reflect, z, r): reflect where x < -1/2, z = 1 - x there (else x), r = x - round(x) (0 at the poles, the
    negative integers; every fp32 from 2**23 on is one)."""
    reflect = lt(x, -0.5)
    return reflect, where(reflect, sub(1.0, x), x), sub(x, round_half_even(x))


def lgamma(x):
    # x < -1/2: lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x), sin(pi x) = +-sin(pi r) with r exact. Poles
    # (non-positive integers, -inf) are +inf as in eager.
    reflect, z, r = _reflection(x)
    value = lgamma_positive(z)
    reflected = sub(sub(math.log(math.pi), safe_log(absolute(sin_pi(r)))), value)
    pole = both(reflect, either(eq(r, 0.0), eq(x, -INF)))
    return where(pole, INF, where(reflect, reflected, value))


# ---------------------------------------------------------------- digamma

# psi(2 + p) on [-1/2, 1/2] (degree 10, relative error 7e-10 in float64).
DIGAMMA_2 = [0.42278433532, 0.64493406919, -0.20205694834, 0.082323028065, -0.036926247834, 0.017347938604,
             -0.0083674127559, 0.0040313920769, -0.0019137854388, 0.0011784742762, -0.00070046932169]


def digamma_positive(z):
    """psi(z) for z >= -1/2: psi(2 + p) by the polynomial, plus 1 / (2 + p) + ... + 1 / (m - 1 + p) for m >= 3,
    minus 1 / z for m <= 1 (any magnitude: 1 / +-0 = +-inf as eager's copysign(inf, -x)) and 1 / (1 + z) for
    m = 0; from 8 on log z - 1/(2z) - 1/(12z^2) + 1/(120z^4) - 1/(252z^6) + 1/(240z^8)."""
    zs, m, p = _shifted(z)
    value = polynomial(p, DIGAMMA_2)
    for j in FACTOR_RANGE:
        use = lt(float(j), m)
        value = add(value, where(use, div(1.0, where(use, add(p, float(j)), 1.0)), 0.0))
    inverse = copysign(reciprocal(absolute(zs)), zs)
    value = sub(value, where(le(m, 1.0), inverse, 0.0))
    next_one = add(minimum(maximum(zs, -0.5), 0.5), 1.0)  # in [0.5, 1.5]
    value = sub(value, where(lt(m, 0.5), div(1.0, next_one), 0.0))
    zl = maximum(z, SHIFT_LIMIT)
    w = div(1.0, minimum(zl, 2.0**40))
    w2 = mul(w, w)
    asymptotic = sub(sub(safe_log(zl), mul(w, 0.5)), mul(w2, polynomial(w2, [1 / 12, -1 / 120, 1 / 252, -1 / 240])))
    return where(lt(z, SHIFT_LIMIT), value, asymptotic)


def digamma(x):
    # x < -1/2: psi(x) = psi(1 - x) - pi cos(pi r) / sin(pi r), cos(pi r) = sin(pi (1/2 - |r|)); |sin(pi r)| >=
    # sin(pi 2**-24) for non-integers there. Poles (negative integers, -inf) are nan as in eager.
    reflect, z, r = _reflection(x)
    value = digamma_positive(z)
    sine = sin_pi(r)
    cosine = sin_pi(sub(0.5, absolute(r)))
    pole = both(reflect, either(eq(r, 0.0), eq(x, -INF)))
    cotangent = div(cosine, where(both(reflect, ne(sine, 0.0)), sine, 1.0))  # other lanes: r may be tiny
    reflected = sub(value, mul(cotangent, math.pi))
    return where(pole, NAN, where(reflect, reflected, value))


# ---------------------------------------------------------------- erfinv and ndtri

# erfinv(y) / y as a polynomial in w - 2.5 for w = -log(1 - y**2) < 5, in sqrt(w) - (sqrt(5) + 4) / 2 for w < 16, in
# sqrt(w) - 7.15 up to w = 106 (ndtri's smallest p, 2**-149); fits with relative errors 7e-9, 6e-8, 4e-9.
ERFINV_CENTRAL = [1.501409359581826, 0.24664027848073924, -0.004177388473869905, -0.001252725226896731,
                  0.0002183458867710394, -4.97306967305218e-06, -3.463093070935064e-06, 4.6826697362029046e-07,
                  2.3264800252942308e-08, -8.941414053609265e-09]
ERFINV_TAIL = [2.951328510148663, 1.0036180890936193, 0.007163040683953773, -0.005379487886579609,
               0.0038569186232052595, -0.0027070943617115767, 0.00135392537223167, -8.778466354259496e-05,
               -0.00019965589929771935]
ERFINV_FAR_TAIL = [7.0202974720639375, 1.008442281024199, -0.0005089912412053092, 9.663901242031516e-06,
                   4.874869440036724e-06, -1.4096614028830437e-06, 2.8481631303859807e-07, -3.394768566614469e-08,
                   3.763324893083719e-09, -1.9960075392752047e-09, 3.610237344484442e-10]


def erfinv_magnitude(a, q):
    """erfinv(a) for a = |y| in [0, 1), given q = 1 - a as an exactly known value (1 - y**2 = q (2 - q) keeps its
    relative accuracy as a -> 1; for ndtri q = 2p is exact down to the smallest subnormal p)."""
    positive_q = gt(q, 0.0)
    w = ir.op("neg", safe_log(where(positive_q, mul(q, sub(2.0, q)), 1.0)))
    root = ir.op("sqrt", minimum(maximum(w, 5.0), 128.0))
    central = polynomial(sub(w, 2.5), ERFINV_CENTRAL)
    tail = polynomial(sub(root, (math.sqrt(5.0) + 4.0) / 2), ERFINV_TAIL)
    far = polynomial(sub(root, 7.15), ERFINV_FAR_TAIL)
    return mul(a, where(lt(w, 5.0), central, where(lt(w, 16.0), tail, far)))


def erfinv(y):
    # |y| = 1 -> +-inf, |y| > 1 -> nan; the sign of y (and of +-0) is put back.
    a = absolute(y)
    value = erfinv_magnitude(a, sub(1.0, a))
    value = where(lt(a, 1.0), value, where(eq(a, 1.0), INF, NAN))
    return keep_nan(y, copysign(value, y))


def ndtri(p):
    # ndtri(p) = sqrt(2) erfinv(2p - 1), with 1 - |2p - 1| = 2 min(p, 1 - p) (exact: 1 - p is exact for p >= 1/2).
    # p = 0 -> -inf, p = 1 -> inf, outside [0, 1] -> nan.
    half = lt(p, 0.5)
    q = mul(where(half, p, sub(1.0, p)), 2.0)
    value = mul(erfinv_magnitude(sub(1.0, q), q), math.sqrt(2.0))
    inside = both(gt(p, 0.0), lt(p, 1.0))
    value = where(inside, where(half, ir.op("neg", value), value), where(eq(p, 0.0), -INF, where(eq(p, 1.0), INF, NAN)))
    return keep_nan(p, value)


# ---------------------------------------------------------------- erfcx

# erfcx(x) / t as a polynomial in t = 2 / (2 + x), x >= 0 (degree 12, relative error 1.3e-9).
ERFCX = [0.28209479193, 0.28209474268, 0.24683526398, 0.17627294268, 0.083917960873, -0.0032919190866,
         -0.074749609129, 0.047522987286, -0.31819302491, 0.6297682105, -0.53945932441, 0.22522182736,
         -0.038034851008]


def erfcx_magnitude(a):
    """erfcx(a) for a >= 0 (inf -> 0): t R(t)."""
    t = mul(reciprocal(add(a, 2.0)), 2.0)
    return mul(t, polynomial(t, ERFCX))


def erfcx(x):
    # x < 0: erfcx(x) = 2 exp(x**2) - erfcx(-x), with x * x rounded as eager rounds it (inf beyond 9.4).
    value = erfcx_magnitude(absolute(x))
    negative = sub(mul(ir.op("exp", mul(x, x)), 2.0), value)
    return keep_nan(x, where(lt(x, 0.0), negative, value))


# ---------------------------------------------------------------- modified Bessel functions

BESSEL_SERIES_LIMIT = 8.0
I0_SERIES = [1.0 / math.factorial(k) ** 2 for k in range(14)]  # I0(x) = sum (x^2/4)^k / k!^2
I1_SERIES = [1.0 / (math.factorial(k) * math.factorial(k + 1)) for k in range(14)]  # I1(x) = x/2 sum (x^2/4)^k / ...
# sqrt(x) e**-x I0(x) and sqrt(x) e**-x I1(x) as polynomials in u = 8 / x for x >= 8 (relative error 1.2e-10).
I0_LARGE = [0.3989422804, 0.006233476087, 0.0004382217148, 5.767294133e-05, 8.433866184e-06, 8.026423798e-06,
            -4.621565691e-06, 2.454271717e-06, 3.982797856e-07]
I1_LARGE = [0.3989422804, -0.01870042253, -0.0007304123409, -8.052380174e-05, -1.149203267e-05, -8.674601299e-06,
            4.306464438e-06, -2.200333903e-06, -5.946872493e-07]


def _inverse_sqrt(a):
    """1 / sqrt(a) for a >= 8 (inf -> 0), rsqrt fed [8, 2**64]: beyond 2**64, a * 2**-64 and a factor 2**-32."""
    big = gt(a, 2.0**64)
    scaled = where(big, mul(a, 2.0**-64), a)
    value = mul(ir.op("rsqrt", where(lt(a, INF), scaled, 1.0)), where(big, 2.0**-32, 1.0))
    return where(lt(a, INF), value, 0.0)


def bessel(x, order: int, scaled: bool):
    """I0 / I1 (``order``), times e**-|x| if ``scaled``. Up to 8 the power series (positive terms, no
    cancellation); beyond, e**|x| G(8 / |x|) / sqrt(|x|) in eager's order (so exp overflows to inf, and inf gives
    nan, where eager's does). I1 is odd: negated for x < 0 (not copysign: eager's i1(-0.0) is +0.0)."""
    a = absolute(x)
    small = minimum(a, BESSEL_SERIES_LIMIT)
    quarter_square = mul(mul(small, small), 0.25)
    series = polynomial(quarter_square, I0_SERIES if order == 0 else I1_SERIES)
    if order == 1:
        series = mul(series, mul(small, 0.5))
    large = maximum(a, BESSEL_SERIES_LIMIT)
    u = mul(reciprocal(large), 8.0)
    tail = polynomial(u, I0_LARGE if order == 0 else I1_LARGE)
    if scaled:
        near = mul(series, ir.op("exp", ir.op("neg", small)))
        far = mul(tail, _inverse_sqrt(large))
    else:
        near = series
        far = where(lt(a, INF), mul(mul(ir.op("exp", large), tail), _inverse_sqrt(large)), NAN)
    value = where(le(a, BESSEL_SERIES_LIMIT), near, far)
    if order == 1:
        value = where(lt(x, 0.0), ir.op("neg", value), value)
    return keep_nan(x, value)


# ---------------------------------------------------------------- spherical Bessel j0, xlog1py


def spherical_bessel_j0(x):
    # eager: |x| < 1/2 the series 1 - x^2/6 (1 - x^2/20 (1 - x^2/42 (...))), else sin(x) / x; +-inf -> 0.
    square = mul(x, x)
    series = add(mul(mul(square, -1 / 6), polynomial(square, [1.0, -1 / 20, 1 / 840, -1 / 60480, 1 / 4354560,
                                                              -1 / 479001600])), 1.0)
    a = absolute(x)
    quotient = mul(sin(x), copysign(reciprocal(a), x))
    value = where(lt(a, 0.5), series, where(eq(a, INF), 0.0, quotient))
    return keep_nan(x, value)


def frexp(x):
    """(mantissa, exponent) with x = mantissa * 2**exponent, |mantissa| in [0.5, 1): |x| is brought into the normal
    range below 2**126 by an exact 2**+-64, then s = 2**(127 - E) (E the biased exponent) scales it into [1, 2);
    log(s) / ln 2 is an integer to far below 1/2, so rounding it is exact. 0, inf and nan keep x with exponent 0."""
    a = absolute(x)
    tiny, big = lt(a, 2.0**-100), ge(a, 2.0**126)
    scaled = mul(a, where(tiny, 2.0**64, where(big, 2.0**-64, 1.0)))
    shift = where(tiny, -64.0, where(big, 64.0, 0.0))
    s = ir.op("inverse_power_of_two", scaled)
    ordinary = both(gt(a, 0.0), lt(a, INF))
    mantissa = where(ordinary, copysign(mul(mul(scaled, s), 0.5), x), x)
    log2_s = round_half_even(mul(safe_log(s), 1.0 / math.log(2.0)))
    exponent = where(ordinary, add(sub(1.0, log2_s), shift), 0.0)
    return mantissa, exponent


@register_lowering(aten.frexp.Tensor, multi_output=True)
def lower_frexp(ctx, node):
    x = _x_of(ctx, node)
    results = []
    for meta, expr in zip(node.meta["val"], frexp(x)):
        buffer = ctx.new_buffer(meta, "frexp")
        if buffer.dtype != "float32":  # bf16 mantissa (exact: the bits of x), int32 exponent (an exact integer)
            expr = ir.Op("cast", (expr,), dtype=buffer.dtype)
        ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), buffer.layout.shape, (ir.Store(buffer, expr, buffer.layout),)))
        results.append(TensorValue(buffer.name, buffer.layout, buffer.dtype))
    return tuple(results)


def _x_of(ctx, node):
    return load(ctx, node.args[0], tuple(node.meta["val"][0].shape))


INTEGER_OPS.add(aten.frexp.Tensor)  # its int32 exponent is an exact small integer computed in fp32


FORMS = {
    aten.lgamma.default: lgamma,
    aten.digamma.default: digamma,
    aten.erfinv.default: erfinv,
    aten.special_ndtri.default: ndtri,
    aten.special_erfcx.default: erfcx,
    aten.i0.default: lambda x: bessel(x, 0, scaled=False),
    aten.special_i0e.default: lambda x: bessel(x, 0, scaled=True),
    aten.special_i1.default: lambda x: bessel(x, 1, scaled=False),
    aten.special_i1e.default: lambda x: bessel(x, 1, scaled=True),
    aten.special_spherical_bessel_j0.default: spherical_bessel_j0,
}


@register_lowering(*FORMS)
def lower_special(ctx, node):
    return emit_pointwise(ctx, node, FORMS[node.target](load_input(ctx, node)))


# ---------------------------------------------------------------- polygamma

POLYGAMMA_MAX_ORDER = 4  # the asymptotic series at z >= 8 keeps 2e-8 for n <= 4; beyond, it needs a larger shift
BERNOULLI_OVER_FACTORIAL = [1 / 12, -1 / 720, 1 / 30240, -1 / 1209600]  # B_2j / (2j)!, j = 1..4


def _power(value, exponent: int):
    result = value
    for _ in range(exponent - 1):
        result = mul(result, value)
    return result


def hurwitz_zeta(s: int, q):
    """zeta(s, q) = sum_k (q + k)**-s for q > 0 (tiny, huge, inf) and an integer s >= 3: eight terms, then the
    Euler-Maclaurin series at z = q + 8: z**(1-s) / (s-1) + z**-s / 2 + sum_j B_2j / (2j)! s (s+1) ... (s+2j-2)
    z**(-s-2j+1)."""
    total = None
    for k in range(8):
        term = _power(reciprocal(add(q, float(k))), s)
        total = term if total is None else add(total, term)
    w = reciprocal(add(q, 8.0))
    w2 = mul(w, w)
    rising = []
    factor = float(s)
    for j, coefficient in enumerate(BERNOULLI_OVER_FACTORIAL):
        rising.append(coefficient * factor)
        factor *= (s + 2 * j + 1) * (s + 2 * j + 2)
    # z**(1-s) (1 / (s-1) + w / 2 + sum_j c_j w**2j), w = 1 / z
    tail = add(add(mul(w, 0.5), 1.0 / (s - 1)), mul(w2, polynomial(w2, rising)))
    return add(total, mul(tail, _power(w, s - 1)))


def _pair_next_to_zero(s: int, c, d):
    """(-1)**s c**-s + d**-s for c, d = 1 - c in (0, 1] (the terms of sum_k (x + k)**-s on either side of 0). For
    odd s they nearly cancel around c = 1/2: there (c**s - d**s) / (c d)**s with c**s - d**s = (c - d) sum_i
    d**i c**(s-1-i) and c - d = 2c - 1 exact (d itself may be rounded once), no cancellation."""
    inverse_c, inverse_d = reciprocal(c), reciprocal(d)
    direct = add(mul(_power(inverse_c, s), (-1.0) ** s), _power(inverse_d, s))
    if s % 2 == 0:
        return direct
    powers_c, powers_d = [1.0], [1.0]
    for _ in range(s - 1):
        powers_c.append(mul(powers_c[-1], c) if powers_c[-1] != 1.0 else c)
        powers_d.append(mul(powers_d[-1], d) if powers_d[-1] != 1.0 else d)
    terms = [mul(powers_d[i], powers_c[s - 1 - i]) if i and s - 1 - i else powers_d[i] if i else powers_c[s - 1]
             for i in range(s)]
    total = terms[0]
    for term in terms[1:]:
        total = add(total, term)
    factored = mul(mul(sub(mul(c, 2.0), 1.0), total), _power(mul(inverse_c, inverse_d), s))
    middle = lt(absolute(sub(c, 0.5)), 0.25)
    return where(middle, factored, direct)


def polygamma_of_order(order: int, x):
    """psi^(n)(x) for 2 <= n <= 4: (-1)**(n+1) n! zeta(n + 1, x) for x > 0. For negative non-integer x, with
    c = -(x + floor(-x)) (exact) and d = 1 - c, sum_k (x + k)**-s is regrouped: the negative terms
    (-1)**s (zeta(s, c) - zeta(s, 1 - x)), the positive ones zeta(s, d); the two next to zero are summed first
    (``_pair_next_to_zero``). Poles (0, negative integers, -inf) are (-1)**(n+1) inf, +inf is nan, as eager's."""
    s = order + 1
    scale = (-1.0) ** (order + 1) * math.factorial(order)
    negative = lt(x, 0.0)
    whole = floor(ir.op("neg", x))
    c = ir.op("neg", add(x, whole))
    d = add(add(x, whole), 1.0)
    inside = both(negative, both(gt(c, 0.0), lt(c, 1.0)))  # false at the poles, -inf and nan
    c, d = where(inside, c, 0.5), where(inside, d, 0.5)
    value = hurwitz_zeta(s, where(negative, add(c, 1.0), where(gt(x, 0.0), x, 1.0)))
    rest = add(mul(value, (-1.0) ** s), hurwitz_zeta(s, add(d, 1.0)))
    rest = sub(rest, mul(hurwitz_zeta(s, maximum(sub(1.0, x), 1.0)), (-1.0) ** s))
    reflected = add(_pair_next_to_zero(s, c, d), rest)
    value = mul(where(negative, reflected, value), scale)
    pole = either(eq(x, 0.0), both(negative, ir.op("neg", sub(inside, 1.0))))
    value = where(pole, math.copysign(INF, scale), where(eq(x, INF), NAN, value))
    return keep_nan(x, value)


PI_F32 = float(np.float32(math.pi))


def trigamma(x):
    """psi^(1)(x) by eager's own float formula (ATen's trigamma): for x < 1/2, pi**2 / sin(fl(pi x))**2 -
    psi1(1 - x), then six terms 1 / x**2 and the asymptotic series. sin is exact on the rounded product (as
    sinf), so this agrees with eager also where eager's rounded pi x is far from the truth (large negative x:
    eager's trigamma(-1000.3) is off by ~100% against float64, and trigamma(-1) is finite there)."""
    reflect = lt(x, 0.5)
    sine = sin(mul(x, PI_F32))
    result = where(reflect, ir.op("neg", mul(reciprocal(mul(sine, sine)), float(np.float32(PI_F32 * PI_F32)))), 0.0)
    z = where(reflect, sub(1.0, x), x)
    for _ in range(6):
        result = add(result, reciprocal(mul(z, z)))
        z = add(z, 1.0)
    inverse = reciprocal(z)
    ixx = mul(inverse, inverse)
    series = add(add(mul(inverse, 0.5), 1.0), mul(ixx, polynomial(ixx, [1 / 6, -1 / 30, 1 / 42])))
    result = add(result, mul(series, inverse))
    return keep_nan(x, where(reflect, ir.op("neg", result), result))


def _check_polygamma(node: torch.fx.Node) -> str | None:
    order = node.args[0]
    if not isinstance(order, int) or order > POLYGAMMA_MAX_ORDER:
        return (f"aten.polygamma: n={order} (n <= {POLYGAMMA_MAX_ORDER} are lowered: the asymptotic series at 8 "
                "loses fp32 accuracy for higher orders)")
    return None


@register_lowering(aten.polygamma.default, check=_check_polygamma)
def lower_polygamma(ctx, node):
    order = node.args[0]
    x = load(ctx, node.args[1], tuple(node.meta["val"].shape))
    form = digamma if order == 0 else trigamma if order == 1 else lambda t: polygamma_of_order(order, t)
    return emit_pointwise(ctx, node, form(x))
