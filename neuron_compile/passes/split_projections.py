"""Specialization stage (graph pass, before ``partition``): a fused projection becomes one matmul per slice.

Input: an ATen GraphModule with shapes in ``node.meta["val"]`` (after ``specialize``). Output: a copy of it (or
the graph itself, where nothing splits) in which each ``mm`` / ``addmm`` whose readers all take column ranges of
its product (``slice`` on the last dim, or ``split`` / ``split_with_sizes`` there and their items), directly or
through one ``view`` that keeps the last dim, is replaced by one ``mm`` / ``addmm`` per range over the matching
columns of its right operand (and bias): a view of the weight, which the kernels read where it lies.

Why: Phi3's ``qkv_proj`` and ``gate_up_proj``, GPT-NeoX's ``query_key_value``, GPT-2's ``c_attn`` compute several
projections in one product and slice them apart. The fused product is stored whole and read back for each slice
(Phi3's gate and up: 8.7 MB through HBM at hidden 2048); split, each slice is a matmul as Llama's separate
projections are, which the fusion pass pairs and gives epilogues (silu(gate) * up inside the kernel). Every column
of a product is computed on its own, so the split products are bitwise the fused one's columns. A product of one
row stays whole: its output is a row, and splitting only adds weight-bound kernels (Flux's adaLN modulation, six
chunks of one product: 22 us more per block at the mid size).
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import torch
import torch.fx

from neuron_compile.passes.graph_nodes import emit, recompute_values

aten = torch.ops.aten
PRODUCTS = (aten.mm.default, aten.addmm.default)
SLICES = (aten.slice.Tensor,)
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


@dataclasses.dataclass(frozen=True)
class ColumnRead:
    """A reader of the product's columns ``start`` .. ``stop``: ``node`` is replaced by the split product there."""

    node: torch.fx.Node
    start: int
    stop: int


def split_projections(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every fused projection split (a copy), or ``gm`` itself when there is none."""
    if not any(split_plan(node) is not None for node in gm.graph.nodes):
        return gm
    split = copy.deepcopy(gm)
    new_products = []
    for node in list(split.graph.nodes):
        plan = split_plan(node)
        if plan is not None:
            new_products.extend(split_product(split.graph, node, *plan))
    split.graph.eliminate_dead_code()
    # the readers were traced on the fused product's strides (a slice of [n, 384] columns); each split product is
    # contiguous in its own columns
    recompute_values(split.graph, set(new_products))
    if output_layouts(split) != output_layouts(gm):
        return gm  # (a safety net: ``split_plan`` leaves a returned range alone) the caller sees eager's strides
    split.graph.lint()
    split.recompile()
    return split


def output_layouts(gm: torch.fx.GraphModule) -> list:
    """The shape, strides and offset of each tensor the graph returns."""
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    values = [node.meta.get("val") for node in output.all_input_nodes]
    return [(tuple(value.shape), value.stride(), value.storage_offset()) if isinstance(value, torch.Tensor) else None
            for value in values]


def split_plan(node: torch.fx.Node) -> tuple[torch.fx.Node | None, list[ColumnRead]] | None:
    """For a product read only by column ranges: the view between them (or None) and the ranges; else None."""
    if node.op != "call_function" or node.target not in PRODUCTS or node.meta["val"].dim() != 2:
        return None
    if node.meta["val"].shape[0] == 1:
        return None  # one row (a modulation's, a decode step's): nothing to keep out of HBM, only kernels to add
    view = column_keeping_view(node)
    reads = column_reads(view if view is not None else node)
    if reads is None or len(reads) < 2 or any(returned_as_view(read.node) for read in reads):
        return None
    return view, reads


def returned_as_view(node: torch.fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it (a training forward saving v for the backward): its
    strides are then the fused product's, which the caller sees."""
    for user in node.users:
        if user.op == "output" or (is_view(user) and returned_as_view(user)):
            return True
    return False


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an ATen op whose result aliases its input (its schema says so)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


def split_product(graph: torch.fx.Graph, product: torch.fx.Node, view: torch.fx.Node | None,
                  reads: list[ColumnRead]) -> list[torch.fx.Node]:
    """``product`` as one product per column range of ``reads``: the nodes now read in the ranges' places."""
    replacements = []
    for read in reads:
        with graph.inserting_before(read.node):
            columns = product_columns(graph, product, read.start, read.stop)
            if view is not None:
                shape = [*view.meta["val"].shape[:-1], read.stop - read.start]
                columns = emit(graph, aten.view.default, columns, shape)
        read.node.replace_all_uses_with(columns)
        replacements.append(columns)
    return replacements


def column_keeping_view(product: torch.fx.Node) -> torch.fx.Node | None:
    """``product``'s only reader if it is a ``view`` that keeps the last dim ([rows, n] -> [batch, seq, n])."""
    if len(product.users) != 1:
        return None
    (view,) = product.users
    if view.target is not aten.view.default or view.meta["val"].shape[-1] != product.meta["val"].shape[-1]:
        return None
    return view


def column_reads(node: torch.fx.Node) -> list[ColumnRead] | None:
    """The column ranges ``node``'s readers take, each with the node that holds it; None if one reads otherwise."""
    last, width = node.meta["val"].dim() - 1, node.meta["val"].shape[-1]
    reads = []
    for user in node.users:
        if user.target in SLICES and is_last_dim(argument(user, 1, 0), last) and argument(user, 4, 1) == 1:
            start, stop = slice(argument(user, 2, None), argument(user, 3, None)).indices(width)[:2]
            reads.append(ColumnRead(user, start, max(start, stop)))
        elif user.target in SPLITS and is_last_dim(argument(user, 2, 0), last):
            split = split_reads(user)
            if split is None:
                return None
            reads.extend(split)
        else:
            return None
    return reads


def argument(node: torch.fx.Node, index: int, default):
    """``node``'s positional argument ``index`` (ATen's default where the trace left it out)."""
    return node.args[index] if len(node.args) > index else default


def split_reads(split: torch.fx.Node) -> list[ColumnRead] | None:
    """The items of a ``split`` / ``split_with_sizes`` node as column reads; None if it is read whole."""
    if any(user.target is not operator.getitem for user in split.users):
        return None
    bounds = [0]
    for item in split.meta["val"]:
        bounds.append(bounds[-1] + item.shape[-1])
    return [ColumnRead(item, bounds[item.args[1]], bounds[item.args[1] + 1]) for item in split.users]


def is_last_dim(dim: int, last: int) -> bool:
    return dim in (last, -1)


def product_columns(graph: torch.fx.Graph, product: torch.fx.Node, start: int, stop: int) -> torch.fx.Node:
    """``product``'s columns ``start`` .. ``stop`` as a product of their own: the same left operand, the right
    operand's (and a per-column bias's) columns."""
    if product.target is aten.mm.default:
        left, right = product.args
        return emit(graph, aten.mm.default, left, emit(graph, aten.slice.Tensor, right, 1, start, stop))
    bias, left, right = product.args
    if bias.meta["val"].dim() > 0 and bias.meta["val"].shape[-1] != 1:
        bias = emit(graph, aten.slice.Tensor, bias, -1, start, stop)
    return emit(graph, aten.addmm.default, bias, left, emit(graph, aten.slice.Tensor, right, 1, start, stop),
                **product.kwargs)
