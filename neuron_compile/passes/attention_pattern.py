"""Specialization stage (graph pass, before ``partition``): attention written by hand becomes one SDPA node.

Input: an ATen GraphModule with shapes in ``node.meta["val"]`` (after ``specialize``). Output: the same graph, or
a copy in which each match of

    softmax(q @ k^T [/ c | * c] [masked: where(mask, -inf, scores) | + additive_mask], dim=-1) @ v

(the two products as the [batch x heads, seq, head_dim] bmms that matmul decomposes to) is one
``aten.scaled_dot_product_attention(q, k, v, attn_mask, scale=...)`` node over the bmms' own operands viewed as
[batch x heads, 1, seq, head_dim], whose output has the replaced bmm's shape and strides (the graph's readers stay
as traced), and which the lowering turns into the flash-attention kernel: the S x L scores and probabilities never
reach HBM (three kernels moved them through HBM twice). A mask must be one [queries, keys] matrix for every batch
and head (leading dims of size 1). A constant one (the aranges of a ``tril``) is evaluated here: the
lower-triangular boolean mask becomes ``is_causal=True`` (generated on chip), any other an additive float mask; a
mask computed from the graph's inputs (nanoGPT's ``bias`` buffer) is passed on, and where a row could be fully
masked (NaN in the softmax, 0 in the kernel) the output gets NaN added on those rows. Why: models and tutorials
write attention by hand (the kernel bench's causal attention, the demo's blocks, nanoGPT); Inductor's
``fuse_attention`` pass makes the same rewrite.

A match needs every intermediate (scores, probabilities) to have no other reader: a training graph that saves
the probabilities for the backward keeps its three kernels. The flash kernel computes the scores and softmax in
fp32 where a bf16 graph rounds them to bf16 between ops, so bf16 results differ from eager's by that rounding
(fp32: by an ulp or so). ``NEURON_COMPILE_FLASH_ATTENTION=0`` turns the rewrite off.

The softmax may be the safe one (``_safe_softmax``: 0 on a fully masked row, as the kernel gives), the form flex
attention's reference takes (passes/flex_attention.py); a mask is read through its expands (flex's vmapped mask is
a [queries, keys] one expanded over batch and heads), and a constant one that masks nothing is dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.fx

from neuron_compile.passes.graph_nodes import emit

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
# Views and copies that carry a 4-D [b, h, s, d] operand into the 3-D [b*h, s, d] form bmm takes.
CARRIERS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
            aten.clone.default)
MAX_EVALUATED_MASK = 1 << 24  # elements of a constant mask evaluated at compile time


@dataclasses.dataclass
class AttentionMatch:
    """One hand-written attention: its operands and the node whose value the SDPA node replaces."""

    q: torch.fx.Node  # the bmm operands: [batch x heads, queries, dim]
    k: torch.fx.Node  # [batch x heads, dim, keys]: k transposed
    v: torch.fx.Node  # [batch x heads, keys, dim]
    scale: float
    boolean_mask: torch.fx.Node | None  # a boolean mask of the scores (None: none)
    true_masks: bool  # the boolean mask is True where a key is masked out (where(mask, -inf, s)), else attended
    additive: torch.fx.Node | None  # an additive float mask
    output: torch.fx.Node  # the probabilities @ v bmm
    zero_rows: bool = False  # the softmax is the safe one: a fully masked row is 0, as in the kernel


def fuse_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each hand-written attention as one SDPA node (a copy), or ``gm`` itself when there is none."""
    if not any(_match(node) for node in gm.graph.nodes):
        return gm
    gm = copy.deepcopy(gm)
    for node in list(gm.graph.nodes):
        found = _match(node)
        if found is not None:
            _replace(gm.graph, found)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _unviewed(node) -> torch.fx.Node | None:
    """The tensor a bmm operand is a view of (through expands to its own size, copies, and views that keep the
    shape or merge the two leading dims of a 4-D [batch, heads, ...] tensor), or None."""
    while isinstance(node, torch.fx.Node) and node.target in CARRIERS:
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            return None
        shape, inner = tuple(node.meta["val"].shape), tuple(source.meta["val"].shape)
        merges_heads = len(inner) == 4 and shape == (inner[0] * inner[1], *inner[2:])
        if shape != inner and not merges_heads:
            return None
        node = source
    return node if isinstance(node, torch.fx.Node) else None


