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

When value ranges bound the argument (passes/value_range.py; a rotary embedding's positions times its
frequencies, with the frequencies' call-time guard from passes/input_ranges.py), sin and cos take a cheaper exact
path (``bounded_form``): |x| <= pi (sin) goes to the activation as it is; |x| <= ``CODY_WAITE_LIMIT`` takes a
Cody-Waite reduction in half turns, x + s pi/2 = n pi + r with n = round(x / pi + s/2) and r = x - (n - s/2) pi,
pi split into pieces of few enough bits that every product (n - s/2) * piece is exact fp32 and the subtractions
are exact where it matters (``reduction_error`` bounds the error per binade of x and the import checks it
against ``REDUCTION_ERROR_MAX``); then sin(x + s pi/2) = (-1)**n sin(r) with |r| <= pi/2 + 2e-3. About 20
instructions instead of ~400; tan keeps the full reduction (its poles need the reduced argument's relative
accuracy). Up to ``POSITION_LIMIT`` (2**20: a decode step's positions come from an input, which the integer guard
bounds by 2**20) the same reduction runs with pi in finer pieces, and the last few products, which would each round
on r's fine grid, are summed first and taken off together (``summed_tail_sine``; ``summed_tail_error`` bounds it
by the same rule, and the import checks it too); cos takes it from ``CODY_WAITE_LIMIT`` on only. About 50
instructions.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from neuron_compile import ir
from neuron_compile.lowering.math_expressions import INF, absolute, add, lt, mul, sub, where
from neuron_compile.lowering.pointwise import emit_pointwise, load_input
from neuron_compile.lowering.registry import register_lowering
from neuron_compile.passes.value_range import value_range

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

# ---------------------------------------------------------------- bounded arguments: Cody-Waite

PI_BITS = 0xC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74  # floor(pi * 2**190)
PI = Fraction(PI_BITS, 2**190)  # within 2**-190 of pi
FP32_SIGNIFICAND_BITS = 24
CODY_WAITE_LIMIT = 2.0**12  # |x| up to here: the reduction's error stays below REDUCTION_ERROR_MAX (checked)
# |x| up to here: the summed-tail reduction's error stays below REDUCTION_ERROR_MAX (checked). Integer positions are
# bounded by +-2**20 (passes/input_ranges.GUARD_BOUND) and a rotary embedding's frequencies by 1, so a decode step's
# angles (positions from ``cache_position``, an input) reach sin and cos within it.
POSITION_LIMIT = 2.0**20
REDUCTION_ERROR_MAX = 2.0**-23  # absolute error of r besides its own rounding to fp32 (2**-24 relative)
PIECE_TAIL_MAX = 2.0**-28  # the last piece's share of the error: (|q| * |pi - pieces| rounded to fp32)
BOUND_SLACK = 1.0 + 2.0**-20  # value-range bounds ignore fp32 roundings (one part in 2**24 each)


def _fp32(value: float) -> float:
    return float(np.float32(value))


def _floor_log2(value: Fraction) -> int:
    exponent = value.numerator.bit_length() - value.denominator.bit_length()
    return exponent - 1 if Fraction(2) ** exponent > value else exponent


