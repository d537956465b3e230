"""Rotary interleaves on the simulator against eager, and their DMAs: rows read or written with a step of 2-8
elements move as contiguous rows (codegen/strided_rows.py), never one DMA burst per element.

The forms: Flux's ``stack([-x_imag, x_real], -1).flatten(-2)`` then ``x * cos + rotated * sin``; Wan's
``out[..., 0::2] = x1 * cos - x2 * sin; out[..., 1::2] = x1 * sin + x2 * cos`` (two step-2 slice_scatters); a stack of three; a stack on another
dim (not interleaved rows: the plain path); a step read whose last element is the buffer's last.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor
from neuron_compile import ir
from neuron_compile.codegen.strided_rows import small_step

DTYPES = [torch.float32, torch.bfloat16]
# an HBM access pattern's innermost entry: ``name.ap([[...], [step, count]], offset=...)``
INNERMOST = re.compile(r"(\w+)\.ap\(\[(?:\[[^\]]*\], )*\[(-?\d+), [^\]]*\]\], offset")


def flux_rotary(x, cos, sin):
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def wan_rotary(x, cos, sin):
    """Wan's assignments into ``out[..., 0::2]`` and ``out[..., 1::2]``, as functionalization hands them to us."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x).slice_scatter(x1 * cos - x2 * sin, dim=-1, start=0, step=2)
    out = out.slice_scatter(x1 * sin + x2 * cos, dim=-1, start=1, step=2)
    return out.type_as(x)


def stack_three(a, b, c):
    return torch.stack([a * 2.0, -b, c + 1.0], dim=-1).flatten(-2)


def stack_outer(a, b):
    return torch.stack([a, -b], dim=1)


def odd_steps(x):
    return x[..., 1::2] * 2.0 + x[..., 0::2]


def _rotary_inputs(tokens: int, heads: int, dim: int, dtype, seed: int = 0):
    x = random_tensor((1, tokens, heads, dim), dtype, seed=seed)
    cos = random_tensor((tokens, 1, dim), torch.float32, seed=seed + 1)
    sin = random_tensor((tokens, 1, dim), torch.float32, seed=seed + 2)
    return x, cos, sin


def _strided_hbm_steps(region) -> list[tuple[str, int]]:
    """(tensor, step) of every HBM access whose innermost step is a small one (an SBUF tile's views are not)."""
    found = []
    for kernel in region.kernels:
        hbm = set(kernel.parameters) | {output.name for output in kernel.outputs} | set(
            re.findall(r"(\w+) = nl\.ndarray\(\(\d+,\), dtype=[\w.]+, buffer=nl\.(?:shared_)?hbm\)", kernel.source))
        for tensor, step in INNERMOST.findall(kernel.source):
            if tensor in hbm and small_step(abs(int(step)), "bfloat16"):
                found.append((tensor, int(step)))
    return found


@settings(max_examples=12, deadline=None)
@given(tokens=st.sampled_from([1, 127, 128, 129, 200]), heads=st.sampled_from([1, 3, 8]),
       dim=st.sampled_from([2, 6, 64, 128]), dtype=st.sampled_from(DTYPES), form=st.sampled_from(["flux", "wan"]))
def test_rotary_interleaves_match_eager(tokens, heads, dim, dtype, form):
    x, cos, sin = _rotary_inputs(tokens, heads, dim, dtype)
    if form == "wan":
        cos, sin = cos[None], sin[None]
    check_against_eager(flux_rotary if form == "flux" else wan_rotary, x, cos, sin)


@pytest.mark.parametrize("form", ["flux", "wan"])
def test_rotary_interleaves_move_contiguous_rows(form):
    x, cos, sin = _rotary_inputs(256, 8, 128, torch.bfloat16)
    if form == "wan":
        cos, sin = cos[None], sin[None]
    region = check_against_eager(flux_rotary if form == "flux" else wan_rotary, x, cos, sin)
    steps = [(tensor, step) for tensor, step in _strided_hbm_steps(region)
             if tensor not in {"arg1_1", "arg2_1"}]  # cos / sin rows: one small load per tile, read through views
    assert not steps, steps


@pytest.mark.parametrize("form", ["flux", "wan"])
def test_each_rotary_is_one_kernel(form):
    """Flux: the negation inlined into the stack's parts, the multiply-add distributed over them (restated over
    the stack's [.., 64, 2]); Wan: the second slice_scatter takes the first and both halves' math. The rotated
    tensor never reaches HBM."""
    x, cos, sin = _rotary_inputs(130, 2, 64, torch.bfloat16)
    if form == "wan":
        cos, sin = cos[None], sin[None]
    region = check_against_eager(flux_rotary if form == "flux" else wan_rotary, x, cos, sin)
    assert len(region.kernels) == 1


def test_refine_layout_splits_dims_and_refuses_regrouping():
    wide = ir.Layout((1, 5, 8, 128), (0, 1024, 128, 1), 3)
    assert ir.refine_layout(wide, (1, 5, 8, 64, 2)) == ir.Layout((1, 5, 8, 64, 2), (0, 1024, 128, 2, 1), 3)
    assert ir.refine_layout(ir.Layout((4, 6), (1, 4), 0), (4, 3, 2)) == ir.Layout((4, 3, 2), (1, 8, 4), 0)
    assert ir.refine_layout(ir.Layout((6,), (2,), 1), (6, 1)) == ir.Layout((6, 1), (2, 0), 1)
    assert ir.refine_layout(ir.Layout((6,), (1,), 0), (4,)) is None  # other elements
    assert ir.refine_layout(ir.Layout((2, 3), (3, 1), 0), (6,)) is None  # a merge, not a split
    assert ir.refine_layout(ir.Layout((6,), (1,), 0), (2, 4)) is None


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 129]), cols=st.sampled_from([1, 5, 64]), dtype=st.sampled_from(DTYPES))
def test_a_stack_of_three_interleaves(rows, cols, dtype):
    a, b, c = (random_tensor((rows, cols), dtype, seed=seed) for seed in range(3))
    region = check_against_eager(stack_three, a, b, c)
    if dtype == torch.bfloat16:  # 3 x 2 bytes: a step these helpers take; fp32's 12 bytes too
        assert not _strided_hbm_steps(region)


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 127, 130]), cols=st.sampled_from([1, 3, 64]), dtype=st.sampled_from(DTYPES))
def test_a_stack_on_an_outer_dim_keeps_its_plain_copies(rows, cols, dtype):
    a, b = random_tensor((rows, cols), dtype, seed=0), random_tensor((rows, cols), dtype, seed=1)
    check_against_eager(stack_outer, a, b)


@settings(max_examples=8, deadline=None)
@given(rows=st.sampled_from([1, 128, 129]), cols=st.sampled_from([2, 6, 130]), dtype=st.sampled_from(DTYPES))
def test_step_reads_stop_at_the_buffers_last_element(rows, cols, dtype):
    """``x[..., 1::2]`` ends on the buffer's last element and ``x[..., 0::2]`` one before: the span read for both
    is as long as the farther needs (the simulator raises on a read past the buffer)."""
    x = random_tensor((rows, cols), dtype)
    region = check_against_eager(odd_steps, x)
    assert not _strided_hbm_steps(region)


def test_a_lone_odd_phase_reads_no_further_than_it_needs():
    x = random_tensor((129, 7), torch.bfloat16)
    check_against_eager(lambda t: t[..., 0::2] + 1.0, x)  # 4 of 7 per row: the span of the last row ends at 6
