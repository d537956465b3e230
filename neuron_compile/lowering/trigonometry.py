"""Lowering stage, trigonometry family: sin, cos and tan with an exact argument reduction.

Input: an ATen FX node. Output: one ``ir.Pointwise`` (through ``emit_pointwise``) in which the Scalar engine's
``sin`` activation only ever sees |angle| <= pi/2 + 2e-4 for sin and cos, 3 pi/4 + 2e-4 for tan (its valid range
is [-pi, pi], nki-spec §1.5: outside it the hardware returns garbage, sin(9.0) ~ 27.65; non-finite lanes feed it
0). Every other instruction is exact fp32 ALU arithmetic, and the reciprocal of tan's division sees [2**-40, 1].

The reduction is Payne-Hanek in fp32 without FMA. With a = |x|, T = a * 2/pi is the argument in quarter turns;
only T mod 4 matters. 2/pi is split into 15 pieces c_j of 12 bits each (180 bits: the neglected tail times a is
below 2**-52), a into a_hi + a_lo (a Veltkamp split: 12 and 11 bits). Each product a_hi * c_j, a_lo * c_j has at
most 24 significant bits, so fp32 computes it exactly; to keep the pieces normal numbers, a is scaled by 2**-64
and the pieces by 2**64 (the products are unchanged). Then, per product p:

* p mod 8, exactly: r = p - 8 * round(p / 8) with the rounding done by the 1.5 * 2**23 trick (exact for
  |p| < 2**25); from 2**25 on, p is a multiple of 4 (its ulp is >= 4) and contributes nothing mod 4 (r = 0).
* r (in [-4, 4]) split on fixed grids, all exact: coarse = r rounded to a multiple of 2**-17 (the 96 trick),
  middle = the rest rounded to a multiple of 2**-37, small = what is left (|small| <= 2**-38).

The 29 coarse parts sum exactly (multiples of 2**-17, |sum| <= 29 * 4 < 2**24 * 2**-17), so do the middle ones
(multiples of 2**-37, |sum| <= 29 * 2**-18 < 2**24 * 2**-37); the small ones sum with errors below 2**-57.
Taking an exact integer n off coarse (n = round(coarse) for tan, 2 * round(coarse / 2) for sin and cos) leaves
w = ((coarse - n) + middle) + small, where the first sum is exact whenever it is below 2**-13: w keeps ~2**-23
relative accuracy even at the closest an fp32 comes to a multiple of pi/2 (2**-30 of a quarter turn, x =
16367173 * 2**72). tan needs that near its poles (tan ~ -1 / r there); sin and cos get it near their zeros.
sin(x) = (-1)**(n/2) * sin(w * pi/2) with |w| <= 1 + 2**-13; cos is sin one quarter turn on; tan(x) =
sin(w pi/2) / sin((w + 1) pi/2), or minus its inverse for odd n (|w| <= 1/2 + 2**-13).

Measured against float64 over |x| from 2**-20 to 3.4e38 and the worst cases: sin and cos within 1.2e-7
absolute, tan within 5e-7 relative.

The expressions are large DAGs (every product feeds three sums); ``ir.Op`` hashes each node once and prints
each shared subexpression once, which keeps compiling them fast and their dumps short.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.lowering.math_expressions import INF, absolute, add, lt, mul, sub, where
from neuron_compile.lowering.pointwise import emit_pointwise, load_input
from neuron_compile.lowering.registry import register_lowering

aten = torch.ops.aten

TWO_OVER_PI_BITS = 0xA2F9836E4E441529FC2757D1F534DDC0DB6295993C439041  # floor(2/pi * 2**192)
PIECE_BITS = 12
PIECES = 15
SCALE_EXPONENT = 64  # a * 2**-64 (exact for the a that reach the reduction) times piece * 2**64
VELTKAMP = 2.0**PIECE_BITS + 1.0
ROUND_MAGIC = 1.5 * 2.0**23  # (y + M) - M rounds y to an integer, half to even, for |y| < 2**22
COARSE_MAGIC = 96.0  # (r + 96) - 96 rounds |r| <= 4 to a multiple of 2**-17 (the fp32 spacing in [64, 128))
MIDDLE_MAGIC = 1.5 * 2.0**-14  # rounds |r| <= 2**-15 to a multiple of 2**-37 (the spacing in [2**-14, 2**-13))
A_HI_MAX = 2.0**128  # |x| <= 3.4e38 < 2**128, so a_hi (rounded to 12 bits) <= 2**128
A_LO_MAX = 2.0**115  # |a_lo| <= half an ulp of a_hi's 12 bits: 2**(127 - 12)
TINY = 2.0**-12  # below, sin(x) and tan(x) round to x in fp32 (x**3 / 3 is under half an ulp)
SMALLEST_DIVISOR = 2.0**-40  # tan's divisor is at least sin(2**-30 * pi/2) for finite x; the reciprocal's range
# starts at 2**-42




def round_magic(value, magic: float):
    """(value + magic) - magic: value rounded to the fp32 spacing at ``magic`` (exact while the sum stays in
    magic's binade)."""
    return sub(add(value, magic), magic)


def two_over_pi_piece(j: int) -> float:
    """Bits 12j + 1 .. 12j + 12 after the binary point of 2/pi, times 2**64 (an exact fp32: 12 bits, normal)."""
    shift = 192 - PIECE_BITS * (j + 1)
    chunk = (TWO_OVER_PI_BITS >> shift) & ((1 << PIECE_BITS) - 1)
    return math.ldexp(chunk, SCALE_EXPONENT - PIECE_BITS * (j + 1))


def _residue(product, bound: float):
    """product mod 4 as an exact r in [-4, 4] (a representative mod 8 below 2**25, 0 from there on, where every
    fp32 is a multiple of 4); ``bound`` is the largest |product| possible."""
    if bound < 4.0:
        return product
    r = sub(product, mul(round_magic(mul(product, 0.125), ROUND_MAGIC), 8.0))
    if bound >= 2.0**25:
        r = mul(r, lt(absolute(product), 2.0**25))  # 0 / 1 predicate; inf * 0 = nan only for non-finite x
    return r


def _sum(terms):
    """A balanced sum (the grid parts add exactly in any order)."""
    if len(terms) == 1:
        return terms[0]
    middle = len(terms) // 2
    return add(_sum(terms[:middle]), _sum(terms[middle:]))


def quarter_turns(magnitude):
    """(coarse, middle, small) with |x| * 2/pi = coarse + middle + small (mod 4): coarse an exact multiple of
    2**-17 below 128 in magnitude, middle an exact multiple of 2**-37 below 2**-13, |small| < 2**-33."""
    scaled = mul(magnitude, 2.0**-SCALE_EXPONENT)
    spread = mul(scaled, VELTKAMP)
    high = sub(spread, sub(spread, scaled))  # 12 significant bits
    low = sub(scaled, high)  # the other 11 (and a sign)
    coarse, middle, small = [], [], []
    for j in range(PIECES):
        piece = two_over_pi_piece(j)
        for part, part_max in ((high, A_HI_MAX), (low, A_LO_MAX)):
            bound = part_max * math.ldexp(piece, -SCALE_EXPONENT)
            if bound < 2.0**-52:
                continue  # a_lo * c_14
            rest = _residue(mul(part, piece), bound)
            if bound >= 2.0**-18:
                coarse.append(round_magic(rest, COARSE_MAGIC))
                rest = sub(rest, coarse[-1])
            if bound >= 2.0**-38:
                middle.append(round_magic(rest, MIDDLE_MAGIC))
                rest = sub(rest, middle[-1])
            small.append(rest)
    return _sum(coarse), _sum(middle), _sum(small)


def nearest_quarter_turn(coarse, middle, small):
    """(k, f): the quarter turns coarse + middle + small = k + f with k an integer and |f| <= 1/2 + 2**-13. k is
    exact; (coarse - k) + middle is exact whenever it is below 2**-13, so f keeps ~2**-23 relative accuracy."""
    k = round_magic(coarse, ROUND_MAGIC)  # |coarse| < 128: exact
    return k, add(add(sub(coarse, k), middle), small)


def _is_odd(integer):
    return ir.op("ne", integer, mul(round_magic(mul(integer, 0.5), ROUND_MAGIC), 2.0))


def sine_of_quarter_turns(magnitude, finite, quarter_shift: float = 0.0):
    """sin((|x| * 2/pi + quarter_shift) * pi/2) as (-1)**n * sin(w * pi/2), with n = round(T / 2) and w = T - 2n in
    [-1 - 2**-13, 1 + 2**-13]: the activation sees |angle| <= pi/2 + 2e-4 (0 where ``finite`` is false). Near
    the zeros (w near 0) w keeps its relative accuracy (nearest_quarter_turn's argument, on half turns)."""
    coarse, middle, small = quarter_turns(magnitude)
    if quarter_shift:
        coarse = add(coarse, quarter_shift)
    halves = round_magic(mul(coarse, 0.5), ROUND_MAGIC)
    within = add(add(sub(coarse, mul(halves, 2.0)), middle), small)
    angle = where(finite, mul(within, math.pi / 2), 0.0)
    return _signed(_sin(angle), _is_odd(halves))


def _sin(angle):
    return ir.op("sin", angle)


def _signed(value, negative):
    """value * (1 - 2 * negative): a negation where the 0/1 predicate is set (-0.0 kept)."""
    return mul(value, sub(1.0, mul(negative, 2.0)))


def _with_sign_of(value, x):
    return mul(value, ir.op("copysign", 1.0, x))


def sin(x):
    # sin is odd: sin(|x|) takes x's sign (a product by +-1 keeps -0.0), and x itself below 2**-12.
    magnitude = absolute(x)
    finite = lt(magnitude, INF)  # false for inf and nan
    value = _with_sign_of(sine_of_quarter_turns(magnitude, finite), x)
    return where(finite, where(lt(magnitude, TINY), x, value), math.nan)


def cos(x):
    magnitude = absolute(x)
    finite = lt(magnitude, INF)
    return where(finite, sine_of_quarter_turns(magnitude, finite, quarter_shift=1.0), math.nan)  # sin(a + pi/2)


def tan(x):
    # |x| = (k + f) * pi/2: tan = sin(f pi/2) / sin((f + 1) pi/2) for even k, -sin((f + 1) pi/2) / sin(f pi/2) for
    # odd k (period two quarter turns). The divisor is cos >= 0.7 or sin(f pi/2) with |f| >= 2**-30 for finite x
    # (the closest fp32 approach); it is still clamped into the reciprocal's range.
    magnitude = absolute(x)
    finite = lt(magnitude, INF)
    k, f = nearest_quarter_turn(*quarter_turns(magnitude))
    odd = _is_odd(k)
    numerator = _sin(where(finite, mul(add(f, odd), math.pi / 2), 0.0))
    divisor = _sin(where(finite, mul(add(f, sub(1.0, odd)), math.pi / 2), 0.0))
    bounded = ir.op("maximum", absolute(divisor), SMALLEST_DIVISOR)
    value = _signed(_with_sign_of(_with_sign_of(ir.op("div", numerator, bounded), divisor), x), odd)
    return where(finite, where(lt(magnitude, TINY), x, value), math.nan)


FORMS = {aten.sin.default: sin, aten.cos.default: cos, aten.tan.default: tan}


@register_lowering(*FORMS)
def lower_trigonometric(ctx, node):
    return emit_pointwise(ctx, node, FORMS[node.target](load_input(ctx, node)))
