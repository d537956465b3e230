"""Decomposition stage, the eval fast path of ``torch.nn``'s transformer modules:
``aten._transformer_encoder_layer_fwd`` (``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` in eval mode
without gradients) and ``aten._native_multi_head_attention`` (``torch._native_multi_head_attention``; Dynamo traces
``nn.MultiheadAttention`` through ``F.multi_head_attention_forward`` instead, which is already ATen) as the ATen ops
we lower.

Input: nothing (a constant). Output: ``transformer_decompositions()``, entries for the decomposition table
(passes/decompose.py). The encoder layer becomes layer norms, linears (relu or gelu between the feed-forward pair)
and the attention below; the attention becomes the qkv projection, and then

- with ``need_weights=False`` (what the encoder layer asks for): ``scaled_dot_product_attention``, one flash-attention
  kernel, with the mask as an additive 0 / -inf tensor;
- with ``need_weights=True``: scores, a masked softmax and the product, so the weights can be returned (averaged over
  the heads when ``average_attn_weights``, as ``sum / num_heads``, eager's order).

Eager's semantics kept on purpose (ATen's ``native_multi_head_attention_cpu`` and ``transformer.cpp``):
- the scale is ``1 / sqrt(head_dim)`` rounded to the input dtype (eager scales q by it, we scale the scores);
- any mask, boolean or float, is converted to boolean: a non-zero float (``-inf`` from ``_canonical_mask``, but
  also ``-1.0``) masks the key. ``mask_type`` 1 is a key-padding mask [B, T]; 0 and 2 broadcast to [B, H, T, T];
- a query row whose keys are all masked gives nan (eager's softmax over -inf), not the zeros SDPA gives: the
  attention output is selected to nan on those rows.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import torch

aten = torch.ops.aten
MULTI_HEAD_ATTENTION = aten._native_multi_head_attention.default
ENCODER_LAYER = aten._transformer_encoder_layer_fwd.default
KEY_PADDING = 1  # mask_type of a [batch, keys] mask (see nn.MultiheadAttention.merge_masks)
SCALAR_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (a Python number: a tensor made here would be traced into the graph)."""
    return float(SCALAR_TYPES.get(dtype, np.float64)(value))


def _project_qkv(query, key, value, qkv_weight, qkv_bias, num_heads):
    """q, k, v as [B, H, T, head_dim] (biases added, q not scaled); one matmul when the three inputs are one
    tensor, its bias in the matmul's epilogue."""
    embed_dim = qkv_weight.shape[1]
    if query is key and key is value:
        q, k, v = aten.linear(query, qkv_weight, qkv_bias).split(embed_dim, dim=-1)
    else:
        weights, biases = qkv_weight.split(embed_dim, dim=0), qkv_bias.split(embed_dim)
        q, k, v = (aten.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    head_dim = embed_dim // num_heads

    def heads(x):
        return x.view(x.shape[0], x.shape[1], num_heads, head_dim).transpose(1, 2)

    return heads(q), heads(k), heads(v)


def _masked_keys(mask, mask_type, batch, keys):
    """The mask as booleans (True: the key is masked), broadcastable to [B, H, T, T]."""
    masked = mask if mask.dtype == torch.bool else mask != 0
    if mask_type == KEY_PADDING:
        masked = masked.view(batch, 1, 1, keys)
    return masked


def _nan_where_every_key_is_masked(out, masked):
    """``out`` [B, H, T, D] with nan on the query rows whose keys are all masked (eager's softmax of -inf): plus nan
    there, plus 0 elsewhere. An add, not a select: the term is constant along the head dim, so the attention kernel
    adds it to its output tile as a per-row column (a select would need its predicate broadcast over the tile)."""
    every_key = masked.all(dim=-1, keepdim=True)
    nan, zero = torch.full((), float("nan"), dtype=out.dtype), torch.zeros((), dtype=out.dtype)
    return out + torch.where(every_key, nan, zero)


def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    batch, length = query.shape[0], query.shape[1]
    q, k, v = _project_qkv(query, key, value, qkv_weight, qkv_bias, num_head)
    # eager scales q by 1/sqrt(head_dim) rounded to the input dtype; here the scores take that scale (the
    # flash kernel's scale=), the same product up to rounding
    scale = _rounded(1.0 / math.sqrt(q.shape[-1]), query.dtype)
    masked = None if mask is None else _masked_keys(mask, mask_type, batch, k.shape[2])
    weights = query.new_empty((0,))  # what eager's meta function returns without weights
    if need_weights:
        scores = (q @ k.transpose(-2, -1)) * scale
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probabilities = torch.softmax(scores, dim=-1)
        out = probabilities @ v
        weights = probabilities.sum(dim=1) / num_head if average_attn_weights else probabilities
    else:
        additive = None
        if masked is not None:
            additive = torch.zeros((), dtype=q.dtype).masked_fill(masked, float("-inf"))
        out = aten.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale)
        if masked is not None:
            out = _nan_where_every_key_is_masked(out, masked)
    out = out.transpose(1, 2).reshape(batch, length, embed_dim)
    return aten.linear(out, proj_weight, proj_bias), weights


def transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                              norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1,
                              ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    if src.numel() == 0:
        return src.clone()

    def norm(x, weight, bias):
        return aten.layer_norm(x, [embed_dim], weight, bias, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                    mask, False, True, mask_type)[0] + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    hidden = aten.linear(x, ffn_weight_1, ffn_bias_1)
    hidden = aten.gelu(hidden) if use_gelu else aten.relu(hidden)  # exact gelu: ATen's CPU _addmm_activation
    x = aten.linear(hidden, ffn_weight_2, ffn_bias_2) + residual
    return norm(x, norm_weight_2, norm_bias_2) if not norm_first else x


@functools.cache
def _table() -> dict:
    return {MULTI_HEAD_ATTENTION: native_multi_head_attention, ENCODER_LAYER: transformer_encoder_layer}


def transformer_decompositions() -> dict:
    """A fresh copy of the entries (``OpOverload -> decomposition``)."""
    return dict(_table())
