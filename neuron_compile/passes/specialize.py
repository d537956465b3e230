"""Specialization stage: give a dynamic ATen graph the concrete shapes of one call.

Input: an ATen GraphModule from aot_autograd (placeholders may be SymInts and tensors with symbolic sizes,
when Dynamo compiled with ``dynamic=True``, ``mark_dynamic`` or automatic dynamic shapes) and the concrete
arguments of one call. Output: a GraphModule with the same placeholders (so it takes the same arguments)
whose every ``node.meta["val"]`` has concrete sizes and strides; SymInt arithmetic is folded into constants.
A graph that is already static, called with the strides it was traced with, is returned as is.

How, for a static graph called with other strides (a weight the runtime passes column-major,
runtime/weight_layouts.py): in a copy of the graph, only the nodes downstream of those inputs run again, in the fake
mode the graph was traced with, and only as far as results differ from what was traced (``mm`` of a transposed
weight is row-major either way); every other node keeps its traced value, so all stay in one fake mode, as the
passes that compute a new node's value from its inputs' (the attention pattern) require. That mode is the graph's,
shared by the threads that call it: the caller holds Dynamo's compile lock (runtime/compiled_graph.py), as every
compile of the graph does.

How, otherwise (a dynamic graph; a static one whose values are not all fake tensors of one mode, or whose in-place
ops may change metadata): a copy of the graph is run node by node on fake tensors of this call's arguments (a
``FakeTensorMode`` without a shape environment, so every size is a plain int), each node's ``meta["val"]`` is
replaced by what it computed, and every node that computed a Python number (``sym_size``, SymInt arithmetic) is
folded into its users as a constant. The ATen ops stay the very same nodes.

This runs at call time, in whatever thread calls the compiled model, beside Dynamo compiling other frames in
other threads. So it touches no process-wide state: no ``make_fx`` / FX ``Tracer`` (which sets FX's global
"symbolic tracing now" flag and patches ``torch.nn.Module.__getattr__`` and ``__call__`` for every thread while
it runs, and restores them by save / restore, so two overlapping traces leave them set for good) and no
``fx.Interpreter`` (which swaps FX's global ``current_meta`` while another thread's aot_autograd traces). A
fake mode is entered on this thread's dispatch stack only.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import map_aggregate, map_arg

from neuron_compile.passes.graph_copies import lazy_copy

aten = torch.ops.aten

# Run-time checks on symbols (``torch._check``): once their arguments are constants (and the propagation, which
# ran them, did not raise) they check nothing.
SYMBOLIC_ASSERTIONS = (aten._assert_scalar.default, aten.sym_constrain_range.default,
                       aten.sym_constrain_range_for_size.default)
# Metadata that describes the symbolic shapes the graph was traced with (the concrete ``val`` replaces it).
SYMBOLIC_META = ("tensor_meta", "unbacked_bindings")


def _is_symbolic(value) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(dim, torch.SymInt) for dim in (*value.shape, *value.stride()))
    if isinstance(value, list | tuple):
        return any(_is_symbolic(item) for item in value)
    return False


def is_dynamic(gm: torch.fx.GraphModule) -> bool:
    """True if any node of ``gm`` carries a symbolic size, stride or scalar."""
    return any(_is_symbolic(node.meta.get("val")) for node in gm.graph.nodes)


def _snapshot(value):
    """What a node's meta keeps of its value: fake tensors detached, so that a later in-place op that changes
    metadata (``resize_``) does not change an earlier node's record."""
    return map_aggregate(value, lambda item: item.detach() if isinstance(item, FakeTensor) else item)


def _may_change_metadata(gm: torch.fx.GraphModule) -> bool:
    """Whether an in-place op of ``gm`` might change a tensor's metadata after it was recorded: any mutating op
    but ``copy_`` (the only one functionalized graphs keep for input mutations, and it changes data only). Without
    one, no record needs a snapshot: a fake tensor's detach costs about as much as the op that made it."""
    return any(node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
               and node.target._schema.is_mutable and node.target is not aten.copy_.default
               for node in gm.graph.nodes)


def _propagate(gm: torch.fx.GraphModule, args: list, mode: FakeTensorMode) -> None:
    """Run ``gm``'s graph on fakes of ``args`` under ``mode`` and store each node's value in ``meta["val"]``."""
    record = _snapshot if _may_change_metadata(gm) else (lambda value: value)
    values: dict[torch.fx.Node, object] = {}
    arguments = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(arguments)
            value = mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            value = mode.from_tensor(value, static_shapes=True) if isinstance(value, torch.Tensor) else value
        elif node.op == "call_function":
            positional = map_arg(node.args, values.__getitem__)
            keywords = map_arg(node.kwargs, values.__getitem__)
            with mode:
                value = node.target(*positional, **keywords)
        elif node.op == "output":
            continue
        else:  # call_module / call_method: not in aot_autograd's ATen graphs
            raise NotImplementedError(f"specialize: node {node.name} is a {node.op}, not an ATen graph node")
        values[node] = value
        node.meta["val"] = record(value)
        for key in SYMBOLIC_META:
            node.meta.pop(key, None)


