"""Specialization stage (graph pass, before ``partition``): complex64 arithmetic as pairs of fp32 values.

Input: an ATen GraphModule with concrete shapes in ``node.meta["val"]`` (after ``specialize``). Output: the same
graph, or a copy in which every complex64 value is carried by its ``view_as_real`` form, an fp32 tensor with a
trailing dimension of 2 (real, imaginary), and complex ops are real arithmetic on it:

- ``view_as_complex(x)`` is ``x`` itself; ``view_as_real(c)`` is the pair tensor of ``c``;
- ``mul`` of two complex values is ``(ar*br - ai*bi, ar*bi + ai*br)`` (selects, multiplies and a ``cat`` of the
  two halves); complex by real is the pair tensor times the real value (unsqueezed on the pair dimension);
- ``add`` / ``sub`` / ``neg`` act on the pairs; ``real`` / ``imag`` are selects; ``polar(abs, angle)`` is
  ``cat(abs*cos, abs*sin)``; the conjugate (``_conj``, the lazy view ``c.conj()`` traces to, or ``conj_physical``)
  is ``cat(real, -imaginary)`` (SANA-WM's inverse rotary);
- views (``view``, ``reshape``, ``unsqueeze``, ``squeeze``, ``permute``, ``expand``, ``slice``, ``select``,
  ``clone``) keep the pair dimension last.

A complex graph input enters through one ``view_as_real`` (a view: the region binds the input's pairs, see
lowering/registry.py ``input_layout``); a complex graph output leaves through one ``view_as_complex``. The pairs
may be laid out unlike eager's complex values, so every node's meta value is recomputed afterwards, and a ``view``
the new layout does not allow reads a contiguous clone. Why: diffusers' rotary embeddings (QwenImage, Lumina, HiDream...) multiply
``view_as_complex`` query / key pairs by complex frequencies; NKI has no complex dtype, and without this the
rotary multiply and its neighbours run eagerly between two NKI regions. The arithmetic is the one eager's
complex multiply does in fp32, so results agree to an ulp or so.

All or nothing: a graph with a complex op outside these (``abs``, complex ``div``, FFTs, ...) is
returned unchanged (those nodes keep their eager fallback), never half rewritten.
"""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from neuron_compile.passes import graph_nodes

aten = torch.ops.aten
COMPLEX_DTYPES = (torch.complex64,)

# Views whose dim argument (the second) is re-aimed at the pair tensor.
DIM_VIEWS = (aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int)
SHAPE_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
SAME_SHAPE = (aten.clone.default, aten.alias.default, aten.neg.default)
ELEMENTWISE = (aten.add.Tensor, aten.sub.Tensor)
ENTRY_EXIT = (aten.view_as_complex.default, aten.view_as_real.default)
CONJUGATES = (aten._conj.default, aten.conj_physical.default, aten._conj_physical.default)
REWRITTEN = (*DIM_VIEWS, *SHAPE_VIEWS, *SAME_SHAPE, *ELEMENTWISE, *ENTRY_EXIT, *CONJUGATES, aten.mul.Tensor,
             aten.permute.default, aten.squeeze.default, aten.real.default, aten.imag.default, aten.polar.default)


def is_complex(node) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype in COMPLEX_DTYPES


def _touches_complex(node: torch.fx.Node) -> bool:
    return is_complex(node) or any(is_complex(arg) for arg in node.all_input_nodes)


def _rewritable(node: torch.fx.Node) -> bool:
    if node.target not in REWRITTEN:
        return False
    if node.kwargs:  # a clone's memory format carries over to the pairs; other keyword arguments are not known here
        return node.target is aten.clone.default and set(node.kwargs) <= {"memory_format"}
    if node.target in ELEMENTWISE:  # complex +- complex only: a real or scalar operand would need its own pairs
        return len(node.args) == 2 and all(is_complex(arg) for arg in node.args)
    if node.target is aten.mul.Tensor:  # at least one complex tensor factor (two complex scalars are not a node)
        return any(is_complex(arg) for arg in node.args)
    return True


def unsupported_complex_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """The call_function nodes that produce or read complex values and that this pass cannot rewrite."""
    return [node.name for node in gm.graph.nodes
            if node.op == "call_function" and _touches_complex(node) and not _rewritable(node)]


