"""flex_attention runs as the ATen ops of its reference (passes/flex_attention.py), every node in kernels (fp32:
the flash-attention kernel), with eager's results: no mask, a causal mask, a mask and a score modification reading
captured tensors, fully masked rows, a block mask whose block lists are sparser than its mask (the reference, and
eager, compute every block). Unsupported dtypes stay eager and are counted as eager nodes."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import neuron_compile
from lowering_harness import check_through_backend, random_tensor


def qkv(batch: int, heads: int, seq: int, dim: int, dtype=torch.float32):
    return tuple(random_tensor((batch, heads, seq, dim), dtype, seed=seed) for seed in (1, 2, 3))


def causal(batch, head, q_index, kv_index):
    return q_index >= kv_index


@pytest.mark.parametrize("seq", [1, 127, 128, 129])
def test_flex_attention_without_and_with_a_causal_mask_matches_eager(seq):
    q, k, v = qkv(1, 2, seq, 16)
    mask = create_block_mask(causal, None, None, seq, seq, device="cpu")
    check_through_backend(lambda q, k, v: flex_attention(q, k, v), q, k, v)
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v)


@pytest.mark.parametrize("masked", [False, True])
def test_fp32_flex_attention_is_the_flash_kernel(masked):
    """Unmasked or causal, the reference's softmax(q @ k^T * scale) @ v is matched as attention
    (passes/attention_pattern.py): the [heads, queries, keys] scores never cross HBM."""
    q, k, v = qkv(1, 2, 256, 16)
    mask = create_block_mask(causal, None, None, 256, 256, device="cpu") if masked else None
    stats = check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v)
    scores_bytes = 2 * 256 * 256 * 4
    assert stats["hbm_bytes"] < scores_bytes, stats["hbm_bytes"]


def test_fully_masked_rows_are_zero_as_in_eager():
    """Every third query attends nothing: the reference's safe softmax gives 0 there, and so does the kernel."""
    q, k, v = qkv(1, 2, 130, 16)

    def every_third_row_closed(batch, head, q_index, kv_index):
        return (kv_index <= q_index) & (q_index % 3 != 0)

    mask = create_block_mask(every_third_row_closed, None, None, 130, 130, device="cpu")
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v)


def test_mask_and_score_modifications_reading_captured_tensors_match_eager():
    # A sliding window of 40 keys over 130 tokens (ragged against the 128-token blocks), and a per-head bias on the
    # distance read from a captured float tensor.
    q, k, v = qkv(1, 2, 130, 32)
    slope = torch.tensor([0.5, -0.25])

    def window(batch, head, q_index, kv_index):
        return (q_index - kv_index).abs() < 40

    def distance_bias(score, batch, head, q_index, kv_index):
        return score + slope[head] * (q_index - kv_index)

    mask = create_block_mask(window, None, None, 130, 130, device="cpu")
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, score_mod=distance_bias, block_mask=mask),
                          q, k, v)


def test_a_mask_gathering_int64_ids_runs_that_gather_eagerly_with_its_reason():
    # Documents of 50, 40 and 40 tokens: the int64 ids' values are unknown at compile time (integer math runs in
    # fp32), so their two gathers stay eager; the attention itself is in kernels.
    q, k, v = qkv(1, 2, 130, 32)
    document = torch.repeat_interleave(torch.arange(3), torch.tensor([50, 40, 40]))

    def same_document(batch, head, q_index, kv_index):
        return document[q_index] == document[kv_index]

    mask = create_block_mask(same_document, None, None, 130, 130, device="cpu")
    stats = check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v, eager_nodes=2)
    assert all("int64" in reason for reason in stats["fallback_reasons"]), stats["fallback_reasons"]


def test_sparse_block_lists_are_not_read_as_eager_does_not():
    """A mask without a mask function whose block lists keep one key block per query block (NABLA's form): eager's
    reference computes every key block, and so does the rewrite."""
    q, k, v = qkv(1, 2, 256, 16)
    one_block = torch.ones(1, 2, 2, dtype=torch.int32)
    diagonal = torch.arange(2, dtype=torch.int32).view(1, 1, 2, 1).expand(1, 2, 2, 2).contiguous()
    mask = BlockMask.from_kv_blocks(torch.zeros_like(one_block), diagonal, one_block, diagonal, BLOCK_SIZE=128)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask), flex_attention(q, k, v))
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v)


def test_bf16_flex_attention_matches_eager():
    q, k, v = qkv(1, 2, 96, 32, torch.bfloat16)
    mask = create_block_mask(causal, None, None, 96, 96, device="cpu")
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v)


def test_float64_flex_attention_stays_eager_and_is_counted():
    q, k, v = qkv(1, 2, 16, 8, torch.float64)
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    got = torch.compile(lambda q, k, v: flex_attention(q, k, v), backend="neuron", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, flex_attention(q, k, v))
    reasons = neuron_compile.stats()["fallback_reasons"]
    assert any(reason.startswith("higher_order.flex_attention:") for reason in reasons), reasons


def test_flex_attention_over_transposed_heads_matches_eager():
    # [batch, seq, heads, dim] memory seen as [batch, heads, seq, dim], as diffusers' processors pass it
    q, k, v = (tensor.transpose(1, 2) for tensor in qkv(1, 128, 2, 12))
    mask = create_block_mask(causal, None, None, 128, 128, device="cpu")
    check_through_backend(lambda q, k, v: flex_attention(q, k, v), q, k, v)
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, block_mask=mask), q, k, v)


def test_the_reference_is_traced_while_dynamo_compiles_never_at_call_time(monkeypatch):
    # make_fx sets FX's process-wide "tracing now" flag: set at call time (a compiled graph's first call of a
    # signature), it breaks other threads' compiled calls (passes/specialize.py). Traces happen in the backend.
    from neuron_compile.passes import flex_attention as flex_pass
    from neuron_compile.runtime import compiled_graph

    calling, traced_during_calls, traces = [False], [], []
    graph_call, make_fx = compiled_graph.CompiledGraph.__call__, flex_pass.make_fx

    def call(self, args):
        calling[0] = True
        try:
            return graph_call(self, args)
        finally:
            calling[0] = False

    def spied_make_fx(*args, **kwargs):
        traces.append(True)
        traced_during_calls.append(calling[0])
        return make_fx(*args, **kwargs)

    monkeypatch.setattr(compiled_graph.CompiledGraph, "__call__", call)
    monkeypatch.setattr(flex_pass, "make_fx", spied_make_fx)
    q, k, v = qkv(1, 2, 64, 16)
    check_through_backend(lambda q, k, v: flex_attention(q, k, v, score_mod=None), q, k, v)
    assert traces and not any(traced_during_calls)
