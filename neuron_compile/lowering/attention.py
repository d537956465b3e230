"""Lowering stage, attention: scaled-dot-product attention (kept whole by the front end's decompositions).

Input: an ATen FX node (``aten.scaled_dot_product_attention`` or its CPU flash variant). Output: one
``ir.Attention`` node (the flash-attention kernel: the scores never leave the chip), or, where that kernel does
not apply (head dims, a negative scale, ``flash_attention`` off in the config), three IR nodes — scores =
q @ k^T * scale (+ additive mask) as a MatMul with an epilogue, the row softmax (a RowNormalize, with the causal
mask applied on chip), and probabilities @ v as a MatMul; and the output value (a 1-tuple plus an unused
logsumexp slot for the flash variant).
"""

from __future__ import annotations

import math
import operator

import torch

from neuron_compile import ir
from neuron_compile.hardware import Target
from neuron_compile.lowering.reduction import softmax_row_reason
from neuron_compile.lowering.registry import LoweringError, TensorValue, broadcast_layout, register_lowering
from neuron_compile.tiles import flash_attention_reason

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA = aten.scaled_dot_product_attention.default


def _options(node: torch.fx.Node) -> dict:
    names = ("dropout_p", "is_causal") if node.target is FLASH else ("attn_mask", "dropout_p", "is_causal", "scale")
    options = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    options.update(dict(zip(names, node.args[3:])))
    options.update(node.kwargs)
    return options


def _check_attention(node: torch.fx.Node, target: Target) -> str | None:
    options = _options(node)
    q, k, v = (arg.meta["val"] for arg in node.args[:3])
    if options["dropout_p"]:
        return f"{node.target}: dropout_p={options['dropout_p']} (no dropout in kernels)"
    grouped = q.dim() >= 3 and k.shape == v.shape and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0
    same_batch = q.shape[:-3] == k.shape[:-3] == v.shape[:-3]
    if q.dim() < 3 or not same_batch or not grouped:
        return f"{node.target}: batch/head dims differ: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16):
        return f"{node.target}: dtypes {q.dtype}, {k.dtype}, {v.dtype} (one of float32, bfloat16)"
    mask = options["attn_mask"]
    if mask is not None and (not isinstance(mask, torch.fx.Node) or mask.meta["val"].dtype == torch.bool):
        return f"{node.target}: a boolean attn_mask needs a predicated select (only additive float masks)"
    if mask is not None and options["is_causal"]:
        return f"{node.target}: attn_mask together with is_causal"
    scale = options["scale"] if options["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    # the flash kernel takes any number of keys; the three-kernel form needs the whole score row in SBUF
    flash = flash_attention_reason(q.shape[-1], v.shape[-1], scale, target) is None
    row_reason = None if flash else softmax_row_reason(node, k.shape[-2], target)
    if row_reason:
        return row_reason
    if node.target is FLASH and logsumexp_used(node) and not flash:
        return f"{node.target}: its logsumexp output is used (the flash kernel writes it; not at head dim {q.shape[-1]})"
    return None


def logsumexp_used(node: torch.fx.Node) -> bool:
    """Whether the flash variant's second output (training saves it for the backward) is read."""
    return any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in node.users)


@register_lowering(FLASH, target_check=_check_attention, multi_output=True)
def lower_flash_attention(ctx, node):
    logsumexp = ctx.new_buffer(node.meta["val"][1], "logsumexp") if logsumexp_used(node) else None
    out = _lower(ctx, node, node.meta["val"][0], logsumexp)
    return (out, TensorValue(logsumexp.name, logsumexp.layout, logsumexp.dtype) if logsumexp else None)


@register_lowering(SDPA, target_check=_check_attention)
def lower_attention(ctx, node):
    return _lower(ctx, node, node.meta["val"])


def _swap_last(layout: ir.Layout) -> ir.Layout:
    shape, strides = list(layout.shape), list(layout.strides)
    shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
    return ir.Layout(tuple(shape), tuple(strides), layout.offset)


def split_heads(layout: ir.Layout, kv_heads: int, group: int) -> ir.Layout:
    """[..., H, S, D] as [..., H_kv, group, S, D]: query head h uses key/value head h // group."""
    *lead, heads, seq, depth = layout.shape
    *lead_strides, head_stride, seq_stride, depth_stride = layout.strides
    return ir.Layout((*lead, kv_heads, group, seq, depth),
                     (*lead_strides, head_stride * group, head_stride, seq_stride, depth_stride), layout.offset)


