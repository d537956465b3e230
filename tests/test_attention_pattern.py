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


def rewrites_to_sdpa(fn, *args, folder) -> bool:
    """Whether the attention pattern pass put an SDPA node in ``fn``'s graph (its dump, compiling ``fn``)."""
    torch._dynamo.reset()
    with neuron_compile.config.patch(dump_dir=str(folder)):
        torch.compile(fn, backend="neuron")(*args)
    (dumped,) = folder.glob("graph_*/*/passes/*attention_pattern.txt")
    return "scaled_dot_product_attention" in dumped.read_text()


def test_masks_from_inputs_and_fully_masked_rows_give_eager_nan_rows(tmp_path):
    """A mask computed from the inputs (nanoGPT's registered ``bias``) or a constant one with an empty row: the
    kernel would give 0 on a fully masked row where eager's softmax gives NaN, so the rewrite adds NaN there."""
    q, k, v = qkv((1, 4, 64, 32))
    keep = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) > 0.5
    keep[3] = False
    bias = torch.ones(1, 1, 80, 80).tril()

    def input_mask(q, k, v, keep):
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf")), dim=-1) @ v

    def constant_mask(q, k, v):
        masked = torch.zeros(64, 64, dtype=torch.bool)
        masked[3] = True
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(masked, float("-inf")), dim=-1) @ v

    def nanogpt(q, k, v, bias):
        seq = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
        att = att.masked_fill(bias[:, :, :seq, :seq] == 0, float("-inf"))
        return torch.softmax(att, dim=-1) @ v

    def additive_input(q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1) @ v

    additive = torch.zeros(1, 1, 64, 64).masked_fill(~keep, float("-inf"))
    for index, (fn, args) in enumerate(((input_mask, (q, k, v, keep)), (constant_mask, (q, k, v)),
                                        (nanogpt, (q, k, v, bias)), (additive_input, (q, k, v, additive)))):
        assert rewrites_to_sdpa(fn, *args, folder=tmp_path / str(index))
        check_through_backend(fn, *args)  # NaN rows equal eager's
    assert torch.isnan(torch.compile(input_mask, backend="neuron")(q, k, v, keep)[0, :, 3]).all()


def test_probabilities_read_elsewhere_keep_the_graph_as_written(tmp_path):
    def with_probabilities(q, k, v):
        probabilities = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return probabilities @ v, probabilities

    q, k, v = qkv((1, 2, 64, 32))
    assert not rewrites_to_sdpa(with_probabilities, q, k, v, folder=tmp_path)
    check_through_backend(with_probabilities, q, k, v)


def test_a_mask_per_batch_keeps_the_graph_as_written(tmp_path):
    """SDPA runs on the [batch x heads, 1, ...] views of the bmm operands: a mask with its own batch dim would need
    repeating over the heads."""
    q, k, v = qkv((2, 2, 16, 32))
    padding = torch.zeros(2, 1, 1, 16)
    padding[1, ..., 12:] = float("-inf")

    def padded(q, k, v, padding):
        return torch.softmax(q @ k.transpose(-1, -2) + padding, dim=-1) @ v

    assert not rewrites_to_sdpa(padded, q, k, v, padding, folder=tmp_path)
    check_through_backend(padded, q, k, v, padding)


def test_the_rewrite_follows_the_flash_attention_switch():
    q, k, v = qkv((1, 2, 64, 32))
    with neuron_compile.config.patch(flash_attention=False):
        stats = check_through_backend(causal_attention, q, k, v)
    assert not only_qkv_and_output_cross_hbm(stats, q)


def test_a_block_reading_the_attention_through_views_matches_eager():
    """The demo's block: q, k, v split from one projection and transposed, the output transposed back and
    reshaped for the projection after it. The rewritten attention must leave those readers' strides as traced."""
    from neuron_compile.demo import TinyDecoderBlock

    torch.manual_seed(0)
    block = TinyDecoderBlock().eval()
    with torch.no_grad():
        check_through_backend(block, random_tensor((2, 16, 64), seed=4))


def test_a_mask_from_a_split_constant_is_evaluated_without_failing():
    """A mask computed through a node of several outputs (MPT's split_with_sizes) is not taken as a constant; the
    pass used to fail on that node's list of values, which sent the whole graph eager."""

    def split_mask_attention(q, k, v):
        seq = q.shape[-2]
        mask, _ = torch.split(torch.full((2 * seq, seq), float("-inf")).triu(1), [seq, seq])
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + mask
        return torch.softmax(scores, dim=-1) @ v

    q, k, v = qkv((1, 2, 40, 32))
    check_through_backend(split_mask_attention, q, k, v)


def test_attention_over_transposed_heads_matches_eager():
    """q, k, v as [batch, seq, heads, dim] memory seen as [batch, heads, seq, dim] (diffusers' processors): SDPA
    lays its output out as the query, the readers traced on the bmm's contiguous output get it contiguous."""
    for seq in (1, 127, 129):
        q, k, v = (tensor.transpose(1, 2) for tensor in qkv((1, seq, 2, 12)))
        check_through_backend(plain_attention, q, k, v)
        check_through_backend(lambda q, k, v: causal_attention(q, k, v).transpose(1, 2).contiguous(), q, k, v)