def _skip_casts(node):
    """The node a chain of dtype conversions (transformers' ``softmax(..., dtype=float32).to(bf16)``) starts from."""
    while isinstance(node, torch.fx.Node) and node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        node = node.args[0]
    return node


def _scores_of(softmax_input: torch.fx.Node):
    """(bmm of the scores, scale, boolean mask, whether True marks masked keys, additive mask, the nodes from the
    softmax's input down to the bmm), or None."""
    node, boolean_mask, true_masks, additive = softmax_input, None, False, None
    if node.target is aten.where.self and _is_constant_value(node.args[1], -math.inf):
        boolean_mask, true_masks, node = _unexpanded(node.args[0]), True, node.args[2]  # where(masked, -inf, s)
    elif node.target is aten.where.self and _is_constant_value(node.args[2], -math.inf):
        boolean_mask, node = _unexpanded(node.args[0]), node.args[1]  # where(attended, scores, -inf)
    elif node.target is aten.add.Tensor and isinstance(node.args[1], torch.fx.Node):
        additive, node = node.args[1], node.args[0]
    scale = 1.0
    scaled = node
    if node.target in (aten.div.Tensor, aten.mul.Tensor) and isinstance(node.args[1], (int, float)):
        scale = 1.0 / node.args[1] if node.target is aten.div.Tensor else float(node.args[1])
        node = node.args[0]
    product = node.args[0] if node.target in (aten.view.default, aten._unsafe_view.default) else node
    if isinstance(product, torch.fx.Node) and product.target is aten.bmm.default:
        path = _path(softmax_input, scaled) + _path(scaled, product)
        return product, scale, boolean_mask, true_masks, additive, path
    return None


def _unexpanded(mask: torch.fx.Node) -> torch.fx.Node:
    """The tensor a mask is an expand of (the scores' where broadcasts it back)."""
    while isinstance(mask, torch.fx.Node) and mask.target is aten.expand.default:
        mask = mask.args[0]
    return mask


def _path(start: torch.fx.Node, end: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes from ``start`` down to ``end`` (excluded), following the first tensor argument that leads there."""
    path, node = [], start
    while node is not end:
        path.append(node)
        node = next(arg for arg in node.args if isinstance(arg, torch.fx.Node) and _reaches(arg, end))
    return path


def _reaches(node: torch.fx.Node, end: torch.fx.Node, depth: int = 8) -> bool:
    return node is end or (depth > 0 and any(isinstance(arg, torch.fx.Node) and _reaches(arg, end, depth - 1)
                                             for arg in node.args))


def _match(node: torch.fx.Node) -> AttentionMatch | None:
    """The hand-written attention whose probabilities @ v product is ``node`` (a bmm), or None."""
    if node.op != "call_function" or node.target is not aten.bmm.default:
        return None
    probabilities, v = node.args
    softmax = _skip_casts(_unviewed(probabilities))
    if not _is_last_dim_softmax(softmax):
        return None
    found = _scores_of(_skip_casts(softmax.args[0]))
    if found is None:
        return None
    scores, scale, boolean_mask, true_masks, additive, path = found
    # every node from the scores' bmm to the probabilities has no reader but the next one
    chain = [*_path(probabilities, softmax), softmax, *_path(softmax.args[0], path[0]), *path, scores]
    if any(len(link.users) != 1 for link in chain):
        return None
    q, k_transposed = scores.args
    query, key, value = (operand.meta["val"] for operand in (q, k_transposed, v))
    if query.dtype not in ATTENTION_DTYPES or not query.dtype == key.dtype == value.dtype == node.meta["val"].dtype:
        return None
    if additive is not None and additive.meta["val"].dtype != query.dtype:
        return None  # SDPA takes a float mask of the inputs' dtype
    match = AttentionMatch(q, k_transposed, v, scale, boolean_mask, true_masks, additive, node,
                           zero_rows=softmax.target is aten._safe_softmax.default)
    return match if _broadcast_mask(match) else None


def _is_last_dim_softmax(node) -> bool:
    """A softmax over the last dim in its input's dtype: ``_softmax`` (not half to float) or ``_safe_softmax``."""
    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return False
    if node.target is aten._softmax.default:
        widens = node.args[2]
    elif node.target is aten._safe_softmax.default:
        widens = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None) is not None
    else:
        return False
    rank = node.meta["val"].dim()
    return not widens and node.args[1] % rank == rank - 1


