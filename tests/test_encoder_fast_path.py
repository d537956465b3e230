"""The eval fast path of torch.nn's transformer modules (passes/decompose_transformer.py) through the backend vs
eager: ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` (one ``aten._transformer_encoder_layer_fwd`` node
each layer) and ``torch._native_multi_head_attention``, with their masks, activations, norm placement, weights
output and dtypes; every ATen node in kernels, the attention as the flash kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import neuron_compile
from lowering_harness import TOLERANCES, compile_with_backend, random_tensor
from neuron_compile.runtime import graph_records

BATCH, LENGTH, EMBED, HEADS = 2, 37, 32, 4


def encoder_layer(dtype=torch.float32, **options) -> nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    options = {"dropout": 0.0, "batch_first": True, **options}
    return nn.TransformerEncoderLayer(EMBED, HEADS, 64, **options).eval().to(dtype)


def padding_mask(padded_rows: dict[int, int]) -> torch.Tensor:
    """[BATCH, LENGTH] booleans, True from each batch index's given position on (padding)."""
    mask = torch.zeros(BATCH, LENGTH, dtype=torch.bool)
    for batch, start in padded_rows.items():
        mask[batch, start:] = True
    return mask


def check_eval(fn, *inputs, **kwargs):
    """``fn`` compiled under no_grad equals eager (nan where eager has nan), with no eager ATen node; returns the
    stats and the ATen graphs' targets."""
    with torch.no_grad():
        want = fn(*inputs, **kwargs)
        got, stats = compile_with_backend(lambda *args: fn(*args, **kwargs), *inputs)
    for actual, expected in zip(_tensors(got), _tensors(want)):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
        rtol, atol = TOLERANCES[expected.dtype]
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    assert stats["fallback_nodes"] == 0, stats["fallback_reasons"]
    assert stats["nki_nodes"] > 0
    return stats


def _tensors(value):
    return [t for t in (value if isinstance(value, tuple) else (value,)) if t is not None]


def aten_graph_text(fn, *inputs, **kwargs) -> str:
    """``fn``'s ATen graphs as the backend compiled them (after decompositions), as FX text."""
    graph_records.clear_records()  # only the compiles below
    check_eval(fn, *inputs, **kwargs)
    return "\n".join(record.aten_graph for record in neuron_compile.compiled_records())


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_runs_in_kernels(activation, norm_first):
    layer = encoder_layer(activation=activation, norm_first=norm_first)
    x = random_tensor((BATCH, LENGTH, EMBED), seed=1)
    graph = aten_graph_text(layer, x)
    assert "_transformer_encoder_layer_fwd" not in graph
    assert "_scaled_dot_product_flash_attention_for_cpu" in graph  # the flash kernel's op


@pytest.mark.parametrize("masks", ["padding", "float causal", "bool src", "both bool", "a fully padded batch"])
def test_encoder_layer_masks(masks):
    layer = encoder_layer()
    x = random_tensor((BATCH, LENGTH, EMBED), seed=2)
    causal = nn.Transformer.generate_square_subsequent_mask(LENGTH)
    random_keys = random_tensor((LENGTH, LENGTH), seed=3) > 1.2
    kwargs = {
        "padding": {"src_key_padding_mask": padding_mask({1: 30})},
        "float causal": {"src_mask": causal},
        "bool src": {"src_mask": random_keys},
        "both bool": {"src_mask": random_keys, "src_key_padding_mask": padding_mask({0: 20})},
        # every key of batch 0 masked: eager's softmax over -inf gives nan rows, the flash kernel zeros
        "a fully padded batch": {"src_key_padding_mask": padding_mask({0: 0, 1: 30})},
    }[masks]
    check_eval(layer, x, **kwargs)


def test_encoder_of_two_layers_with_padding_and_bf16():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(encoder_layer(), 2, enable_nested_tensor=False).eval()
    x = random_tensor((BATCH, LENGTH, EMBED), seed=4)
    stats = check_eval(encoder, x, src_key_padding_mask=padding_mask({1: 25}))
    assert stats["nki_nodes"] >= 2 * 30
    check_eval(encoder_layer(torch.bfloat16), random_tensor((BATCH, LENGTH, EMBED), torch.bfloat16, seed=5))


def test_encoder_layer_off_the_fast_path_also_runs_in_kernels():
    # batch_first=False and gradients enabled take nn's composite path (linear, SDPA, layer norm): no fast-path op
    x = random_tensor((LENGTH, BATCH, EMBED), seed=6)
    check_eval(encoder_layer(batch_first=False), x)


def native_attention(weights):
    """torch._native_multi_head_attention's parameters for EMBED, HEADS (qkv and output projections)."""
    qkv_weight, qkv_bias = weights[0] * 0.3, weights[1][0] * 0.1
    return qkv_weight, qkv_bias, weights[2] * 0.3, weights[1][1, :EMBED] * 0.1


@pytest.mark.parametrize("mask_type", [None, 0, 1, 2])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_native_multi_head_attention(mask_type, need_weights, average):
    x = random_tensor((BATCH, LENGTH, EMBED), seed=7)
    parameters = native_attention((random_tensor((3 * EMBED, EMBED), seed=8), random_tensor((2, 3 * EMBED), seed=9),
                                   random_tensor((EMBED, EMBED), seed=10)))
    mask = {
        None: None,
        0: random_tensor((LENGTH, LENGTH), seed=11) > 1.0,  # [T, T]
        1: torch.where(padding_mask({0: 0, 1: 20}), -1.0, 0.0),  # a float mask: any non-zero masks the key
        2: random_tensor((BATCH, HEADS, LENGTH, LENGTH), seed=12) > 1.0,
    }[mask_type]

    def attention(x, *parameters):
        qkv_weight, qkv_bias, proj_weight, proj_bias = parameters
        return torch._native_multi_head_attention(x, x, x, EMBED, HEADS, qkv_weight, qkv_bias, proj_weight,
                                                  proj_bias, mask, need_weights, average, mask_type)

    check_eval(attention, x, *parameters)


def test_native_multi_head_attention_with_distinct_query_key_and_value():
    # three inputs: three projections by the qkv weight's thirds (eager's cat of three matmuls)
    query, key, value = (random_tensor((BATCH, LENGTH, EMBED), seed=seed) for seed in (13, 14, 15))
    parameters = native_attention((random_tensor((3 * EMBED, EMBED), seed=8), random_tensor((2, 3 * EMBED), seed=9),
                                   random_tensor((EMBED, EMBED), seed=10)))

    def attention(query, key, value, qkv_weight, qkv_bias, proj_weight, proj_bias):
        return torch._native_multi_head_attention(query, key, value, EMBED, HEADS, qkv_weight, qkv_bias, proj_weight,
                                                  proj_bias, None, True, True)

    check_eval(attention, query, key, value, *parameters)
