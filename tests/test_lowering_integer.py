"""Integer arithmetic in kernels (fp32 tiles, exact within +-2**24 as the value-range pass proves) vs eager.

Everything runs through ``torch.compile(backend="neuron")`` with ``fallback="raise"`` and is checked bit for bit
(integer results) or within the harness tolerances (float results that read integer index math), and for the
number of ATen nodes left eager.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check_through_backend as check
from lowering_harness import compile_with_backend as _compiled
from lowering_harness import random_tensor


@pytest.mark.parametrize("rows", [1, 127, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tril_triu_masks_from_index_arithmetic(rows, dtype):
    x = random_tensor((rows, 131), dtype=dtype, seed=rows)
    for diagonal in (0, 3, -5):
        check(lambda a, d=diagonal: torch.tril(a, d), x)
        check(lambda a, d=diagonal: torch.triu(a, d), x)


def test_diag_and_diag_embed():
    check(lambda a: torch.diag(a), random_tensor((130,), seed=1))
    check(lambda a: torch.diag_embed(a, offset=2), random_tensor((3, 9), seed=2))


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_padding_by_index_arithmetic(mode):
    x = random_tensor((2, 3, 140), seed=3)
    check(lambda a: F.pad(a, (5, 7), mode=mode), x)
    check(lambda a: F.pad(a, (2, 3, 1, 1), mode=mode), x.to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "nearest-exact"])
def test_interpolate_index_math_is_exact(mode):
    x = random_tensor((1, 2, 9, 130), seed=4)
    check(lambda a: F.interpolate(a, scale_factor=1.7, mode=mode), x)
    check(lambda a: F.interpolate(a, size=(4, 61), mode=mode), x)


def test_integer_results_are_widened_to_int64_with_eager_strides():
    x = random_tensor((129, 7), seed=5)
    check(lambda a: torch.count_nonzero(a > 0, dim=0), x)
    check(lambda a: (a > 0).sum(dim=1, dtype=torch.int64), x)
    check(lambda a: torch.arange(-40, 300, 3).view(-1, 1).expand(-1, 4).t() * 2 + 1, x)
    stats = check(lambda a: (torch.arange(7) * 0.25 - 0.9).long(), x)  # trunc toward zero: -0.9 -> 0, -0.4 -> 0
    assert stats["kernels_launched"] >= 1


def test_float_to_integer_cast_truncates_toward_zero():
    # quarters from -3 to 2.75 (and thirds, which are not exact in fp32): -2.75 -> -2, -0.25 -> 0, 2.5 -> 2
    for dtype in (torch.int32, torch.int64):
        check(lambda a, d=dtype: (torch.arange(-12, 12) * 0.25).to(d), random_tensor((3,)))
        check(lambda a, d=dtype: (torch.arange(-300, 300) / 3 + 0.5).to(d), random_tensor((3,)))
    check(lambda a: (torch.arange(-20, 20, dtype=torch.bfloat16) * 0.75).long(), random_tensor((3,)))


def test_integer_values_near_the_fp32_exact_limit():
    start = 2**24 - 2**10 - 300
    check(lambda a: torch.arange(start, start + 200) - start + (a > 0).sum(), random_tensor((5,), seed=6))


def test_unbounded_integers_stay_eager_with_their_reason():
    index = torch.tensor([3, 2**30, -7])
    got, stats = _compiled(lambda i: i + 1, index)
    assert torch.equal(got, index + 1)  # 2**30 + 1 is not an fp32 value: a kernel would have rounded it
    assert stats["nki_nodes"] == 0
    (reason,) = stats["fallback_reasons"]
    assert "int64 values of arg0_1 not proved within +-2**24" in reason

    got, stats = _compiled(lambda a: torch.arange(0, 2**25, 2**20) + a.sum().long() * 0, torch.ones(3))
    assert any("beyond +-2**24" in reason for reason in stats["fallback_reasons"]), stats["fallback_reasons"]

    x = torch.tensor([1e10, -3.5, float("nan")])
    got, stats = _compiled(lambda a: a.long(), x)
    assert torch.equal(got, x.long())
    assert any("float32 values of arg0_1 not proved" in reason for reason in stats["fallback_reasons"])


def test_integer_copies_are_exact_for_every_value():
    big = torch.tensor([2**40 // 2**10, -(2**31), 2**31 - 1, 5])  # int32's full range: a copy never rounds
    check(lambda i: i.clone(), big)
    check(lambda a: a[torch.tensor([4, 0, 4, 2])], random_tensor((5, 3), seed=7))


def test_reductions_of_a_fill():
    # masked.var counts its elements as sum(full(1, int64)); the fill fuses in as a constant prologue
    x = random_tensor((5, 5, 5), seed=8)
    check(lambda a: a.sum(dim=(0, 1, 2), keepdim=True) / torch.full((5, 5, 5), 1).sum(dim=(0, 1, 2), keepdim=True,
                                                                                    dtype=torch.int64), x)
    check(lambda a: a.sum(1) + torch.full((130, 700), 2.5).sum(1), random_tensor((130, 4), seed=9))


def test_argmax_positions_feed_integer_math():
    x = random_tensor((6, 9), seed=10)
    check(lambda a: torch.argmax(a, 1) * 2 - 1, x)
    check(lambda a: (torch.max(a, 0)[1] + 3).float() * a[0], x)


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, -3, -128, 1000, 2**20 + 1])
def test_integer_remainder_fmod_and_division_by_a_constant(divisor):
    top = 2**24 - 2**10 - 2 * abs(divisor)  # the largest |dividend| the lowering accepts for this divisor

    def all_four(a):
        results = []
        for start in (-3000, top - 3004, -top):  # (a > 5).sum() adds 0..5: bounded, and not a constant fold
            values = torch.arange(start, start + 3000) + (a > 5).sum()
            results += [values % divisor, torch.fmod(values, divisor), values // divisor,
                        torch.div(values, divisor, rounding_mode="trunc")]
        return tuple(results)

    check(all_four, random_tensor((5,), seed=11))


def test_roll_cross_and_fftshift_index_math():
    x = random_tensor((4, 3, 130), seed=12)
    check(lambda a: torch.roll(a, (2, -7), (1, 2)), x)
    check(lambda a, b: torch.linalg.cross(a, b, dim=1), x, x.flip(0))
    check(lambda a: torch.fft.fftshift(a), x)
    check(lambda a: torch.fft.ifftshift(a, dim=(0, 2)), x.to(torch.bfloat16))


def test_integer_division_declines_what_it_cannot_make_exact():
    x = random_tensor((5,), seed=13)
    got, stats = _compiled(lambda a: a % 0.7, x)
    assert torch.allclose(got, x % 0.7)
    assert any("float operands" in reason for reason in stats["fallback_reasons"]), stats["fallback_reasons"]
    got, stats = _compiled(lambda a: torch.arange(0, 2**24 - 2**11) % 2**20, x)
    assert torch.equal(got, torch.arange(0, 2**24 - 2**11) % 2**20)
    assert any("not proved within 2**24" in reason for reason in stats["fallback_reasons"]), stats["fallback_reasons"]
    index = torch.tensor([5, -9, 2**40])
    got, stats = _compiled(lambda i: i // 3, index)
    assert torch.equal(got, index // 3) and stats["nki_nodes"] == 0


def test_any_int32_compared_with_or_clamped_to_small_constants():
    # fp32 rounding is monotone and keeps integers below 2**24: 2**24 + 1 reads as 2**24 but still compares
    # right against every constant below 2**24 in magnitude, whatever the (unbounded) input holds
    labels = torch.tensor([[-100, 0, 5, 2**24 - 1, 2**24 + 1, -(2**24) - 3, 2**31 - 1, -(2**31)]] * 3)
    check(lambda t: (t != -100, t >= 0, t < 2**24 - 1, t == 5, t > -(2**24) + 1, t <= 3), labels)
    check(lambda t: t.clamp(0, 7) * 2, labels)
    check(lambda t: t.clamp(-(2**24) + 1, 2**24 - 1), labels)
    got, stats = _compiled(lambda t: t == 2**24, labels)  # 2**24 + 1 would read as 2**24: not claimed
    assert torch.equal(got, labels == 2**24) and stats["nki_nodes"] == 0


def test_label_shift_of_a_causal_lm_loss():
    # transformers pads the labels with ignore_index, shifts them by one and masks them: all exact in kernels
    labels = torch.randint(0, 50, (2, 130))
    labels[0, :7] = -100
    logits = random_tensor((2, 130, 50), seed=14)

    def loss(x, t):
        shifted = F.pad(t, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(x.view(-1, 50), shifted.reshape(-1), ignore_index=-100)

    check(loss, logits, labels)
    check(lambda t: F.pad(t, (2, 3), value=-7), labels)