def _broadcast_mask(match: AttentionMatch) -> bool:
    """Whether the mask (if any) is one [queries, keys] matrix for every batch and head: the SDPA node runs on
    the bmm's [batch x heads, 1, queries, head_dim] operands."""
    mask = match.boolean_mask if match.boolean_mask is not None else match.additive
    return mask is None or all(size == 1 for size in mask.meta["val"].shape[:-2])


def _every_row_attends(match: AttentionMatch) -> bool:
    """Whether the mask is a constant that leaves every query at least one key (else a row may be fully masked:
    NaN in the hand-written softmax, 0 in the flash kernel, so ``_nan_rows`` puts the NaN back)."""
    if match.boolean_mask is None and match.additive is None:
        return True
    attended = _attended(match)
    return attended is not None and bool(attended.any(dim=-1).all())


def _masks_nothing(match: AttentionMatch) -> bool:
    """Whether the boolean mask is a constant that attends every key (flex attention's no-op mask)."""
    attended = _attended(match)
    return attended is not None and bool(attended.all())


def _evaluated_mask(match: AttentionMatch):
    return _evaluate(match.boolean_mask if match.boolean_mask is not None else match.additive)


def _attended(match: AttentionMatch):
    """The evaluated mask as booleans, True where a query attends a key; None if it is not a constant."""
    mask = _evaluated_mask(match)
    if mask is None:
        return None
    if match.boolean_mask is not None:
        return ~mask if match.true_masks else mask
    return mask > -math.inf


def _is_constant_value(arg, value: float) -> bool:
    if isinstance(arg, (int, float)):
        return arg == value
    evaluated = _evaluate(arg)
    return evaluated is not None and evaluated.numel() == 1 and evaluated.item() == value


def _evaluate(node, depth: int = 0):
    """The value of ``node`` when it is computed from constants alone (no graph input), else None."""
    if not isinstance(node, torch.fx.Node):
        return node
    if node.op == "get_attr":  # a constant the graph holds (flex attention's -inf)
        value = getattr(node.graph.owning_module, node.target, None)
        return value if isinstance(value, torch.Tensor) and value.numel() <= MAX_EVALUATED_MASK else None
    value = node.meta.get("val")
    # (a node of several outputs, split or max.dim, carries a list of values: not evaluated, not a constant)
    if node.op != "call_function" or depth > 32 or not isinstance(value, torch.Tensor) \
            or value.numel() > MAX_EVALUATED_MASK:
        return None
    args = [_evaluate(arg, depth + 1) if isinstance(arg, torch.fx.Node) else arg for arg in node.args]
    if any(isinstance(arg, torch.fx.Node) and result is None for arg, result in zip(node.args, args)):
        return None
    if any(isinstance(arg, (list, tuple)) and any(isinstance(a, torch.fx.Node) for a in arg) for arg in node.args):
        return None
    try:
        return node.target(*args, **node.kwargs)
    except (RuntimeError, TypeError, ValueError):
        return None