def _to_bits(value: Fraction, bits: int, truncate: bool) -> Fraction:
    """``value`` rounded to its leading ``bits`` bits: to nearest, or (``truncate``, value > 0) toward zero."""
    step = Fraction(2) ** (_floor_log2(abs(value)) + 1 - bits)
    return (value // step if truncate else round(value / step)) * step


def multiplier_max(limit: float) -> float:
    """The largest |q| = |n - s/2| for |x| <= limit (n rounds x / pi + s/2, with its fp32 errors; the limit with
    ``BOUND_SLACK``)."""
    return limit * BOUND_SLACK / math.pi * BOUND_SLACK + 1.0


def pi_pieces(limit: float, half_turn_shift: bool) -> tuple[float, ...]:
    """pi as C_1 + ... + C_k + C_last: each C_i with few enough significant bits that q * C_i is an exact fp32 for
    every q (a multiple of 1/2 with |q| <= ``multiplier_max``), until the rest times that q is below
    ``PIECE_TAIL_MAX``; C_last the fp32 nearest the rest. For sin (no shift) the pieces are truncated, so all are
    positive: for q = 0 every product is +0 and x - q * C_i keeps x's sign of zero (sin(-0.0) = -0.0). For cos
    they are rounded to nearest (fewer pieces: fewer roundings where x is tiny and q = +-1/2)."""
    most = multiplier_max(limit)
    bits = FP32_SIGNIFICAND_BITS - int(2 * most).bit_length()
    pieces, rest = [], PI
    while most * abs(float(rest)) * 2.0**-23 > PIECE_TAIL_MAX:
        pieces.append(_to_bits(rest, bits, truncate=not half_turn_shift))
        rest -= pieces[-1]
    return (*(float(piece) for piece in pieces), _fp32(float(rest)))


def _ulp(value: float) -> float:
    """The fp32 spacing at |value| (normal or subnormal)."""
    return 2.0 ** max(math.frexp(abs(value))[1] - FP32_SIGNIFICAND_BITS, -149)


def _lowest_bit(value: float) -> float:
    mantissa, exponent = math.frexp(value)
    bits = 0
    while not (mantissa * 2**bits).is_integer():
        bits += 1
    return 2.0 ** (exponent - bits)


def _binade_error(low: float, high: float, pieces: tuple[float, ...], half_turn_shift: bool) -> float:
    """The worst absolute error of r for x in [low, high): the exact steps' roundings (a step is exact when r_i, a
    multiple of the grid of x and q * C_i, stays below 2**24 grid steps), the last product's rounding and the
    tail of pi the pieces leave out."""
    most = high / math.pi * BOUND_SLACK + (1.0 if half_turn_shift else 0.5)
    if not half_turn_shift and most < 1.0:
        return 0.0  # n = 0: r = x exactly
    unit = 0.5 if half_turn_shift else 1.0  # q is a multiple of it
    grid_x = _ulp(low)
    error, partial = 0.0, Fraction(0)
    for piece in pieces[:-1]:
        partial += Fraction(piece)
        bound = math.pi / 2 + math.pi * 2.0**-20 * most + error + most * abs(float(PI - partial))
        if bound >= 2.0**FP32_SIGNIFICAND_BITS * min(grid_x, unit * _lowest_bit(piece)):
            error += _ulp(bound) / 2
    last = pieces[-1]
    return error + _ulp(most * last) / 2 + most * abs(float(PI - partial - Fraction(last)))


def _summed_tail_binade_error(low: float, high: float, pieces: tuple[float, ...], half_turn_shift: bool,
                              split: int) -> float:
    """As ``_binade_error`` for ``summed_tail_sine``: the first ``split`` steps as there, then the rest's products
    summed smallest first (only the last product rounds; each addition rounds to its partial sum's spacing), and one
    subtraction that rounds to the spacing of r. n's error is taken as it is: x / pi through fp32(1/pi), the
    product and the shift's sum round by 2**-24 relative each, so |r| <= pi/2 + pi * most * 2**-22."""
    most = high / math.pi * BOUND_SLACK + (1.0 if half_turn_shift else 0.5)
    if not half_turn_shift and most < 1.0:
        return 0.0  # n = 0: every product is 0, r = x exactly
    unit = 0.5 if half_turn_shift else 1.0
    grid_x, floor = _ulp(low), math.pi / 2 + math.pi * most * 2.0**-22
    error, partial = 0.0, Fraction(0)
    for piece in pieces[:split]:
        partial += Fraction(piece)
        bound = floor + error + most * abs(float(PI - partial))
        if bound >= 2.0**FP32_SIGNIFICAND_BITS * min(grid_x, unit * _lowest_bit(piece)):
            error += _ulp(bound) / 2
    tail = pieces[split:]
    error += _ulp(most * abs(tail[-1])) / 2
    running = most * abs(tail[-1])
    for piece in reversed(tail[:-1]):
        running += most * abs(piece)
        error += _ulp(running) / 2
    error += _ulp(floor + error) / 2
    return error + most * abs(float(PI - partial - sum(map(Fraction, tail))))


def summed_tail_error(limit: float, half_turn_shift: bool, split: int, lowest: float) -> float:
    """The worst absolute error of ``summed_tail_sine``'s r over every fp32 ``lowest`` <= |x| <= limit (with
    ``BOUND_SLACK``), binade by binade, besides r's own final rounding."""
    pieces, largest = pi_pieces(limit, half_turn_shift), limit * BOUND_SLACK
    return max(_summed_tail_binade_error(2.0**e, min(2.0 ** (e + 1), largest), pieces, half_turn_shift, split)
               for e in range(math.frexp(lowest)[1] - 1, math.floor(math.log2(largest)) + 1))


# The lowest |x| each summed-tail form serves: sin from 0 on, cos from CODY_WAITE_LIMIT on (cosine_up_to_positions)
SUMMED_TAIL_LOWEST = {False: 2.0**-149, True: CODY_WAITE_LIMIT}


def best_tail_split(half_turn_shift: bool) -> int:
    """How many of POSITION_LIMIT's pieces come off one by one: the split with the smallest error bound."""
    count = len(pi_pieces(POSITION_LIMIT, half_turn_shift))
    return min(range(1, count), key=lambda split: summed_tail_error(
        POSITION_LIMIT, half_turn_shift, split, SUMMED_TAIL_LOWEST[half_turn_shift]))


# best_tail_split's answers (tests/test_lowering_trigonometry.py checks them; working them out costs ~50 ms, and
# every process imports this module)
TAIL_SPLITS = {False: 5, True: 4}


def reduction_error(limit: float, half_turn_shift: bool) -> float:
    """The worst absolute error of the reduced angle r over every fp32 |x| <= limit (with ``BOUND_SLACK``: the
    bound a value range proves may be off by its roundings), binade by binade, besides r's own final rounding."""
    pieces, largest = pi_pieces(limit, half_turn_shift), limit * BOUND_SLACK
    return max(_binade_error(2.0**e, min(2.0 ** (e + 1), largest), pieces, half_turn_shift)
               for e in range(-149, math.floor(math.log2(largest)) + 1))


def check_reduction() -> None:
    for shift in (False, True):
        error = reduction_error(CODY_WAITE_LIMIT, shift)
        if error > REDUCTION_ERROR_MAX:
            raise ArithmeticError(f"Cody-Waite reduction to {CODY_WAITE_LIMIT}: error {error} > {REDUCTION_ERROR_MAX}")
        error = summed_tail_error(POSITION_LIMIT, shift, TAIL_SPLITS[shift], SUMMED_TAIL_LOWEST[shift])
        if error > REDUCTION_ERROR_MAX:
            raise ArithmeticError(f"summed-tail reduction to {POSITION_LIMIT}: error {error} > {REDUCTION_ERROR_MAX}")


def _half_turns(x, half_turn_shift: bool):
    """(n, q): n = round(x / pi + s/2) and q = n - s/2, the multiple of pi taken off x."""
    turns = mul(x, _fp32(1 / math.pi))
    n = round_magic(add(turns, 0.5) if half_turn_shift else turns, ROUND_MAGIC)
    return n, (sub(n, 0.5) if half_turn_shift else n)


def half_turn_sine(x, half_turn_shift: bool):
    """sin(x + s pi/2) for |x| <= CODY_WAITE_LIMIT (s = 1: cos x): (-1)**n sin(r), r = x - (n - s/2) pi."""
    n, q = _half_turns(x, half_turn_shift)
    reduced = x
    for piece in pi_pieces(CODY_WAITE_LIMIT, half_turn_shift):
        reduced = sub(reduced, mul(q, piece))
    return _signed(_sin(reduced), _is_odd(n))


def summed_tail_sine(x, half_turn_shift: bool):
    """sin(x + s pi/2) for |x| <= POSITION_LIMIT, as ``half_turn_sine`` with pi in finer pieces: the first
    ``TAIL_SPLITS[s]`` products come off x one by one (exact), the rest are summed first, smallest first, and come
    off together (one rounding where one per piece would add up)."""
    n, q = _half_turns(x, half_turn_shift)
    pieces, split = pi_pieces(POSITION_LIMIT, half_turn_shift), TAIL_SPLITS[half_turn_shift]
    reduced = x
    for piece in pieces[:split]:
        reduced = sub(reduced, mul(q, piece))
    tail = mul(q, pieces[-1])
    for piece in reversed(pieces[split:-1]):
        tail = add(tail, mul(q, piece))
    return _signed(_sin(sub(reduced, tail)), _is_odd(n))


def cosine_up_to_positions(x):
    """cos x for |x| <= POSITION_LIMIT: the summed-tail form's error bound holds from CODY_WAITE_LIMIT on (below,
    q = +-1/2 and its steps round on x's fine grid), so smaller |x| take ``half_turn_sine``."""
    return where(lt(absolute(x), CODY_WAITE_LIMIT), half_turn_sine(x, True), summed_tail_sine(x, True))


def bounded_form(target, bound: float):
    """The cheap form of sin / cos for arguments a value range bounds by +-bound, or None (the full reduction)."""
    if target is aten.sin.default and bound * BOUND_SLACK <= math.pi:
        return _sin  # the activation's own range
    if target in (aten.sin.default, aten.cos.default) and bound <= CODY_WAITE_LIMIT:
        return lambda x: half_turn_sine(x, target is aten.cos.default)
    if target is aten.sin.default and bound <= POSITION_LIMIT:
        return lambda x: summed_tail_sine(x, False)
    if target is aten.cos.default and bound <= POSITION_LIMIT:
        return cosine_up_to_positions
    return None


def _form(node):
    argument = value_range(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
    if argument is not None:
        cheap = bounded_form(node.target, max(-argument.low, argument.high))
        if cheap is not None:
            return cheap
    return FORMS[node.target]


@register_lowering(*FORMS)
def lower_trigonometric(ctx, node):
    return emit_pointwise(ctx, node, _form(node)(load_input(ctx, node)))


check_reduction()
