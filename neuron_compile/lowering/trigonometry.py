"""Lowering stage, trigonometry family: sin and cos with an exact argument reduction (tan is declined).

Input: an ATen FX node. Output: one ``ir.Pointwise`` (through ``emit_pointwise``) in which the Scalar engine's
``sin`` activation only ever sees [-pi, pi] (its valid range, nki-spec §1.5: outside it the hardware returns
garbage, sin(9.0) ~ 27.65). Every other instruction is exact fp32 ALU arithmetic.

The reduction is Payne-Hanek in fp32 without FMA. With a = |x|, T = a * 2/pi is the argument in quarter turns
(sin(x) = sin(T * pi/2)); only T mod 4 matters. 2/pi is split into 15 pieces c_j of 12 bits each (180 bits, so
the neglected tail times a is below 2**-52), a into a_hi + a_lo (a Veltkamp split: 12 and 11 bits). Each
product a_hi * c_j, a_lo * c_j has at most 24 significant bits, so fp32 computes it exactly; to keep the pieces
normal numbers, a is scaled by 2**-64 and the pieces by 2**64 (the products are unchanged). Then, per product p:

* p mod 8, exactly: r = p - 8 * round(p / 8) with the rounding done by the 1.5 * 2**23 trick (exact for
  |p| < 2**25); from 2**25 on, p is a multiple of 4 (its ulp is >= 4) and contributes nothing mod 4 (r = 0).
* r (in [-4, 4]) split on a fixed grid: r1 = r rounded to a multiple of 2**-17 (the 96 trick), r2 = r - r1
  (|r2| <= 2**-18), both exact.

The r1 are summed exactly (multiples of 2**-17 with |sum| <= 29 * 4 < 128 = 2**24 * 2**-17); the r2 sum to at
most 2**-13, with rounding errors below 2**-36 each. The r1 sum is reduced mod 4 exactly, the small sum added
once: S in [-2, 2] (T mod 4 within ~2**-23) and the activation reads S * pi/2, clamped to the largest fp32
inside [-pi, pi]. Absolute error of the result: below 1e-6 for every finite x. Expressions are sums of
products rather than a running normalisation, so each partial result is used once: the expression tree (which
the passes hash and walk as a tree) stays a few thousand nodes.

tan is declined: near its poles tan(x) ~ -1 / r needs the reduced argument r with a relative error of 1e-5,
and the closest fp32 comes to an odd multiple of pi/2 is 2**-30 of a quarter turn (x = 16367173 * 2**72), so
r would be needed to ~2**-47 absolute; this reduction gives ~2**-23.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from neuron_compile.lowering.pointwise import emit_pointwise
from neuron_compile.lowering.pointwise_math import INF, _op, _x, absolute, add, copysign, lt, mul, sub, where
from neuron_compile.lowering.registry import register_lowering

aten = torch.ops.aten

TWO_OVER_PI_BITS = 0xA2F9836E4E441529FC2757D1F534DDC0DB6295993C439041  # floor(2/pi * 2**192)
PIECE_BITS = 12
PIECES = 15
SCALE_EXPONENT = 64  # a * 2**-64 (exact for the a that reach the reduction) times piece * 2**64
VELTKAMP = 2.0**PIECE_BITS + 1.0
ROUND_MAGIC = 1.5 * 2.0**23  # (y + M) - M rounds y to an integer, half to even, for |y| < 2**22
GRID_MAGIC = 96.0  # (r + 96) - 96 rounds |r| <= 4 to a multiple of 2**-17 (the fp32 spacing in [64, 128))
A_HI_MAX = 2.0**128  # |x| <= 3.4e38 < 2**128, so a_hi (rounded to 12 bits) <= 2**128
A_LO_MAX = 2.0**115  # |a_lo| <= half an ulp of a_hi's 12 bits: 2**(127 - 12)
PI_INSIDE = float(np.nextafter(np.float32(math.pi), np.float32(0.0)))  # fp32(pi) is above pi
TINY = 2.0**-12  # below, sin(x) rounds to x in fp32 (x**3 / 6 is under half an ulp)


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
    rounded = sub(add(mul(product, 0.125), ROUND_MAGIC), ROUND_MAGIC)
    r = sub(product, mul(rounded, 8.0))
    if bound >= 2.0**25:
        r = mul(r, lt(absolute(product), 2.0**25))  # 0 / 1 predicate; inf * 0 = nan only for non-finite x
    return r


def quarter_turns(magnitude):
    """(coarse, fine): T = |x| * 2/pi = coarse + fine (mod 4); coarse exact, a multiple of 2**-17 with
    |coarse| < 128; |fine| < 2**-13 within ~2**-31."""
    scaled = mul(magnitude, 2.0**-SCALE_EXPONENT)
    spread = mul(scaled, VELTKAMP)
    high = sub(spread, sub(spread, scaled))  # 12 significant bits
    low = sub(scaled, high)  # the other 11 (and a sign)
    coarse, fine = [], []
    for j in range(PIECES):
        piece = two_over_pi_piece(j)
        unscaled_piece = math.ldexp(piece, -SCALE_EXPONENT)
        for part, part_max in ((high, A_HI_MAX), (low, A_LO_MAX)):
            if part is low and j == PIECES - 1:
                continue  # a_lo * c_14 < 2**-64
            bound = part_max * unscaled_piece
            r = _residue(mul(part, piece), bound)
            if bound < 2.0**-18:
                fine.append(r)
                continue
            on_grid = sub(add(r, GRID_MAGIC), GRID_MAGIC)
            coarse.append(on_grid)
            fine.append(sub(r, on_grid))
    return _sum(coarse), _sum(fine)


def _sum(terms):
    """A balanced sum: the coarse terms add exactly in any order; a tree of depth log2(n) rather than a chain of
    n keeps the work of hashing the expression (each node hashes its whole subtree) near n log n."""
    if len(terms) == 1:
        return terms[0]
    middle = len(terms) // 2
    return add(_sum(terms[:middle]), _sum(terms[middle:]))


def sine_of_quarter_turns(coarse, fine, finite):
    """sin(T * pi/2) for T = coarse + fine (coarse exact): coarse reduced mod 4 exactly, the activation fed
    S * pi/2 with S in [-2, 2], clamped inside [-pi, pi]; non-finite lanes (``finite`` false) feed it 0."""
    whole_turns = sub(add(mul(coarse, 0.25), ROUND_MAGIC), ROUND_MAGIC)
    reduced = add(sub(coarse, mul(whole_turns, 4.0)), fine)
    angle = _op("minimum", _op("maximum", mul(reduced, math.pi / 2), -PI_INSIDE), PI_INSIDE)
    return _op("sin", where(finite, angle, 0.0))


def sin(x):
    magnitude = absolute(x)
    finite = lt(magnitude, INF)  # false for inf and nan
    coarse, fine = quarter_turns(magnitude)
    # sin is odd: sin(|x|) with x's sign (a product by +-1 keeps -0.0), and x itself below 2**-12.
    odd = mul(sine_of_quarter_turns(coarse, fine, finite), copysign(1.0, x))
    return where(finite, where(lt(magnitude, TINY), x, odd), math.nan)


def cos(x):
    magnitude = absolute(x)
    finite = lt(magnitude, INF)
    coarse, fine = quarter_turns(magnitude)
    # cos(a) = sin(a + pi/2): one more quarter turn (coarse + 1 stays an exact multiple of 2**-17 below 128).
    return where(finite, sine_of_quarter_turns(add(coarse, 1.0), fine, finite), math.nan)


FORMS = {aten.sin.default: sin, aten.cos.default: cos}


@register_lowering(*FORMS)
def lower_sin_cos(ctx, node):
    return emit_pointwise(ctx, node, FORMS[node.target](_x(ctx, node)))


def _decline_tan(node: torch.fx.Node) -> str | None:
    return ("aten.tan: near its poles tan needs the reduced argument to ~2**-47 (fp32 comes within 2**-30 of a "
            "quarter turn of an odd multiple of pi/2); the fp32 reduction of sin/cos is accurate to ~2**-23")


@register_lowering(aten.tan.default, check=_decline_tan)
def lower_tan(ctx, node):  # never reached: the check declines every node
    raise AssertionError("aten.tan is declined by its check")
