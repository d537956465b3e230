"""The split-key decode form of the attention kernel (kinds/attention_decode.py) on the simulator vs eager SDPA: a
few query rows (a decode step: one query per head, a grouped-query group's heads as the rows) against a static
cache, with the valid-length mask transformers builds from cache_position, masks per row, fully masked rows, waves
of query tiles, and where the flash kernel's query tiles serve instead."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowering_harness import check_against_eager, compile_with_backend, random_tensor
from neuron_compile import config, ir
from neuron_compile.hardware import get_target
from neuron_compile.kinds.attention_decode import DECODE_MAX_ROWS, plan_decode

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
SDPA = torch.nn.functional.scaled_dot_product_attention
SPLIT = "Decode attention, split over the keys"


def cache_mask(batch, keys, positions, dtype):
    """transformers' static-cache decode mask: 0 up to each batch row's position, finfo.min after it."""
    mask = torch.zeros(batch, 1, 1, keys, dtype=dtype)
    for row, position in enumerate(positions):
        mask[row, ..., position + 1:] = torch.finfo(dtype).min
    return mask


def decode_inputs(batch, heads, kv_heads, queries, keys, depth, dtype):
    q = random_tensor((batch, queries, heads, depth), dtype, seed=1).transpose(1, 2)  # from a [B, S, H, D] projection
    k, v = (random_tensor((batch, kv_heads, keys, depth), dtype, seed=seed) for seed in (2, 3))
    return q, k, v


def attention_source(region) -> str:
    (kernel,) = [kernel for kernel in region.kernels if kernel.name.startswith("attention_kernel")]
    return kernel.source


@settings(max_examples=16, deadline=None)
@given(keys=st.sampled_from([1, 127, 128, 129, 200, 513, 1000, 2100]), group=st.sampled_from([1, 2, 4, 8]),
       queries=st.sampled_from([1, 2]), depth=st.sampled_from([16, 64, 128, 256]),
       mask=st.sampled_from([None, "cache", "rows"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_decode_attention_matches_eager(keys, group, queries, depth, mask, dtype):
    """Key counts around the chunk edges, grouped-query ratios, the cache mask, masks per row (the flash kernel)."""
    q, k, v = decode_inputs(2, 2 * group, 2, queries, keys, depth, dtype)
    if mask is None:
        fn, inputs = (lambda q, k, v: SDPA(q, k, v, enable_gqa=True)), (q, k, v)
    else:
        attn_mask = cache_mask(2, keys, [keys // 3, keys - 1], dtype) if mask == "cache" else \
            random_tensor((2, 2 * group, queries, keys), dtype, seed=4)
        fn, inputs = (lambda q, k, v, m: SDPA(q, k, v, attn_mask=m, enable_gqa=True)), (q, k, v, attn_mask)
    region = check_against_eager(fn, *inputs, tolerances=TOLERANCES)
    rows = group if queries == 1 else queries  # one query: the group's heads are the rows
    split = keys > 128 and rows <= DECODE_MAX_ROWS and (mask != "rows" or rows == 1)  # per-row masks: flash
    assert (SPLIT in attention_source(region)) == split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_give_eagers_zeros_and_finfo_min_rows_its_uniform_weights(dtype):
    q, k, v = decode_inputs(4, 8, 2, 1, 700, 32, dtype)
    mask = torch.zeros(4, 1, 1, 700, dtype=dtype)  # the same row for every head of a batch row
    mask[0] = float("-inf")  # every key
    mask[1, ..., :699] = float("-inf")  # the last key only (in the ragged last chunk)
    mask[2] = torch.finfo(dtype).min  # eager weighs every key equally
    region = check_against_eager(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m, enable_gqa=True), q, k, v, mask,
                                 tolerances=TOLERANCES)
    assert SPLIT in attention_source(region)


def test_scores_never_touch_hbm_and_each_head_loads_once():
    """q, k, v, the mask row and the output cross HBM once, also with a group's query tiles in several waves
    (two queries per head: a tile per query head, 8 of them sharing each key/value head)."""
    q, k, v = decode_inputs(2, 16, 2, 2, 1000, 64, torch.bfloat16)
    mask = cache_mask(2, 1000, [500, 999], torch.bfloat16)
    result, stats = compile_with_backend(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m, enable_gqa=True), q, k, v,
                                         mask)
    torch.testing.assert_close(result, SDPA(q, k, v, attn_mask=mask, enable_gqa=True), rtol=2e-2, atol=2e-2)
    assert stats["hbm_bytes"] == sum(t.numel() * t.element_size() for t in (q, k, v, mask, result))


def test_many_tiles_run_in_waves():
    """32 tiles of 8 rows, 7 sharing each softmax instruction (the output's PSUM bank holds 7 x 65 columns)."""
    q, k, v = decode_inputs(4, 64, 8, 1, 300, 64, torch.float32)
    mask = cache_mask(4, 300, [0, 100, 200, 299], torch.float32)
    region = check_against_eager(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m, enable_gqa=True), q, k, v, mask,
                                 tolerances=TOLERANCES)
    assert "3 key chunks of 128 on partitions, 7 query tiles per wave" in attention_source(region)