def _is_causal(match: AttentionMatch) -> bool:
    """Whether the constant mask is SDPA's causal mask (key j attended by query i iff j <= i) and nothing else
    (an additive one holds only 0 and -inf)."""
    attended = _attended(match)
    if attended is None or attended.dim() < 2:
        return False
    if match.additive is not None and not bool(((_evaluated_mask(match) == 0) | ~attended).all()):
        return False
    queries, keys = match.q.meta["val"].shape[-2], match.k.meta["val"].shape[-1]
    causal = torch.ones(queries, keys, dtype=torch.bool).tril()
    return queries == keys and bool((attended.expand(*attended.shape[:-2], queries, keys) == causal).all())


def _replace(graph: torch.fx.Graph, match: AttentionMatch) -> None:
    """The probabilities' bmm replaced by SDPA over the bmms' own 3-D operands as [batch x heads, 1, seq, dim]:
    its output (contiguous, as the bmm's) feeds the same readers, whose shapes and strides stay as traced."""
    with graph.inserting_before(match.output):
        causal = (match.boolean_mask is not None or match.additive is not None) and _is_causal(match)
        mask = None if causal else match.additive
        if match.boolean_mask is not None and not causal and not _masks_nothing(match):
            mask = _additive_mask(graph, match)
        q = emit(graph, aten.unsqueeze.default, match.q, 1)
        k = emit(graph, aten.unsqueeze.default, emit(graph, aten.transpose.int, match.k, 1, 2), 1)
        v = emit(graph, aten.unsqueeze.default, match.v, 1)
        attention = emit(graph, SDPA, q, k, v, mask, 0.0, causal, scale=match.scale)
        output = emit(graph, aten.squeeze.dim, attention, 1)
        if output.meta["val"].stride() != match.output.meta["val"].stride():
            # SDPA lays its output out as the query (a transposed [batch, seq, heads, dim] one too); the readers
            # were traced on the bmm's contiguous output and read it through those strides
            output = emit(graph, aten.clone.default, output, memory_format=torch.contiguous_format)
        if not _every_row_attends(match) and not match.zero_rows:
            output = _nan_rows(graph, match, output)
    match.output.replace_all_uses_with(output)


def _nan_rows(graph: torch.fx.Graph, match: AttentionMatch, output: torch.fx.Node) -> torch.fx.Node:
    """``output`` plus NaN on the query rows whose keys are all masked, 0 elsewhere: eager's softmax over a row of
    -inf is NaN where the kernel gives 0. An add of a [queries, 1] column, which the attention kernel takes into
    its output tile. (Written in ops the lowering has: the row's smallest 1.0-if-masked flag is 1 iff all are.)"""
    if match.boolean_mask is not None:
        masked = match.boolean_mask
        if not match.true_masks:
            masked = emit(graph, aten.logical_not.default, masked)
    else:
        masked = emit(graph, aten.eq.Scalar, match.additive, -math.inf)
    flags = emit(graph, aten._to_copy.default, masked, dtype=torch.float32)
    every_key = emit(graph, aten.amin.default, flags, [-1], True)
    rows = emit(graph, aten.view.default, every_key, [every_key.meta["val"].shape[-2], 1])
    term = _select(graph, emit(graph, aten.eq.Scalar, rows, 1.0), math.nan, 0.0, output.meta["val"].dtype)
    return emit(graph, aten.add.Tensor, output, term)


def _select(graph: torch.fx.Graph, condition: torch.fx.Node, if_true: float, if_false: float, dtype):
    """where(condition, if_true, if_false) in ``dtype``, the numbers as 0-d tensors (the lowered ``where``)."""
    return emit(graph, aten.where.self, condition, emit(graph, aten.scalar_tensor.default, if_true, dtype=dtype),
                 emit(graph, aten.scalar_tensor.default, if_false, dtype=dtype))


def _additive_mask(graph: torch.fx.Graph, match: AttentionMatch) -> torch.fx.Node:
    """The boolean mask as SDPA's additive one: -inf where a key is masked, 0 elsewhere, in the inputs' dtype."""
    masked = match.boolean_mask
    if not match.true_masks:
        masked = emit(graph, aten.logical_not.default, masked)
    return _select(graph, masked, -math.inf, 0.0, match.q.meta["val"].dtype)
