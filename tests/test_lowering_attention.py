"""Scaled-dot-product attention on the simulator vs eager: plain, causal, additive mask, transposed heads."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, random_tensor

# Two chained matmuls around a softmax: fp32 differences from summation order stay around 1e-5 relative.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
SDPA = torch.nn.functional.scaled_dot_product_attention


@settings(max_examples=12, deadline=None)
@given(heads=st.sampled_from([1, 2]), queries=st.sampled_from([1, 5, 129]), keys=st.sampled_from([1, 7, 130]),
       depth=st.sampled_from([8, 16]), causal=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_attention_matches_eager(heads, queries, keys, depth, causal, dtype):
    if causal:
        keys = queries  # eager's top-left causal mask; equal lengths as in self-attention
    q = random_tensor((2, heads, queries, depth), dtype, seed=1)
    k = random_tensor((2, heads, keys, depth), dtype, seed=2)
    v = random_tensor((2, heads, keys, depth), dtype, seed=3)
    check_against_eager(lambda q, k, v: SDPA(q, k, v, is_causal=causal), q, k, v, tolerances=TOLERANCES)


def test_attention_with_additive_mask_and_heads_from_a_projection():
    # q, k, v as a model makes them: [batch, seq, heads, depth] projections viewed as [batch, heads, seq, depth].
    q = random_tensor((2, 9, 4, 8), seed=4).transpose(1, 2)
    k = random_tensor((2, 9, 4, 8), seed=5).transpose(1, 2)
    v = random_tensor((2, 9, 4, 8), seed=6).transpose(1, 2)
    mask = random_tensor((9, 9), seed=7)
    check_against_eager(lambda q, k, v, mask: SDPA(q, k, v, attn_mask=mask), q, k, v, mask, tolerances=TOLERANCES)


def test_grouped_query_attention_with_a_mask():
    q = random_tensor((2, 4, 6, 8), seed=8)
    k, v = random_tensor((2, 2, 6, 8), seed=9), random_tensor((2, 2, 6, 8), seed=10)
    mask = random_tensor((2, 1, 6, 6), seed=11)
    check_against_eager(lambda q, k, v, mask: SDPA(q, k, v, attn_mask=mask, enable_gqa=True), q, k, v, mask,
                        tolerances=TOLERANCES)
    check_against_eager(lambda q, k, v: SDPA(q, k, v, is_causal=True, enable_gqa=True), q, k, v,
                        tolerances=TOLERANCES)