def _fold_numbers(graph: torch.fx.Graph) -> None:
    """Put every Python number a node computed into its users as a constant; drop the nodes left without use."""
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.op not in ("placeholder", "call_function") or isinstance(value, torch.Tensor):
            continue
        if not isinstance(value, bool | int | float):
            continue
        for user in list(node.users):
            user.args = map_arg(user.args, lambda arg, node=node, value=value: value if arg is node else arg)
            user.kwargs = map_arg(user.kwargs, lambda arg, node=node, value=value: value if arg is node else arg)
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if isinstance(node.meta.get("val"), bool | int | float) or node.target in SYMBOLIC_ASSERTIONS:
            graph.erase_node(node)


def _strides_differ(gm: torch.fx.GraphModule, args: list) -> bool:
    """True if a tensor argument has other strides than its placeholder was traced with (a weight the runtime
    passes column-major, runtime/weight_layouts.py): the kernels must then be planned for the call's layout."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for node, arg in zip(placeholders, args, strict=False):
        traced = node.meta.get("val")
        if isinstance(arg, torch.Tensor) and isinstance(traced, torch.Tensor) and arg.stride() != traced.stride():
            return True
    return False


def _tensors(value) -> list:
    """The tensors in a recorded value (a tensor, or a list / tuple of values)."""
    if isinstance(value, list | tuple):
        return [tensor for item in value for tensor in _tensors(item)]
    return [value] if isinstance(value, torch.Tensor) else []


def _traced_mode(gm: torch.fx.GraphModule) -> FakeTensorMode | None:
    """The one fake mode every traced tensor of ``gm`` belongs to; None if a node has no value, a tensor is not
    fake, or the tensors belong to several modes."""
    modes = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "val" not in node.meta:
            return None
        for tensor in _tensors(node.meta["val"]):
            if not isinstance(tensor, FakeTensor):
                return None
            modes.add(tensor.fake_mode)
    return modes.pop() if len(modes) == 1 else None


def _same_metadata(first, second) -> bool:
    """Whether two recorded values have the same sizes, strides, storage offsets, dtypes and devices (tensors), or
    are equal (anything else, item by item in lists and tuples)."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        return (first.shape == second.shape and first.stride() == second.stride() and first.dtype == second.dtype
                and first.storage_offset() == second.storage_offset() and first.device == second.device)
    if isinstance(first, list | tuple) and isinstance(second, list | tuple):
        return len(first) == len(second) and all(map(_same_metadata, first, second))
    return type(first) is type(second) and not isinstance(first, torch.Tensor) and first == second


def _propagate_changes(gm: torch.fx.GraphModule, args: list, mode: FakeTensorMode) -> None:
    """Run again, in ``mode``, the nodes of the static ``gm`` that read a value whose metadata differs from what was
    traced (the placeholders: ``args``'), each on its inputs' values; record only the results that differ too."""
    changed: dict[torch.fx.Node, object] = {}
    arguments = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(arguments)
            if isinstance(value, torch.Tensor) and not _same_metadata(value, node.meta["val"]):
                changed[node] = mode.from_tensor(value, static_shapes=True)
        elif node.op == "call_function" and any(source in changed for source in node.all_input_nodes):
            def current(source: torch.fx.Node):
                return changed.get(source, source.meta["val"])

            with mode:
                value = node.target(*map_arg(node.args, current), **map_arg(node.kwargs, current))
            if not _same_metadata(value, node.meta["val"]):
                changed[node] = value
    for node, value in changed.items():
        node.meta["val"] = value
        for key in SYMBOLIC_META:
            node.meta.pop(key, None)


def specialize(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """``gm`` with the concrete shapes and strides of ``args`` (real tensors and ints of one call); a static graph
    called with the strides it was traced with is returned unchanged."""
    dynamic = is_dynamic(gm)
    if not dynamic and not _strides_differ(gm, args):
        return gm
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})  # node metas are copied (shallowly): ``gm`` keeps its own
    graph.output(output)
    specialized = lazy_copy(gm, graph)
    # aot_autograd's graphs are already differentiated: run them without autograd, on detached inputs (a
    # parameter that requires grad would otherwise give every meta value requires_grad).
    detached = [arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args]
    traced_mode = None if dynamic or _may_change_metadata(gm) else _traced_mode(gm)
    with torch.no_grad():
        if traced_mode is not None:  # no symbol to fold: the graph's code stays as it is
            _propagate_changes(specialized, detached, traced_mode)
            return specialized
        _propagate(specialized, detached, FakeTensorMode(allow_non_fake_inputs=True))
    _fold_numbers(specialized.graph)
    specialized.graph.lint()
    specialized.recompile()
    return specialized
