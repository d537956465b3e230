"""Lowering stage, attention's backward: ``aten._scaled_dot_product_flash_attention_for_cpu_backward``.

Input: the ATen node (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=, scale=), whose forward
saved the log-sum-exp of every query row (the flash kernel writes it). Output: one ``ir.AttentionBackward``, the
fused kernel (kinds/attention_backward.py: nothing of size Sq x Sk crosses HBM), where it applies (head dims up to
128, its SBUF budget, ``flash_attention`` on); else five IR nodes, as flash attention's backward computes it, the
probabilities recomputed rather than saved:

    P  = exp(scale * q k^T + mask - logsumexp)   (masked keys: 0)     a MatMul with that epilogue
    dV = P^T dO                                                       a MatMul
    D  = rowsum(dO * out)                                             a Reduction (fp32)
    dS = P * (dO v^T - D)                                             a MatMul with that epilogue
    dQ = scale * dS k,   dK = scale * dS^T q                          two MatMuls

Grouped-query attention runs per query head over [..., H_kv, group, S, D] views (k and v repeated by stride 0);
dK and dV sum each group's per-head products (fp32) in a Reduction. P and dS (S x S) pass through HBM in the
operands' dtype.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.hardware import Target
from neuron_compile.lowering.attention import share_heads, split_heads
from neuron_compile.lowering.reduction import reduce_into
from neuron_compile.lowering.registry import TensorValue, broadcast_layout, register_lowering
from neuron_compile.tiles import attention_backward_reason

aten = torch.ops.aten
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _check_attention_backward(node: torch.fx.Node, target: Target) -> str | None:
    grad, q, k, v, out, logsumexp = (arg.meta["val"] for arg in node.args[:6])
    dropout_p, is_causal = node.args[6], node.args[7]
    mask = node.kwargs.get("attn_mask")
    if dropout_p:
        return f"{node.target}: dropout_p={dropout_p} (no dropout in kernels)"
    grouped = q.dim() >= 3 and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0
    if not grouped or not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]) or k.shape[-3:-1] != v.shape[-3:-1]:
        return f"{node.target}: batch/head dims differ: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if len({t.dtype for t in (grad, q, k, v, out)}) > 1 or q.dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtypes {q.dtype}, {k.dtype}, {v.dtype} (one of float32, bfloat16, all alike)"
    if mask is not None and (not isinstance(mask, torch.fx.Node) or mask.meta["val"].dtype == torch.bool):
        return f"{node.target}: a boolean attn_mask (only additive float masks)"
    if mask is not None and is_causal:
        return f"{node.target}: attn_mask together with is_causal"
    if logsumexp.dtype != torch.float32:
        return f"{node.target}: logsumexp dtype {logsumexp.dtype}"
    return None


def swap_last(load: ir.Load) -> ir.Load:
    """``load`` read with its last two dims swapped (a transposed matmul operand, no copy)."""
    shape, strides = list(load.layout.shape), list(load.layout.strides)
    shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
    return ir.Load(load.buffer, ir.Layout(tuple(shape), tuple(strides), load.layout.offset), load.dtype)


def row_statistic(value: TensorValue, domain: tuple[int, ...]) -> ir.Load:
    """A per-row value [..., S] read over ``domain`` [..., S, N]: stride 0 along the row."""
    layout = value.layout
    return ir.Load(value.buffer, ir.Layout(domain, (*layout.strides, 0), layout.offset), value.dtype)


def operand(value: TensorValue) -> ir.Load:
    return ir.Load(value.buffer, value.layout, value.dtype)


def with_layout(value: TensorValue, layout: ir.Layout) -> TensorValue:
    return TensorValue(value.buffer, layout, value.dtype)


def grouped(values: dict[str, TensorValue], kv_heads: int, group: int) -> dict[str, TensorValue]:
    """Grouped-query attention as [..., H_kv, group, S, D]: the query-side tensors split their heads, k and v
    repeat along the group dim (stride 0), the log-sum-exp [..., H, S] splits like the queries."""
    split = {name: with_layout(values[name], split_heads(values[name].layout, kv_heads, group))
             for name in ("grad", "q", "out")}
    shared = {name: with_layout(values[name], share_heads(values[name].layout, group)) for name in ("k", "v")}
    rows = values["logsumexp"].layout
    rows = split_heads(ir.Layout((*rows.shape, 1), (*rows.strides, 0), rows.offset), kv_heads, group)
    rows = ir.Layout(rows.shape[:-1], rows.strides[:-1], rows.offset)
    return {**split, **shared, "logsumexp": with_layout(values["logsumexp"], rows)}


@register_lowering(FLASH_BACKWARD, target_check=_check_attention_backward, multi_output=True)
def lower_flash_attention_backward(ctx, node):
    values = dict(zip(("grad", "q", "k", "v", "out", "logsumexp"), (ctx.value(arg) for arg in node.args[:6])))
    kv_heads = values["k"].layout.shape[-3]
    group = values["q"].layout.shape[-3] // kv_heads
    mask = node.kwargs.get("attn_mask")
    mask_value = ctx.value(mask) if mask is not None else None
    # [..., H, Sq, Sk] as eager broadcasts the mask, before grouped-query heads split H
    unsplit_scores = (*values["q"].layout.shape[:-1], values["k"].layout.shape[-2])
    if group > 1:  # each key/value head's gradients sum over the query heads of its group
        values = grouped(values, kv_heads, group)
    q, k, v = values["q"], values["k"], values["v"]
    *batch, queries, depth = q.layout.shape
    keys, value_dim = k.layout.shape[-2], v.layout.shape[-1]
    scale = node.kwargs.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(depth)
    scores = (*batch, queries, keys)
    mask_load = None
    if mask_value is not None:
        mask_layout = broadcast_layout(mask_value.layout, unsplit_scores)
        mask_layout = split_heads(mask_layout, kv_heads, group) if group > 1 else mask_layout
        mask_load = ir.Load(mask_value.buffer, mask_layout, mask_value.dtype)
    itemsize = 2 if q.dtype == "bfloat16" else 4
    fused = ctx.flash_attention and attention_backward_reason(depth, value_dim, queries, keys, itemsize, group > 1,
                                                              ctx.target) is None
    if fused:
        return fused_backward(ctx, node, values, scores, mask_load, scale, kv_heads, group)
    return separate_backward(ctx, node, values, scores, mask_load, scale, kv_heads, group)


def separate_backward(ctx, node, values: dict[str, TensorValue], scores, mask_load: ir.Load | None, scale: float,
                      kv_heads: int, group: int):
    """The five-kernel form (see the module docstring): P and dS pass through HBM."""
    grad, q, k, v, out, logsumexp = (values[name] for name in ("grad", "q", "k", "v", "out", "logsumexp"))
    *batch, queries, keys = scores
    depth, value_dim, rank = q.layout.shape[-1], v.layout.shape[-1], len(batch)
    logits = ir.op("mul", ir.Result(), ir.Scalar(scale))
    if mask_load is not None:
        logits = ir.op("add", logits, mask_load)
    probability = ir.op("exp", ir.op("sub", logits, row_statistic(logsumexp, scores)))
    if node.args[7]:  # is_causal: key j > query i has probability 0
        query_minus_key = ir.Iota(ir.Layout(scores, (0,) * rank + (1, -1), 0))
        probability = ir.op("where", ir.op("ge", query_minus_key, ir.Scalar(0.0)), probability, ir.Scalar(0.0))
    probabilities = ctx.scratch_buffer(scores, q.dtype, "probabilities")
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), scores, depth, operand(q), swap_last(operand(k)),
                       (ir.Store(probabilities, probability, probabilities.layout),)))
    p = ir.Load(probabilities.name, probabilities.layout, probabilities.dtype)

    grad_value = key_side_grad(ctx, node.meta["val"][2], "grad_value", (*batch, keys, value_dim), swap_last(p),
                               operand(grad), ir.Result(), group)

    # D = rowsum(dO * out), fp32: the softmax backward's per-row term
    row_dot = ctx.scratch_buffer((*batch, queries), "float32", "row_dot")
    reduce_into(ctx, row_dot, (*batch, queries, value_dim), (rank + 1,), "sum",
                ir.op("mul", operand(grad), operand(out)))
    row_dot_value = TensorValue(row_dot.name, row_dot.layout, row_dot.dtype)
    score_grad = ir.op("mul", p, ir.op("sub", ir.Result(), row_statistic(row_dot_value, scores)))
    score_grads = ctx.scratch_buffer(scores, q.dtype, "score_grads")
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), scores, value_dim, operand(grad), swap_last(operand(v)),
                       (ir.Store(score_grads, score_grad, score_grads.layout),)))
    ds = ir.Load(score_grads.name, score_grads.layout, score_grads.dtype)

    scaled = ir.op("mul", ir.Result(), ir.Scalar(scale))
    grad_query = ctx.new_buffer(node.meta["val"][0], "grad_query")
    layout = split_heads(grad_query.layout, kv_heads, group) if group > 1 else grad_query.layout
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), (*batch, queries, depth), keys, ds, operand(k),
                       (ir.Store(grad_query, scaled, layout),)))
    grad_key = key_side_grad(ctx, node.meta["val"][1], "grad_key", (*batch, keys, depth), swap_last(ds), operand(q),
                             scaled, group)
    return tuple(TensorValue(b.name, b.layout, b.dtype) for b in (grad_query, grad_key, grad_value))


def key_side_grad(ctx, meta, stem: str, domain, lhs: ir.Load, rhs: ir.Load, epilogue: ir.Expr, group: int):
    """dK or dV = lhs @ rhs over ``domain``; with grouped-query heads (``domain`` [..., H_kv, group, Sk, D]) each
    query head's product goes to an fp32 scratch buffer, summed over the group into the gradient."""
    buffer = ctx.new_buffer(meta, stem)
    if group == 1:
        ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, lhs.layout.shape[-1], lhs, rhs,
                           (ir.Store(buffer, epilogue, buffer.layout),)))
        return buffer
    per_head = ctx.scratch_buffer(domain, "float32", f"{stem}_per_head")
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), domain, lhs.layout.shape[-1], lhs, rhs,
                       (ir.Store(per_head, epilogue, per_head.layout),)))
    reduce_into(ctx, buffer, domain, (len(domain) - 3,), "sum", ir.Load(per_head.name, per_head.layout, "float32"))
    return buffer


