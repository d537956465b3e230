"""Specialization stage (graph pass, before ``attention pattern``): flex attention as the ATen ops of its reference.

Input: an ATen GraphModule with shapes in ``node.meta["val"]`` (after ``specialize``). Output: the same graph, or a
copy in which each ``torch.ops.higher_order.flex_attention`` node is replaced by the ATen graph of torch's own
reference for it (``math_attention``, which the operator's CompositeExplicitAutograd kernel, the one eager runs on
CPU, calls): ``q @ k^T * scale``, the ``score_mod`` and ``mask_mod`` subgraphs applied over (batch, head, query,
key) by vmap, a safe softmax (0 on a fully masked row), ``@ v`` laid out as the query is (as that kernel lays it
out, here by a permute and a contiguous copy instead of a copy into an empty strided buffer, which no lowering
takes), and the log-sum-exp and row maximum when a reader takes them. The reference is traced here with make_fx on
the node's fake values, through the decomposition table, and inlined.

What it computes is what the reference computes: the mask is the ``mask_mod``; the block mask's block lists
(``kv_num_blocks``, ``kv_indices`` and the full blocks) are a sparsity hint the reference does not read, so every
key block is computed, and the nodes that only built those lists (Kandinsky-6 SR's NABLA sorts) are left without a
reader and removed. Why: diffusers models that attend through ``flex_attention`` (Kandinsky-6 SR, AnyFlow-FAR)
otherwise run their attention eagerly, one higher-order node no lowering takes.

Only float32 / bfloat16 query, key and value are rewritten; a node whose reference fails to trace keeps its eager
fallback (its graph is returned unchanged, never half rewritten).
"""

from __future__ import annotations

import copy
import logging
import operator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._higher_order_ops.flex_attention import math_attention
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_compile.passes.decompose import decomposition_table

log = logging.getLogger(__name__)
FLEX_ATTENTION = torch.ops.higher_order.flex_attention
REWRITTEN_DTYPES = (torch.float32, torch.bfloat16)


def inline_flex_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each flex attention node as its reference's ATen graph (a copy), or ``gm`` itself."""
    nodes = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is FLEX_ATTENTION]
    if not nodes or not all(_rewritable(node) for node in nodes):
        return gm
    rewritten = copy.deepcopy(gm)
    try:
        for node in [node for node in rewritten.graph.nodes if node.target is FLEX_ATTENTION]:
            _inline(rewritten, node, _traced_reference(rewritten, node))
    except Exception as error:  # noqa: BLE001 -- the reference did not trace here: keep the eager fallback, whole
        log.debug("flex attention kept whole: %s: %s", type(error).__name__, error)
        return gm
    rewritten.graph.eliminate_dead_code()
    rewritten.graph.lint()
    rewritten.recompile()
    return rewritten


def _rewritable(node: torch.fx.Node) -> bool:
    query = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return isinstance(query, torch.Tensor) and query.dtype in REWRITTEN_DTYPES


def _traced_reference(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list]:
    """(the reference traced over the node's tensor arguments, those argument nodes in the traced inputs' order).
    Subgraph arguments (``get_attr`` of ``score_mod`` / ``mask_mod``) are passed as the modules themselves."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    tensor_positions = [index for index, leaf in enumerate(leaves)
                        if isinstance(leaf, torch.fx.Node) and leaf.op != "get_attr"]
    resolved = [getattr(gm, leaf.target) if isinstance(leaf, torch.fx.Node) and leaf.op == "get_attr" else leaf
                for leaf in leaves]

    def reference(*tensors):
        values = list(resolved)
        for position, tensor in zip(tensor_positions, tensors, strict=True):
            values[position] = tensor
        args, kwargs = pytree.tree_unflatten(values, spec)
        output, log_sum_exp, row_max = math_attention(*args, **kwargs)
        return _laid_out_as(output, args[0].stride()), log_sum_exp, row_max

    fakes = [leaves[position].meta["val"] for position in tensor_positions]
    fake_mode = detect_fake_mode(fakes)
    if fake_mode is None:
        raise NotImplementedError("flex attention arguments without fake values")
    with fake_mode:
        traced = make_fx(reference, decomposition_table=decomposition_table())(*fakes)
    return traced, [leaves[position] for position in tensor_positions]


def _laid_out_as(tensor: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``tensor``'s values with its dims in memory in the order of ``strides`` (outermost: the largest stride)."""
    order = sorted(range(tensor.dim()), key=lambda dim: -strides[dim])
    inverse = sorted(range(tensor.dim()), key=lambda dim: order[dim])
    return tensor.permute(order).contiguous().permute(inverse)


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, reference: tuple) -> None:
    """Copy the traced reference's nodes in front of ``node``, point the readers of its outputs at the copies,
    erase ``node``. The reference's constants become attributes of ``gm``."""
    traced, arguments = reference
    placeholders = [each for each in traced.graph.nodes if each.op == "placeholder"]
    copied: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, arguments, strict=True))
    outputs = None
    with gm.graph.inserting_before(node):
        for each in traced.graph.nodes:
            if each.op == "output":
                outputs = pytree.tree_leaves(each.args[0])
            elif each.op == "get_attr":
                name = _free_attribute_name(gm, "flex_attention_constant")
                gm.register_buffer(name, getattr(traced, each.target))
                copied[each] = gm.graph.get_attr(name)
                copied[each].meta = dict(each.meta)
            elif each.op != "placeholder":
                copied[each] = gm.graph.node_copy(each, lambda argument: copied[argument])
    expected = node.meta["val"][0]
    if copied[outputs[0]].meta["val"].stride() != expected.stride():
        raise NotImplementedError(f"flex attention output strides {copied[outputs[0]].meta['val'].stride()}")
    for reader in list(node.users):
        if reader.target is not operator.getitem:
            raise NotImplementedError(f"flex attention read by {reader.target}")
        reader.replace_all_uses_with(copied[outputs[reader.args[1]]])
        gm.graph.erase_node(reader)
    gm.graph.erase_node(node)


def _free_attribute_name(gm: torch.fx.GraphModule, stem: str) -> str:
    index = 0
    while hasattr(gm, f"{stem}_{index}"):
        index += 1
    return f"{stem}_{index}"