def share_heads(layout: ir.Layout, group: int) -> ir.Layout:
    """[..., H_kv, S, D] broadcast (stride 0) over a group dim: [..., H_kv, group, S, D]."""
    shape, strides = list(layout.shape), list(layout.strides)
    shape.insert(-2, group)
    strides.insert(-2, 0)
    return ir.Layout(tuple(shape), tuple(strides), layout.offset)


def fold_group(layout: ir.Layout, shared: bool) -> ir.Layout:
    """[..., H_kv, group, 1, X] as [..., H_kv, 1, group, X]: a one-query (decode) step's query heads of one group
    become the rows of one query tile, which share the group's keys and values, instead of a tile of one row each
    (every VectorE / ScalarE instruction over the scores then does the group's work at once). ``shared``: k or v,
    [..., H_kv, group (stride 0), S, D], whose group dim becomes a dim of one."""
    shape, strides = list(layout.shape), list(layout.strides)
    if shared:
        shape[-3] = 1
    else:
        shape[-3], shape[-2] = shape[-2], shape[-3]
        strides[-3], strides[-2] = strides[-2], strides[-3]
    return ir.Layout(tuple(shape), tuple(strides), layout.offset)


VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def repeated_heads(arg) -> tuple[torch.fx.Node, int] | None:
    """(x, group) when ``arg`` repeats each head of ``x`` [B, H_kv, S, D] ``group`` times, as transformers'
    ``repeat_kv`` does before SDPA when it does not pass ``enable_gqa``:
    ``view(clone(expand(unsqueeze(x, 2), [B, H_kv, group, S, D])), [B, H_kv * group, S, D])``. Attention reads x
    with a stride-0 group dim instead, and the repeating copy, read by nothing else, is pruned."""
    if not isinstance(arg, torch.fx.Node) or arg.target not in VIEWS:
        return None
    inner = arg.args[0]
    if isinstance(inner, torch.fx.Node) and inner.target is aten.clone.default:
        inner = inner.args[0]
    if not isinstance(inner, torch.fx.Node) or inner.target is not aten.expand.default:
        return None
    unsqueezed = inner.args[0]
    if not isinstance(unsqueezed, torch.fx.Node) or unsqueezed.target is not aten.unsqueeze.default \
            or unsqueezed.args[1] not in (2, -3):
        return None
    source = unsqueezed.args[0]
    shape, sizes = list(source.meta["val"].shape), list(inner.args[1])
    if len(shape) != 4 or len(sizes) != 5 or [*sizes[:2], *sizes[3:]] != shape:
        return None
    group = sizes[2]
    if list(arg.meta["val"].shape) != [shape[0], shape[1] * group, *shape[2:]]:
        return None
    return source, group


def _unrepeated(ctx, k_arg, v_arg) -> tuple[TensorValue, TensorValue] | None:
    """k and v before a ``repeat_kv`` of both by the same group (see ``repeated_heads``), or None."""
    k_source, v_source = repeated_heads(k_arg), repeated_heads(v_arg)
    if k_source is None or v_source is None or k_source[1] != v_source[1]:
        return None
    return ctx.value(k_source[0]), ctx.value(v_source[0])