def fused_backward(ctx, node, values: dict[str, TensorValue], scores, mask: ir.Load | None, scale: float,
                   kv_heads: int, group: int):
    """The one-kernel form: an ``ir.AttentionBackward`` writing dq, dk and dv (dk and dv stored with a stride-0
    group dim under grouped-query heads, which the kernel sums over)."""
    meta = node.meta["val"]
    grad_query, grad_key, grad_value = (ctx.new_buffer(meta[i], stem)
                                        for i, stem in enumerate(("grad_query", "grad_key", "grad_value")))
    query_layout, key_layout, value_layout = grad_query.layout, grad_key.layout, grad_value.layout
    if group > 1:
        query_layout = split_heads(query_layout, kv_heads, group)
        key_layout, value_layout = share_heads(key_layout, group), share_heads(value_layout, group)
    ctx.emit(ir.AttentionBackward(
        ctx.fresh_name("kernel"), scores, *(operand(values[name]) for name in ("grad", "q", "k", "v", "out",
                                                                               "logsumexp")),
        mask, scale, bool(node.args[7]), ir.Store(grad_query, ir.Result(), query_layout),
        ir.Store(grad_key, ir.Result(), key_layout), ir.Store(grad_value, ir.Result(), value_layout)))
    return tuple(TensorValue(b.name, b.layout, b.dtype) for b in (grad_query, grad_key, grad_value))
