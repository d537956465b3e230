"""Specialization stage (before ``specialize``): shape bucketing, padding dynamic sizes up to a multiple.

Input: a dynamic inference ATen GraphModule (sizes are SymInts: ``dynamic=True``, ``mark_dynamic`` or automatic
dynamic shapes) and ``Config.bucket`` (``NEURON_COMPILE_BUCKET``). Output: a ``BucketPlan``: the size symbols that
may be padded, and per call, the padded arguments (every tensor dim of that size grows to the next multiple,
zero-filled at the end; every SymInt argument of that size takes the padded value) and the results sliced back to
the unpadded sizes. Calls whose sizes fall in one bucket then share one dispatch key: one compile per bucket, not
one per length (runtime/compiled_graph.py applies the plan before it builds the key).

Padding at the end is exact when no real position reads a padded one and the real data stays in the leading part
of every padded dim. The plan walks the graph once per symbol, tracking which dims of each value have a size that
depends on it ("padded dims"), and pads the symbol only if every node keeps it so: pointwise ops, layout ops
(permute, transpose, expand, select from the start, slices with a fixed start), views (tried on element numbers
at a real and at a padded size: ``[1, s, h] -> [s, h]`` keeps the padding at the end; ``[2, s, h] -> [2*s, h]``
interleaves it and is declined), concatenation along other dims or with the padded input last (a KV cache's
``cat([past, new], -2)``), creation ops (``arange(s)``), cumulative ops (position i reads positions <= i),
matmuls, reductions and layer norms over other dims, embedding lookups, and causal attention without a mask (a real query
attends to keys at or before it, never to the padded ones after the last real key). Anything else is declined
with a reason (``reasons``: the record, the dump and ``neuron-compile explain`` show it): a reduction, softmax or
contraction over a padded dim, attention with a mask (its padding would be zeros: attend) or without causality,
ops we do not know, graphs that mutate inputs or return views of them (a padded copy would take the write or the
view).

Caveat: values computed at padded positions are discarded, but they are computed; a function that is not finite at
zero (a log, a division by the input) makes them inf or nan, which a causal attention's ``0 * nan`` would spread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import sympy
import torch
import torch.fx

aten = torch.ops.aten

# Ops that move or copy data without mixing positions along any dim (their output dims follow their inputs').
LAYOUT_OPS = {
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.clone.default, aten._to_copy.default,
    aten.alias.default, aten.detach.default, aten.contiguous.default, aten.slice.Tensor,
}
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
INDEXING_OPS = {aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}
CREATION_OPS = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
                aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default}
CUMULATIVE_OPS = {aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default}
MATMUL_OPS = {aten.mm.default: (1, 0), aten.bmm.default: (2, 1), aten.addmm.default: (1, 0)}  # (a's K, b's K dim)
ATTENTION_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten.scaled_dot_product_attention.default, aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_flash_attention.default}
MUTATING_TARGETS = {aten.copy_.default}


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    multiple: int
    symbols: tuple[str, ...]  # the size symbols padded
    inputs: tuple[tuple, ...]  # per placeholder: ("tensor", ((dim, symbol), ...)) | ("size", symbol) | ()
    outputs: tuple[tuple[tuple[int, sympy.Expr], ...], ...]  # per output: (dim, its size expression) pairs
    reasons: tuple[str, ...]  # why each other symbol (or the whole graph) is not padded

    @property
    def active(self) -> bool:
        return bool(self.symbols)

    def describe(self) -> str:
        padded = f"pads {', '.join(self.symbols)} to multiples of {self.multiple}" if self.symbols else "pads nothing"
        return "; ".join([padded, *(f"declined: {reason}" for reason in self.reasons)])

    def sizes(self, args: Sequence[object]) -> dict[str, int]:
        """Each padded symbol's value in this call."""
        values: dict[str, int] = {}
        for spec, arg in zip(self.inputs, args):
            if spec and spec[0] == "size":
                values[spec[1]] = int(arg)
            elif spec:
                values.update({symbol: arg.shape[dim] for dim, symbol in spec[1]})
        return values

    def pad(self, args: Sequence[object], sizes: dict[str, int]) -> list:
        """The call's arguments with every padded size rounded up to the multiple (tensors zero-filled)."""
        padded_sizes = {symbol: -(-value // self.multiple) * self.multiple for symbol, value in sizes.items()}
        padded = []
        for spec, arg in zip(self.inputs, args):
            if spec and spec[0] == "size":
                padded.append(padded_sizes[spec[1]])
            elif spec:
                padded.append(_pad_tensor(arg, {dim: padded_sizes[symbol] for dim, symbol in spec[1]}))
            else:
                padded.append(arg)
        return padded

    def unpad(self, outputs: Sequence[object], sizes: dict[str, int]) -> list:
        """The results sliced back to the call's own sizes (contiguous, as eager returns them)."""
        results = list(outputs)
        for index, dims in enumerate(self.outputs):
            result = results[index]
            for dim, expression in dims:
                values = {symbol: sizes[symbol.name] for symbol in expression.free_symbols}
                result = result.narrow(dim, 0, int(expression.subs(values)))
            results[index] = result.contiguous() if dims else result
        return results


def _pad_tensor(tensor: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    shape = list(tensor.shape)
    if all(shape[dim] == size for dim, size in sizes.items()):
        return tensor
    for dim, size in sizes.items():
        shape[dim] = size
    padded = tensor.new_zeros(shape)
    padded[tuple(slice(0, extent) for extent in tensor.shape)] = tensor
    return padded


# ---------------------------------------------------------------- analysis


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def _shape(value) -> list[sympy.Expr] | None:
    return [_expr(size) for size in value.shape] if isinstance(value, torch.Tensor) else None


def _padded_dims(value, symbol: sympy.Symbol) -> list[int]:
    shape = _shape(value)
    return [dim for dim, size in enumerate(shape or []) if symbol in size.free_symbols]


def _sizes_at(shape: list, symbol: sympy.Symbol, value: int) -> list[int]:
    """A symbolic shape with ``symbol`` = value and every other symbol = 2."""
    others = {other: 2 for size in shape for other in size.free_symbols if other != symbol}
    return [int(size.subs({symbol: value, **others})) for size in shape]


REAL, PADDED = 3, 5  # the sizes a view is tried at: a real length and a longer, padded one


def _view_keeps_positions(source: list, target: list, symbol: sympy.Symbol) -> bool:
    """Whether a view keeps real data in the leading part of every padded dim, as its input has it: the view is
    tried on element numbers at a real size and at a padded one, and the real elements must land in the same
    places (``[b, s, h] -> [b*s, h]`` does; ``[s, 4] -> [4, s]`` does not)."""
    real_shape, padded_shape = _sizes_at(source, symbol, REAL), _sizes_at(source, symbol, PADDED)
    real = torch.arange(math.prod(real_shape)).view(real_shape)
    padded = torch.full(padded_shape, -1, dtype=real.dtype)
    padded[tuple(slice(0, extent) for extent in real_shape)] = real
    real_target = _sizes_at(target, symbol, REAL)
    try:
        viewed_real, viewed_padded = real.reshape(real_target), padded.reshape(_sizes_at(target, symbol, PADDED))
    except RuntimeError:
        return False
    return bool(torch.equal(viewed_padded[tuple(slice(0, extent) for extent in real_target)], viewed_real))


def _dims_argument(node: torch.fx.Node, rank: int) -> list[int] | None:
    """The dims a reduction reduces (None: all of them)."""
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dims is None or dims == []:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [dim % rank for dim in dims if isinstance(dim, int)]


def _reason(node: torch.fx.Node, symbol: sympy.Symbol) -> str | None:
    """Why padding ``symbol`` would change ``node``'s real results (None: it would not)."""
    inputs = [arg for arg in node.all_input_nodes if isinstance(arg.meta.get("val"), torch.Tensor)]
    padded_inputs = {arg: _padded_dims(arg.meta["val"], symbol) for arg in inputs}
    if not any(padded_inputs.values()):
        return None
    target = node.target
    name = f"{target}"
    if not isinstance(target, torch._ops.OpOverload):
        return None  # operator.getitem of a multi-output op, SymInt arithmetic
    if target in INDEXING_OPS:
        return _indexing_reason(node, symbol, padded_inputs.get(node.args[0], []), name)
    if target is aten.cat.default:
        return _cat_reason(node, symbol, padded_inputs, name)
    if target in MUTATING_TARGETS or target._schema.is_mutable:
        return f"{name} writes a tensor in place (the padded copy would take the write)"
    if torch.Tag.pointwise in target.tags:
        return None
    if target in LAYOUT_OPS or target in CREATION_OPS or target in CUMULATIVE_OPS or target is aten.embedding.default:
        if target is aten.embedding.default and padded_inputs.get(node.args[0]):
            return f"{name} looks up a table whose size is {symbol}"
        if target is aten.slice.Tensor and not _starts_from_the_front(node, symbol, padded_inputs):
            return f"{name} starts at a position counted from the end of the padded dim {symbol}"
        return None
    if target in VIEW_OPS:
        source, result = _shape(node.args[0].meta["val"]), _shape(node.meta["val"])
        return None if _view_keeps_positions(source, result, symbol) else (
            f"{name} {[str(size) for size in source]} -> {[str(size) for size in result]} interleaves padded positions")
    if target in MATMUL_OPS:
        offset = 1 if target is aten.addmm.default else 0
        a_dim, b_dim = MATMUL_OPS[target]
        a, b = node.args[offset], node.args[offset + 1]
        if a_dim in padded_inputs.get(a, []) or b_dim in padded_inputs.get(b, []):
            return f"{name} contracts over the padded dim {symbol}"
        return None
    if target in ATTENTION_OPS:
        return _attention_reason(node, symbol, padded_inputs)
    return _reduction_reason(node, symbol, padded_inputs, name)


def _indexing_reason(node: torch.fx.Node, symbol: sympy.Symbol, padded: list[int], name: str) -> str | None:
    """select at a position from the start keeps positions; splitting or unbinding a padded dim does not."""
    rank = node.args[0].meta["val"].dim()
    if node.target is aten.select.int:
        index = node.args[2]
        if node.args[1] % rank in padded and not (isinstance(index, int) and index >= 0):
            return f"{name} picks a position counted from the end of the padded dim {symbol}"
        return None
    dim = node.args[1] if node.target is aten.unbind.int else (node.args[2] if len(node.args) > 2 else 0)
    return f"{name} splits the padded dim {symbol}" if dim % rank in padded else None


def _cat_reason(node: torch.fx.Node, symbol: sympy.Symbol, padded_inputs: dict, name: str) -> str | None:
    """cat along another dim keeps each input's positions; along the padded dim, only when the padded input comes
    last after fixed-size ones (a KV cache's ``cat([past, new], -2)``): the padding then stays at the end."""
    rank = node.meta["val"].dim()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % rank
    parts = node.args[0]
    padded = [index for index, part in enumerate(parts) if dim in padded_inputs.get(part, [])]
    if not padded or padded == [len(parts) - 1]:
        return None
    return f"{name} joins tensors after the padded dim {symbol}"


def _starts_from_the_front(node: torch.fx.Node, symbol: sympy.Symbol, padded_inputs: dict) -> bool:
    """A slice along a padded dim must start at a fixed position from the front (``x[:, -1:]`` would read the
    padding)."""
    dim = (node.args[1] if len(node.args) > 1 else 0) % node.args[0].meta["val"].dim()
    if dim not in padded_inputs.get(node.args[0], []):
        return True
    start = _expr_of(node.args[2] if len(node.args) > 2 else 0)
    return symbol not in start.free_symbols and not (start.is_number and start < 0)


def _expr_of(value) -> sympy.Expr:
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val", 0)
    return _expr(value) if isinstance(value, int | torch.SymInt) else sympy.Integer(0)


def _attention_reason(node: torch.fx.Node, symbol: sympy.Symbol, padded_inputs: dict) -> str | None:
    query, key = node.args[0], node.args[1]
    key_rank = key.meta["val"].dim()
    if key_rank - 2 not in padded_inputs.get(key, []):
        return None  # only the queries are padded: each query row is independent
    causal = node.kwargs.get("is_causal", len(node.args) > 4 and node.args[4] is True)
    if node.target is aten.scaled_dot_product_attention.default:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    else:
        mask = node.kwargs.get("attn_mask")
    same_length = _shape(query.meta["val"])[-2] == _shape(key.meta["val"])[-2]
    if causal and mask is None and same_length:
        return None
    return f"{node.target} attends over the padded key positions without a causal mask that hides them"


REDUCTION_OPS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction,
                 aten.var_mean.correction, aten._softmax.default, aten._log_softmax.default, aten.prod.dim_int,
                 aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.any.dim, aten.all.dim,
                 aten._safe_softmax.default}


def _reduction_reason(node, symbol, padded_inputs: dict, name: str) -> str | None:
    if node.target is aten.native_layer_norm.default:  # normalizes the trailing len(normalized_shape) dims
        rank, normalized = node.args[0].meta["val"].dim(), len(node.args[1])
        if set(padded_inputs.get(node.args[0], [])) & set(range(rank - normalized, rank)):
            return f"{name} normalizes over the padded dim {symbol}"
        return None
    if node.target not in REDUCTION_OPS:
        return f"{name} is not known to keep padded positions apart"
    source = node.args[0]
    dims = _dims_argument(node, source.meta["val"].dim())
    padded = padded_inputs.get(source, [])
    if dims is None or set(dims) & set(padded):
        return f"{name} reduces over the padded dim {symbol}"
    return None


def _symbols(gm: torch.fx.GraphModule) -> list[sympy.Symbol]:
    """Size symbols that are whole dims of tensor inputs (what a call's arguments can be padded along)."""
    found: dict[sympy.Symbol, None] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        for size in _shape(node.meta.get("val")) or []:
            if isinstance(size, sympy.Symbol):
                found[size] = None
    return list(found)


def _graph_reason(gm: torch.fx.GraphModule) -> str | None:
    placeholders = set(gm.graph.find_nodes(op="placeholder"))
    for output in gm.graph.output_node().args[0]:
        if isinstance(output, torch.fx.Node) and (output in placeholders or
                                                  _is_view_of_input(output, placeholders)):
            return f"output {output.name} is (a view of) an input"
    return None


def _is_view_of_input(node: torch.fx.Node, placeholders: set) -> bool:
    while node.op == "call_function" and node.target in (LAYOUT_OPS | VIEW_OPS) - {aten.clone.default,
                                                                                  aten._to_copy.default}:
        node = node.args[0]
        if node in placeholders:
            return True
    return False


def _input_specs(gm: torch.fx.GraphModule, symbols: list[sympy.Symbol]) -> tuple[tuple, ...] | str:
    specs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            expr = _expr(value)
            specs.append(("size", str(expr)) if expr in symbols else ())
            if expr not in symbols and expr.free_symbols & set(symbols):
                return f"input {node.name} is the size expression {expr}"
            continue
        dims = []
        for dim, size in enumerate(_shape(value) or []):
            if size in symbols:
                dims.append((dim, str(size)))
            elif size.free_symbols & set(symbols):
                return f"input {node.name} has the size expression {size} in dim {dim}"
        specs.append(("tensor", tuple(dims)) if dims else ())
    return tuple(specs)


def _output_specs(gm: torch.fx.GraphModule, symbols: list[sympy.Symbol]) -> tuple:
    specs = []
    for output in gm.graph.output_node().args[0]:
        value = output.meta.get("val") if isinstance(output, torch.fx.Node) else None
        shape = _shape(value) or []
        specs.append(tuple((dim, size) for dim, size in enumerate(shape) if size.free_symbols & set(symbols)))
    return tuple(specs)


def plan_buckets(gm: torch.fx.GraphModule, multiple: int) -> BucketPlan:
    """Which size symbols of ``gm`` may be padded to ``multiple`` without changing its real results."""
    symbols, reasons = [], []
    whole_graph = _graph_reason(gm)
    candidates = _symbols(gm) if multiple > 1 else []
    for symbol in candidates:
        if whole_graph:
            reasons.append(f"{symbol}: {whole_graph}")
            continue
        found = next((reason for node in gm.graph.nodes if node.op == "call_function"
                      for reason in [_reason(node, symbol)] if reason), None)
        if found:
            reasons.append(f"{symbol}: {found}")
        else:
            symbols.append(symbol)
    specs = _input_specs(gm, symbols)
    if isinstance(specs, str):
        return BucketPlan(multiple, (), (), (), (*reasons, f"{', '.join(map(str, symbols))}: {specs}"))
    outputs = _output_specs(gm, symbols)
    mixed = [size for dims in outputs for _, size in dims if size.free_symbols - set(symbols)]
    if mixed:  # its unpadded size needs a symbol the call's padded inputs do not give
        return BucketPlan(multiple, (), (), (), (*reasons, f"an output's size {mixed[0]} mixes padded and other sizes"))
    return BucketPlan(multiple, tuple(map(str, symbols)), specs, outputs, tuple(reasons))
