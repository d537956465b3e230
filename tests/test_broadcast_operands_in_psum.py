"""Flux's interleaved rotary embedding with its fp32 cos and sin staged in PSUM (codegen/expressions.py
``stage_in_psum``): each product with x then reads one PSUM operand, which VectorE streams at full rate. Against
eager bit for bit (the same fp32 products and sum, one rounding to the output dtype), ragged token counts, fp32 and
bf16, special values in x and in cos / sin."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor
from neuron_compile import ir
from neuron_compile.codegen.expressions import BroadcastLoad, TileAllocator, TileScope, emit

EXACT = {torch.float32: (0.0, 0.0), torch.bfloat16: (0.0, 0.0)}


def flux_rotary(x, cos, sin):
    """diffusers' apply_rotary_emb for Flux (use_real_unbind_dim=-1) on x [batch, tokens, heads, dim]."""
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _angles(tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = (torch.arange(tokens).float()[:, None] * freqs[None]).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def _concat_source(region) -> str:
    return next(kernel.source for kernel in region.kernels if "Concat" in kernel.source)


@settings(max_examples=8, deadline=None)
@given(tokens=st.sampled_from([1, 127, 128, 129, 200]), heads=st.sampled_from([1, 3, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_flux_rotary_with_cos_and_sin_in_psum_matches_eager(tokens, heads, dtype):
    x = random_tensor((1, tokens, heads, 128), dtype, seed=tokens + heads)
    cos, sin = _angles(tokens, 128)
    region = check_against_eager(flux_rotary, x, cos, sin, tolerances=EXACT)
    source = _concat_source(region)
    staged = "buffer=nl.psum" in source and "engine=nisa.engine.scalar)" in source
    if tokens > 1:  # (one token: the heads go on the partitions, cos and sin are no broadcast over them)
        assert staged == (heads > 1)  # one head: cos and sin are read as they are, no broadcast over heads


def test_special_values_pass_through_the_psum_copies():
    tokens, heads = 129, 2
    x = random_tensor((1, tokens, heads, 128), torch.float32, seed=3)
    x[0, 0, 0, :4] = torch.tensor([math.inf, -math.inf, math.nan, -0.0])
    cos, sin = _angles(tokens, 128)
    cos[1, :4] = torch.tensor([math.inf, -0.0, math.nan, 0.0])
    sin[2, :4] = torch.tensor([-math.inf, -0.0, 0.0, math.nan])
    for dtype in (torch.float32, torch.bfloat16):
        check_against_eager(flux_rotary, x.to(dtype), cos, sin, tolerances=EXACT)


def test_more_broadcast_operands_than_a_bank_holds_stay_in_sbuf():
    """Five fp32 operands broadcast over the heads (cos and sin twice, and their product): four fill the PSUM bank,
    the fifth is read from SBUF; the result is still eager's."""
    tokens, heads = 130, 2
    x = random_tensor((1, tokens, heads, 128), torch.float32, seed=5)
    cos, sin = _angles(tokens, 128)

    def with_a_fifth(x, cos, sin):
        return x * (cos[None, :, None, :] * sin[None, :, None, :]) + flux_rotary(x, cos, sin)

    source = _concat_source(check_against_eager(with_a_fifth, x, cos, sin))
    assert source.count("nisa.tensor_copy(dst=broadcast_psum") == 4
    assert any("tensor_tensor" in line and "_once_" in line for line in source.splitlines())


def test_an_instruction_over_two_staged_operands_reads_one_from_sbuf():
    """The engines take at most one PSUM operand: a product of two staged operands reads the first from SBUF."""
    allocator = TileAllocator(128)
    scope = TileScope(allocator, 512, "[0:rows, 0:cols]", load_pattern=None,
                      broadcast_pattern=lambda load: BroadcastLoad(64, "cols", f"{load.buffer}.ap(...)", step=2))
    layout = ir.Layout((1, 128, 8, 64), (0, 128, 0, 2))
    lines: list[str] = []
    emit(ir.op("mul", ir.Load("cos", layout, "float32"), ir.Load("sin", layout, "float32")), scope, lines)
    product = next(line for line in lines if line.startswith("nisa.tensor_tensor("))
    assert product.count("broadcast_psum") == 1 and "cos_once" in product