def test_flash_decode_off_keeps_the_flash_kernels_query_tiles():
    q, k, v = decode_inputs(1, 8, 2, 1, 512, 64, torch.bfloat16)
    with config.patch(flash_decode=False):
        region = check_against_eager(lambda q, k, v: SDPA(q, k, v, enable_gqa=True), q, k, v, tolerances=TOLERANCES)
    assert SPLIT not in attention_source(region) and "key blocks of 512" in attention_source(region)
    with pytest.raises(ValueError, match="flash_decode"):
        config.Config().replace(flash_decode="sometimes")


def contiguous_load(shape) -> ir.Load:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return ir.Load("x", ir.Layout(tuple(shape), tuple(strides), 0), "bfloat16")


def decode_node(rows, keys, value_dim=64, **changes) -> ir.Attention:
    load = contiguous_load

    node = ir.Attention("kernel_1", (2, rows, value_dim), load((2, rows, 64)), load((2, keys, 64)),
                        load((2, keys, value_dim)), None, 0.125, False, ())
    return dataclasses.replace(node, **changes)


def test_where_the_split_does_not_apply_the_flash_plan_serves():
    target = get_target("trn2")
    assert plan_decode(decode_node(8, 512), target).key_chunks == 4
    assert plan_decode(decode_node(16, 4096), target).key_chunks == 32  # 32 chunks x 16 rows: one PSUM bank
    row_mask = ir.Load("m", ir.Layout((2, 8, 512), (512, 0, 1), 0), "bfloat16")  # the same for every row
    assert plan_decode(decode_node(8, 512, mask=row_mask), target).mask_bias
    declined = [
        decode_node(DECODE_MAX_ROWS + 1, 512),  # rows enough for the flash kernel's query tiles
        decode_node(8, 128),  # one chunk of keys: the flash kernel's shorter chain
        decode_node(16, 4097),  # 33 chunks x 16 rows of fp32 scores exceed one PSUM bank
        decode_node(8, 512, value_dim=512),  # P @ [v | 1] needs Dv + 1 columns of one bank
        decode_node(1, 65536),  # one head's k^T and v (192 KiB per partition) over the SBUF budget
        decode_node(8, 512, causal=True),
        decode_node(8, 512, mask=contiguous_load((2, 8, 512))),  # a mask per row: its transpose would meet zeros
        decode_node(8, 512, split_keys=False),  # config flash_decode off
    ]
    assert [plan_decode(node, target) for node in declined] == [None] * len(declined)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("depth", [64, 128])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_static_cache_step_matches_eager_at_the_caches_edges(kv_heads, depth, dtype):
    """A decode step against a static cache of 256 (two chunks) at positions 0, 1, 127 and 255, one batch row
    each: q transposed on TensorE (scaled on its way out of PSUM), the clamped reciprocal of the sums in one
    instruction, the tiles' normalizations alternating between VectorE and ScalarE (4 heads per key/value head,
    so 8 tiles with one key/value head, 16 with two)."""
    positions = [0, 1, 127, 255]
    q, k, v = decode_inputs(len(positions), 4 * kv_heads, kv_heads, 1, 256, depth, dtype)
    mask = cache_mask(len(positions), 256, positions, dtype)
    region = check_against_eager(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m, enable_gqa=True), q, k, v, mask,
                                 tolerances=TOLERANCES)
    source = attention_source(region)
    assert SPLIT in source and "nisa.nc_transpose(dst=transposed_q" in source
    assert "nisa.activation(dst=" in source and "op1=nl.reciprocal" in source