def rewrite_complex_pairs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its complex64 arithmetic on fp32 pairs (a copy), or ``gm`` itself when it has no complex values
    or one this pass cannot rewrite."""
    if not any(is_complex(node) for node in gm.graph.nodes) or unsupported_complex_nodes(gm):
        return gm
    gm = copy.deepcopy(gm)
    rewriter = PairRewriter(gm.graph)
    for node in list(gm.graph.nodes):
        rewriter.visit(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    refresh_values(gm)
    return gm


def refresh_values(gm: torch.fx.GraphModule) -> None:
    """Recompute every node's meta value from the graph inputs'. A replacement can lay its value out differently
    from the node it replaces (the halves' cat is contiguous where eager's complex product kept its permuted input's
    strides), and a later view lowered through the stale strides would read the wrong elements. A ``view`` that the
    new layout no longer allows reads a contiguous copy (a clone) instead."""
    inputs = [node.meta.get("val") for node in gm.graph.nodes if node.op == "placeholder"]
    fakes = [value for value in inputs if isinstance(value, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[torch.fx.Node, object] = {}
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            value = node.meta.get("val")
            values[node] = value if isinstance(value, FakeTensor) or not isinstance(value, torch.Tensor) else \
                mode.from_tensor(value, static_shapes=True)
        elif node.op == "get_attr":
            values[node] = node.meta.get("val")
        elif node.op == "call_function":
            values[node] = _refreshed_value(gm, node, values, mode)
            node.meta["val"] = values[node]
    gm.graph.lint()
    gm.recompile()


def _refreshed_value(gm: torch.fx.GraphModule, node: torch.fx.Node, values: dict, mode: FakeTensorMode):
    def run():
        args = torch.fx.node.map_arg(node.args, values.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
        with mode:
            return node.target(*args, **kwargs)

    if node.target not in (aten.view.default, aten._unsafe_view.default):
        return run()
    source = node.args[0]
    with mode:
        viewable = _can_view(values[source], node.args[1])
    if not viewable:
        with gm.graph.inserting_before(node):
            copy = gm.graph.call_function(aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
        with mode:
            values[copy] = values[source].clone(memory_format=torch.contiguous_format)
        copy.meta["val"] = values[copy]
        node.replace_input_with(source, copy)
    return run()


def _can_view(value: torch.Tensor, shape) -> bool:
    try:
        value.view(shape)
    except (RuntimeError, ValueError):
        return False
    return True


class PairRewriter:
    """Walks the graph in order; ``pairs`` maps each complex node to the fp32 node that carries its pairs."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.pairs: dict[torch.fx.Node, torch.fx.Node] = {}

    def emit(self, target, *args, **kwargs) -> torch.fx.Node:
        """A new node computing ``target(*args, **kwargs)``, its meta value computed on the arguments' fake values."""
        return graph_nodes.emit(self.graph, target, *args, **kwargs)

    def visit(self, node: torch.fx.Node) -> None:
        if node.op == "placeholder" and is_complex(node):
            with self.graph.inserting_after(node):
                self.pairs[node] = self.emit(aten.view_as_real.default, node)
        elif node.op == "output":
            self._exit_outputs(node)
        elif node.op == "call_function" and _touches_complex(node):
            with self.graph.inserting_before(node):
                replacement = self._rewrite(node)
            if is_complex(node):
                self.pairs[node] = replacement
            else:
                node.replace_all_uses_with(replacement)

    def _exit_outputs(self, output: torch.fx.Node) -> None:
        with self.graph.inserting_before(output):
            exits = {node: self.emit(aten.view_as_complex.default, self.pairs[node])
                     for node in output.all_input_nodes if node in self.pairs}
        output.args = torch.fx.node.map_arg(output.args, lambda arg: exits.get(arg, arg))

    def _pair_of(self, arg):
        return self.pairs.get(arg, arg) if isinstance(arg, torch.fx.Node) else arg

    def _rewrite(self, node: torch.fx.Node) -> torch.fx.Node:
        target, args = node.target, node.args
        source = self._pair_of(args[0])
        rank = node.args[0].meta["val"].dim() if isinstance(args[0], torch.fx.Node) else 0
        if target in ENTRY_EXIT:
            return source
        if target is aten.mul.Tensor:
            return self._multiply(*args)
        if target in ELEMENTWISE:
            return self.emit(target, *(self.pairs[arg] for arg in args))
        if target in SAME_SHAPE:
            return self.emit(target, source, **node.kwargs)
        if target in CONJUGATES:
            real, imaginary = self._halves(source)
            return self._joined(real, self.emit(aten.neg.default, imaginary))
        if target in (aten.real.default, aten.imag.default):
            return self.emit(aten.select.int, source, -1, 0 if target is aten.real.default else 1)
        if target is aten.polar.default:
            return self._polar(*args)
        if target in SHAPE_VIEWS:
            return self.emit(target, source, [*args[1], 2])
        if target is aten.permute.default:
            return self.emit(target, source, [dim % rank for dim in args[1]] + [rank])
        if target is aten.squeeze.default:
            squeezed = [dim for dim, size in enumerate(node.args[0].meta["val"].shape) if size == 1]
            return self.emit(aten.squeeze.dims, source, squeezed) if squeezed else source
        dim_rank = rank + 1 if target is aten.unsqueeze.default else rank  # unsqueeze's dim counts the new one
        dim = args[1] if len(args) > 1 else 0  # slice.Tensor's dim defaults to 0
        return self.emit(target, source, dim % dim_rank, *args[2:])

    def _multiply(self, left, right) -> torch.fx.Node:
        if left not in self.pairs:  # a real or scalar factor first: the complex one is on the right
            left, right = right, left
        if isinstance(right, torch.fx.Node) and right in self.pairs:
            return self._complex_product(self.pairs[left], self.pairs[right])
        if isinstance(right, torch.fx.Node):  # complex times real: both halves scale by the real value
            return self.emit(aten.mul.Tensor, self.pairs[left], self.emit(aten.unsqueeze.default, right, -1))
        if isinstance(right, complex):
            return self._scalar_product(self.pairs[left], right)
        return self.emit(aten.mul.Tensor, self.pairs[left], right)

    def _halves(self, pairs: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
        return self.emit(aten.select.int, pairs, -1, 0), self.emit(aten.select.int, pairs, -1, 1)

    def _joined(self, real: torch.fx.Node, imaginary: torch.fx.Node) -> torch.fx.Node:
        halves = [self.emit(aten.unsqueeze.default, real, -1), self.emit(aten.unsqueeze.default, imaginary, -1)]
        return self.emit(aten.cat.default, halves, -1)

    def _complex_product(self, left: torch.fx.Node, right: torch.fx.Node) -> torch.fx.Node:
        left_real, left_imaginary = self._halves(left)
        right_real, right_imaginary = self._halves(right)
        real = self.emit(aten.sub.Tensor, self.emit(aten.mul.Tensor, left_real, right_real),
                         self.emit(aten.mul.Tensor, left_imaginary, right_imaginary))
        imaginary = self.emit(aten.add.Tensor, self.emit(aten.mul.Tensor, left_real, right_imaginary),
                              self.emit(aten.mul.Tensor, left_imaginary, right_real))
        return self._joined(real, imaginary)

    def _scalar_product(self, pairs: torch.fx.Node, scalar: complex) -> torch.fx.Node:
        left_real, left_imaginary = self._halves(pairs)
        real = self.emit(aten.sub.Tensor, self.emit(aten.mul.Tensor, left_real, scalar.real),
                         self.emit(aten.mul.Tensor, left_imaginary, scalar.imag))
        imaginary = self.emit(aten.add.Tensor, self.emit(aten.mul.Tensor, left_real, scalar.imag),
                              self.emit(aten.mul.Tensor, left_imaginary, scalar.real))
        return self._joined(real, imaginary)

    def _polar(self, magnitude: torch.fx.Node, angle: torch.fx.Node) -> torch.fx.Node:
        return self._joined(self.emit(aten.mul.Tensor, magnitude, self.emit(aten.cos.default, angle)),
                            self.emit(aten.mul.Tensor, magnitude, self.emit(aten.sin.default, angle)))

