"""The flash-attention kernel's one-block tiles (kinds/attention.py, ``AttentionPlan.psum_rings`` and
``scaled_keys``) on the simulator vs eager SDPA: P^T chunks and P @ [v | 1] in kernel-wide PSUM rings, each tile's
score bank released at its exponential, and, for a power-of-two scale, k^T scaled once so that VectorE's row max
comes out negated as the exponential's bias (no GpSimd instruction per tile) where every key/value head loads up
front (a head group's positions outermost); one key/value head or grouped heads, causal or not, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_and_run, random_tensor
from test_flash_attention import SDPA, TOLERANCES, kernel_runs

RINGS = "P^T and P @ v in PSUM rings"
SCALED_KEYS = "k^T scaled (the row max negated on VectorE)"


def heads_first(queries, heads, kv_heads, depth, dtype, keys=None):
    """q, k, v viewed heads-first from [1, seq, heads, depth] projections, as models make them."""
    keys = keys or queries
    q = random_tensor((1, queries, heads, depth), dtype, seed=5).transpose(1, 2)
    k = random_tensor((1, keys, kv_heads, depth), dtype, seed=6).transpose(1, 2)
    v = random_tensor((1, keys, kv_heads, depth), dtype, seed=7).transpose(1, 2)
    return q, k, v


def per_tile_gpsimd_columns(trace) -> list:
    """GpSimd's tensor_scalar instructions writing a (P, 1) column: the per-tile -max the scaled keys spare (not
    k^T's scaling, [D, chunk, keys], however few the keys)."""
    return [record for record in trace if record.engine == "gpsimd" and record.name == "tensor_scalar"
            and len(record.dst.shape) == 2 and record.dst.shape[1] == 1]


@settings(max_examples=14, deadline=None)
@given(queries=st.sampled_from([1, 127, 128, 129, 300]), depth=st.sampled_from([64, 96, 128]),
       heads=st.sampled_from([(1, 1), (4, 1), (8, 2)]), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_one_block_tiles_use_psum_rings_and_match_eager(queries, depth, heads, causal, dtype):
    """Keys within one block: the rings; the scaled keys where the scale (1 / sqrt(D)) is a power of two (D 64) and
    the query heads form groups over their key/value heads (loaded up front), then no GpSimd instruction per tile
    and one negated row max per tile; the per-tile -max otherwise."""
    query_heads, kv_heads = heads
    q, k, v = heads_first(queries, query_heads, kv_heads, depth, dtype)
    with kernel_runs() as runs:
        region = check_against_eager(lambda q, k, v: SDPA(q, k, v, is_causal=causal, enable_gqa=True), q, k, v,
                                     tolerances=TOLERANCES)
    source = region.kernels[0].source
    if "Attention kernel" not in source:
        return  # one query: the decode form (tests/test_attention_decode.py)
    assert RINGS in source
    (trace,) = [run.trace for run in runs]
    maxima = [record for record in trace if record.name == "tensor_reduce" and record.attrs.get("op") == "maximum"]
    if depth == 64 and query_heads > kv_heads:
        assert "query tile positions outermost" in source and SCALED_KEYS in source
        assert maxima and all(record.attrs["negate"] for record in maxima)
        assert not per_tile_gpsimd_columns(trace)
    else:
        assert SCALED_KEYS not in source
        assert not any(record.attrs["negate"] for record in maxima)
        assert len(per_tile_gpsimd_columns(trace)) == len(maxima)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,scaled", [(0.25, True), (2.0, True), (0.3, False), (2.0 ** -120, False)])
def test_only_a_power_of_two_scale_in_the_normal_range_scales_the_keys(scale, scaled, dtype):
    """k^T times the scale is exact only for a power of two (and a scale far from the bottom of the float range,
    where k * scale could lose bits): any other scale keeps the scores raw and GpSimd's -scale * max per tile."""
    q, k, v = heads_first(129, 4, 2, 96, dtype)
    with kernel_runs() as runs:
        region = check_against_eager(lambda q, k, v: SDPA(q, k, v, scale=scale, enable_gqa=True), q, k, v,
                                     tolerances=TOLERANCES)
    source = region.kernels[0].source
    assert RINGS in source
    assert (SCALED_KEYS in source) == scaled
    (trace,) = [run.trace for run in runs]
    assert bool(per_tile_gpsimd_columns(trace)) != scaled


@pytest.mark.parametrize("mask", ["float", "causal_tiny_scale"])
def test_masks_in_sbuf_keep_the_raw_scores(mask):
    """A mask added in SBUF (a float mask, or the causal mask under a scale too small for the TensorE bias) keeps
    the scale on the exponential (or the SBUF copy), not on k^T: the rings still, no scaled keys."""
    q, k, v = heads_first(200, 4, 2, 64, torch.float32)
    if mask == "float":
        attn_mask = random_tensor((200, 200), torch.float32, seed=8)
        region = check_against_eager(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m, enable_gqa=True), q, k, v,
                                     attn_mask, tolerances=TOLERANCES)
    else:
        region = check_against_eager(lambda q, k, v: SDPA(q, k, v, is_causal=True, scale=2.0 ** -120,
                                                          enable_gqa=True), q, k, v, tolerances=TOLERANCES)
    source = region.kernels[0].source
    assert RINGS in source and SCALED_KEYS not in source


def test_keys_over_one_block_keep_a_score_bank_per_block():
    """Tiles of several key blocks (over 1536 keys) keep their per-block PSUM tiles: no rings, no scaled keys."""
    q, k, v = heads_first(130, 2, 1, 64, torch.bfloat16, keys=2000)
    region, _ = compile_and_run(lambda q, k, v: SDPA(q, k, v, enable_gqa=True), q, k, v)
    source = region.kernels[0].source
    assert RINGS not in source and SCALED_KEYS not in source
