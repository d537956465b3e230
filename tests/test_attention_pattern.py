"""Attention written by hand (softmax(q @ k^T * scale, masked) @ v) runs as the flash-attention kernel
(passes/attention_pattern.py): results equal eager's, and only q, k, v and the output cross HBM. Where the rewrite
could change a result (a mask from the graph's inputs, a fully masked row, probabilities read elsewhere) or is
turned off, the graph runs as written."""

from __future__ import annotations

import math

import torch

import neuron_compile
from lowering_harness import check_through_backend, random_tensor

FLOAT_BYTES = {torch.float32: 4, torch.bfloat16: 2}


def causal_attention(q, k, v):
    seq = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def eager_style_attention(q, k, v):
    """transformers' eager attention: a scaled product, an additive mask, the softmax in fp32 cast back."""
    seq = q.shape[-2]
    mask = torch.full((seq, seq), float("-inf"), dtype=q.dtype).triu(1)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def plain_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def qkv(shape, dtype=torch.float32):
    return tuple(random_tensor(shape, dtype, seed=seed) for seed in (1, 2, 3))


def only_qkv_and_output_cross_hbm(stats, q) -> bool:
    return stats["hbm_bytes"] == 4 * q.numel() * FLOAT_BYTES[q.dtype]


def test_causal_attention_by_hand_is_one_flash_kernel():
    for shape in ((1, 4, 130, 64), (2, 2, 1, 32), (1, 2, 128, 128)):
        q, k, v = qkv(shape)
        stats = check_through_backend(causal_attention, q, k, v)
        assert only_qkv_and_output_cross_hbm(stats, q), stats["hbm_bytes"]


def test_unmasked_and_transformers_style_attention():
    q, k, v = qkv((1, 3, 100, 64))
    assert only_qkv_and_output_cross_hbm(check_through_backend(plain_attention, q, k, v), q)
    assert only_qkv_and_output_cross_hbm(check_through_backend(eager_style_attention, q, k, v), q)


def test_bf16_is_closer_to_the_fp32_result_than_eager():
    """The kernel keeps the scores and the softmax in fp32 where eager rounds them to bf16 between ops."""
    q, k, v = qkv((1, 4, 256, 64), torch.bfloat16)
    torch._dynamo.reset()
    neuron_compile.reset_stats()
    compiled, stats = torch.compile(causal_attention, backend="neuron")(q, k, v), neuron_compile.stats()
    reference = causal_attention(q.float(), k.float(), v.float())
    eager_error = (causal_attention(q, k, v).float() - reference).abs().max()
    assert (compiled.float() - reference).abs().max() <= eager_error
    assert only_qkv_and_output_cross_hbm(stats, q)


def test_masks_that_could_empty_a_row_keep_the_graph_as_written():
    q, k, v = qkv((1, 2, 16, 32))
    keep = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) > 0.5
    keep[3] = False  # a fully masked row: NaN in eager's softmax

    def input_mask(q, k, v, keep):
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf")), dim=-1) @ v

    def constant_mask(q, k, v):
        masked = torch.zeros(16, 16, dtype=torch.bool)
        masked[3] = True
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(masked, float("-inf")), dim=-1) @ v

    for fn, args in ((input_mask, (q, k, v, keep)), (constant_mask, (q, k, v))):
        stats = check_through_backend(fn, *args)  # NaN rows equal eager's
        assert not only_qkv_and_output_cross_hbm(stats, q)
        assert torch.isnan(torch.compile(fn, backend="neuron")(*args)[0, 0, 3]).all()


def test_probabilities_read_elsewhere_keep_the_graph_as_written():
    def with_probabilities(q, k, v):
        probabilities = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return probabilities @ v, probabilities

    q, k, v = qkv((1, 2, 64, 32))
    assert not only_qkv_and_output_cross_hbm(check_through_backend(with_probabilities, q, k, v), q)


def test_the_rewrite_follows_the_flash_attention_switch():
    q, k, v = qkv((1, 2, 64, 32))
    with neuron_compile.config.patch(flash_attention=False):
        stats = check_through_backend(causal_attention, q, k, v)
    assert not only_qkv_and_output_cross_hbm(stats, q)