def _lower(ctx, node, out_meta, logsumexp: ir.Buffer | None = None) -> TensorValue:
    options = _options(node)
    q, k, v = (ctx.value(arg) for arg in node.args[:3])
    unrepeated = _unrepeated(ctx, *node.args[1:3])
    if unrepeated is not None:  # grouped-query attention that transformers spelled out as a copy
        k, v = unrepeated
    out = ctx.new_buffer(out_meta, "attention")
    out_layout = out.layout
    unsplit_scores = (*q.layout.shape[:-1], k.layout.shape[-2])  # [..., H, Sq, Sk] as eager broadcasts masks to
    kv_heads = k.layout.shape[-3]
    group = q.layout.shape[-3] // kv_heads
    if group > 1:  # grouped-query attention: a group dim, stride 0 in k and v, instead of repeating them
        q = TensorValue(q.buffer, split_heads(q.layout, kv_heads, group), q.dtype)
        k = TensorValue(k.buffer, share_heads(k.layout, group), k.dtype)
        v = TensorValue(v.buffer, share_heads(v.layout, group), v.dtype)
        out_layout = split_heads(out.layout, kv_heads, group)
    # Decode (one query, no causal diagonal to place): the group's query heads as the query tile's rows.
    folded = group > 1 and q.layout.shape[-2] == 1 and not options["is_causal"]
    if folded:
        q = TensorValue(q.buffer, fold_group(q.layout, shared=False), q.dtype)
        k = TensorValue(k.buffer, fold_group(k.layout, shared=True), k.dtype)
        v = TensorValue(v.buffer, fold_group(v.layout, shared=True), v.dtype)
        out_layout = fold_group(out_layout, shared=False)
    *batch, queries, depth = q.layout.shape
    keys = k.layout.shape[-2]
    scale = options["scale"] if options["scale"] is not None else 1.0 / math.sqrt(depth)
    mask = None
    if options["attn_mask"] is not None:
        mask_value = ctx.value(options["attn_mask"])
        mask_layout = broadcast_layout(mask_value.layout, unsplit_scores)
        if group > 1:
            mask_layout = split_heads(mask_layout, kv_heads, group)
        if folded:
            mask_layout = fold_group(mask_layout, shared=False)
        mask = ir.Load(mask_value.buffer, broadcast_layout(mask_layout, (*batch, queries, keys)), mask_value.dtype)
    if ctx.flash_attention and flash_attention_reason(depth, v.layout.shape[-1], scale, ctx.target) is None:
        logsumexp_store = None
        if logsumexp is not None:  # [..., H, Sq] as a (P, 1) column per query tile: stride 0 on the head dim
            rows = ir.Layout((*logsumexp.layout.shape, 1), (*logsumexp.layout.strides, 0), logsumexp.layout.offset)
            rows = split_heads(rows, kv_heads, group) if group > 1 else rows
            rows = fold_group(rows, shared=False) if folded else rows
            layout = ir.Layout(out_layout.shape, (*rows.strides[:-1], 0), rows.offset)
            logsumexp_store = ir.Store(logsumexp, ir.Result(), layout)
        ctx.emit(ir.Attention(ctx.fresh_name("kernel"), out_layout.shape, ir.Load(q.buffer, q.layout, q.dtype),
                              ir.Load(k.buffer, k.layout, k.dtype), ir.Load(v.buffer, v.layout, v.dtype), mask,
                              float(scale), bool(options["is_causal"]), (ir.Store(out, ir.Result(), out_layout),),
                              logsumexp_store, split_keys=ctx.flash_decode))
        return TensorValue(out.name, out.layout, out.dtype)
    if logsumexp is not None:
        raise LoweringError(f"{node.target}: its logsumexp output needs the flash kernel (flash_attention is off)")
    score_domain = (*batch, queries, keys)
    scores = ctx.scratch_buffer(score_domain, "float32", "scores")
    expr = ir.Op("mul", (ir.Result(), ir.Scalar(float(scale))))
    if mask is not None:
        expr = ir.Op("add", (expr, mask))
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), score_domain, depth, ir.Load(q.buffer, q.layout, q.dtype),
                       ir.Load(k.buffer, _swap_last(k.layout), k.dtype), (ir.Store(scores, expr, scores.layout),)))
    # The probabilities feed TensorE again, so they take the operands' dtype (fp32 and bf16 cannot mix).
    probabilities = ctx.scratch_buffer(score_domain, q.dtype, "probabilities")
    ctx.emit(ir.RowNormalize(ctx.fresh_name("kernel"), score_domain, len(score_domain) - 1, "softmax",
                             ir.Load(scores.name, scores.layout, "float32"),
                             (ir.Store(probabilities, ir.Result(), probabilities.layout),),
                             causal=bool(options["is_causal"])))
    ctx.emit(ir.MatMul(ctx.fresh_name("kernel"), out_layout.shape, keys,
                       ir.Load(probabilities.name, probabilities.layout, q.dtype), ir.Load(v.buffer, v.layout, v.dtype),
                       (ir.Store(out, ir.Result(), out_layout),)))
    return TensorValue(out.name, out.layout, out.dtype)
