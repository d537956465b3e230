"""Lowering stage: the one registry of ATen lowerings, and the driver that walks a graph through it.

Input: a torch.fx.GraphModule of ATen ops with ``meta["val"]`` on every node. Output: ``LoweredRegion`` — the
IR nodes (in graph order), the graph-input buffers and, for every graph output, the buffer and layout it is
read from. ``unsupported_reason(node, target)`` answers the partitioner: None if the node can be lowered for the
hardware target, else why not.

Each family module registers its ops with ``@register_lowering(aten.x, ...)``; a lowering takes
``(ctx, node)`` and returns a ``TensorValue`` (or raises ``LoweringError``). A lowering may attach a
``check(node) -> str | None`` for node-specific limits (dims, dtypes, tiling) and a
``target_check(node, target) -> str | None`` for limits that depend on the hardware target (SBUF bytes).

This module imports no family: the package (``neuron_compile.lowering``) imports every family module, each of
which registers itself here, so ``import neuron_compile.lowering`` has every lowering registered.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch

from neuron_compile import ir
from neuron_compile.errors import LoweringError
from neuron_compile.hardware import Target, get_target
from neuron_compile.ir import TensorValue
from neuron_compile.kernel_dtypes import SUPPORTED_DTYPES
from neuron_compile.limits import FP32_EXACT_INTEGER
from neuron_compile.passes.value_range import EXACT_INTEGER_BOUND, value_range

# Integer tensors get an int32 kernel dtype (kernel_dtypes.SUPPORTED_DTYPES). Vector/Scalar engines compute in fp32,
# so only ops in INTEGER_OPS (views, and lowerings that keep integer values exact, e.g. gather indices) may touch
# them; the rest stay eager.
INTEGER_DTYPES = (torch.int32, torch.int64)
INTEGER_OPS: set = set()
# Ops whose lowerings compute integers in fp32 tiles: exact when every integer they read or write (and the float
# a cast to an integer reads) is proved within +-2**24 by passes/value_range.py; otherwise eager, with that reason.
INTEGER_ARITHMETIC_OPS: set = set()
# complex64 has no NKI dtype: a complex graph input enters a region as its fp32 (real, imaginary) pairs (a view,
# torch.view_as_real, taken at the region boundary), and only the ops in this set may read it there.
COMPLEX_INPUT_OPS: set = set()


# Tensors of higher rank run eagerly. Tiling collapses mergeable dims and walks the rest as outer loops, so rank
# itself is not a hardware limit; 8 bounds the loop nests a kernel unrolls (pixel_shuffle needs 6).
MAX_RANK = 8


@dataclasses.dataclass(frozen=True)
class LoweringRule:
    lower: Callable
    check: Callable | None = None  # check(node) -> reason | None
    multi_output: bool = False  # the op returns a tuple of tensors, picked by getitem nodes
    target_check: Callable | None = None  # target_check(node, target: Target) -> reason | None


_LOWERINGS: dict = {}
# Lowerings for a non-empty result computed from an empty input (mm with K = 0 is zeros): the op's identity.
_EMPTY_INPUT_LOWERINGS: dict = {}


def register_lowering(*ops, check: Callable | None = None, multi_output: bool = False,
                      target_check: Callable | None = None):
    """Register ``fn(ctx, node) -> TensorValue`` (a tuple of them if ``multi_output``) for each ATen op.

    ``check(node)`` and ``target_check(node, target)`` return None or the reason the node runs eagerly; the
    registry asks ``check`` first."""

    def decorate(fn):
        for op in ops:
            _LOWERINGS[op] = LoweringRule(fn, check, multi_output, target_check)
        return fn

    return decorate


def register_empty_input_lowering(*ops, check: Callable | None = None):
    """Register ``fn(ctx, node)`` for ``ops`` when an input has numel 0 but the result does not."""

    def decorate(fn):
        for op in ops:
            _EMPTY_INPUT_LOWERINGS[op] = LoweringRule(fn, check)
        return fn

    return decorate


def registered_ops() -> list:
    """Every ATen op with a lowering (for coverage reports such as the op-info sweep)."""
    return list(_LOWERINGS)


def resolve_target(target: Target | str | None) -> Target:
    """``target`` as a ``Target``: a Target itself, a target name (``"trn1"``), or None for the default target."""
    return target if isinstance(target, Target) else get_target(target)


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise LoweringError(
            f"dtype {str(dtype).removeprefix('torch.')} is not supported (float32, bfloat16, bool, int32, int64)"
        )
    return SUPPORTED_DTYPES[dtype]


def _tensor_metas(node: torch.fx.Node, with_result: bool = True) -> list:
    metas = []
    for arg in [*node.args, *node.kwargs.values(), *([node] if with_result else [])]:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        for item in items:
            value = item.meta.get("val") if isinstance(item, torch.fx.Node) else None
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(tensor, torch.Tensor):
                    metas.append(tensor)
    return metas


def reads_an_empty_tensor(node: torch.fx.Node) -> bool:
    """Whether a tensor argument of ``node`` has numel 0."""
    return any(meta.numel() == 0 for meta in _tensor_metas(node, with_result=False))


def produces_no_elements(node: torch.fx.Node) -> bool:
    """Whether every tensor ``node`` returns has numel 0 (such a node is lowered to a buffer, no instructions)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    tensors = [v for v in values if v is not None]
    return bool(tensors) and all(isinstance(v, torch.Tensor) and v.numel() == 0 for v in tensors)


def unsupported_reason(node: torch.fx.Node, target: Target | str | None = None) -> str | None:
    """None if ``node`` has an NKI lowering for its dtypes and shapes on ``target`` (a ``Target``, a target name, or
    None for the default target, ``hardware.get_target()``), else the reason it runs eagerly."""
    if node.op != "call_function":
        return f"not an ATen call ({node.op})"
    rule = _LOWERINGS.get(node.target)
    if rule is None:
        return f"no lowering for {node.target}"
    value = node.meta.get("val")
    is_tensor_tuple = isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) or v is None for v in value)
    if not (isinstance(value, torch.Tensor) or (rule.multi_output and is_tensor_tuple)):
        return f"{node.target}: no tensor meta['val'] (multi-output or untyped node)"
    empty_result = produces_no_elements(node)
    identity = _EMPTY_INPUT_LOWERINGS.get(node.target)
    integer_ops = INTEGER_OPS | INTEGER_ARITHMETIC_OPS
    for meta in _tensor_metas(node):
        if meta.dtype is torch.complex64 and node.target in COMPLEX_INPUT_OPS:
            continue  # the op's check says which complex values it takes
        if meta.dtype not in SUPPORTED_DTYPES or (meta.dtype in INTEGER_DTYPES and node.target not in integer_ops):
            return f"dtype {str(meta.dtype).removeprefix('torch.')}"
        # An empty result needs no instructions (lower_graph gives it a buffer and no kernel); cat skips empty
        # inputs (an empty KV cache); an empty input of a non-empty result needs the op's identity (mm with
        # K = 0 is zeros): only ops registered with register_empty_input_lowering have one.
        skips_empty = identity is not None or node.target is torch.ops.aten.cat.default
        if meta.numel() == 0 and not empty_result and not skips_empty:
            return "empty tensor (numel 0) feeding a non-empty result"
        if meta.dim() > MAX_RANK:
            return f"rank {meta.dim()} beyond the {MAX_RANK}-D limit"
    if empty_result:
        return None  # the op's own limits concern elements it would compute; there are none
    if node.target in INTEGER_ARITHMETIC_OPS and node.target not in INTEGER_OPS:
        reason = _integer_range_reason(node)
        if reason is not None:
            return reason
    if identity is not None and reads_an_empty_tensor(node):
        return identity.check(node) if identity.check is not None else None
    reason = rule.check(node) if rule.check is not None else None
    if reason is None and rule.target_check is not None:
        reason = rule.target_check(node, resolve_target(target))
    return reason


def _exact_for_every_int32(node: torch.fx.Node) -> bool:
    """Rounding an int32 to fp32 is monotone and keeps every integer below 2**24 (FP32_EXACT_INTEGER) in magnitude:
    comparing any int32 with such a number, or clamping it between two such integers, gives eager's answer whatever
    the value (a label tensor compared with ignore_index, say)."""
    def small(value, integral=False):
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < FP32_EXACT_INTEGER
                and (not integral or float(value).is_integer()))

    aten = torch.ops.aten
    comparisons = (aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)
    if node.target in comparisons:
        return small(node.args[1])
    if node.target is aten.clamp.default and node.meta["val"].dtype in INTEGER_DTYPES:
        bounds = [*node.args[1:3], *node.kwargs.values()]
        return len(bounds) == 2 and all(small(bound, integral=True) for bound in bounds)
    return False


def _integer_range_reason(node: torch.fx.Node) -> str | None:
    """None if every integer ``node`` reads or writes is proved exact in fp32 (and, for a cast to an integer, the
    value it casts), else which value is not."""
    if _exact_for_every_int32(node):
        return None
    result = node.meta["val"]
    casts_to_integer = isinstance(result, torch.Tensor) and result.dtype in INTEGER_DTYPES
    operands = [item for arg in [*node.args, *node.kwargs.values()]
                for item in (arg if isinstance(arg, (list, tuple)) else [arg]) if isinstance(item, torch.fx.Node)]
    for subject in [*operands, node]:
        meta = subject.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            continue
        if meta.dtype not in INTEGER_DTYPES and not (casts_to_integer and meta.is_floating_point()):
            continue
        what = f"{str(meta.dtype).removeprefix('torch.')} values of {subject.name}"
        bounds = value_range(subject)
        if bounds is None:
            return f"{what} not proved within +-2**24 (integer math runs in fp32)"
        if not bounds.within(EXACT_INTEGER_BOUND):
            return f"{what} in {bounds}, beyond +-2**24 (integer math runs in fp32)"
    return None


# ---------------------------------------------------------------- lowering context


@dataclasses.dataclass
class LoweredRegion:
    inputs: list[ir.Buffer]  # one per placeholder, in order; layouts relative to the input's storage offset
    nodes: list[ir.Node]
    outputs: list[TensorValue]
    aten_nodes: int  # ATen call nodes lowered
    # Every buffer the region names; those no kernel writes (empty tensors, numel-0 results) start NaN-filled.
    buffers: dict[str, ir.Buffer] = dataclasses.field(default_factory=dict)
    # (graph-input buffer, value): after the kernels the input tensor holds the value (copy_ into an input).
    mutations: list[tuple[str, TensorValue]] = dataclasses.field(default_factory=list)
    # eager's dtype per output: int64 results live in int32 kernel buffers and are widened when returned
    output_dtypes: list[torch.dtype] = dataclasses.field(default_factory=list)


class LoweringContext:
    """Per-graph state the lowerings share: node values, fresh buffer names, the nodes emitted so far."""

    def __init__(self, target: Target | str | None = None, flash_attention: bool = True, flash_decode: bool = True):
        self.target = resolve_target(target)
        self.flash_attention = flash_attention  # SDPA as one flash-attention kernel (False: three kernels)
        self.flash_decode = flash_decode  # few-query attention may take the split-key decode form
        self.values: dict[torch.fx.Node, TensorValue] = {}
        self.nodes: list[ir.Node] = []
        self.buffers: dict[str, ir.Buffer] = {}
        self._counter = 0
        self.mutations: list[tuple[str, TensorValue]] = []

    def fresh_name(self, stem: str) -> str:
        self._counter += 1
        return f"{stem}_{self._counter}"

    def value(self, arg) -> TensorValue:
        if not isinstance(arg, torch.fx.Node) or arg not in self.values:
            raise LoweringError(f"expected a tensor operand, got {arg!r}")
        return self.values[arg]

    def output_buffer(self, node: torch.fx.Node, stem: str) -> ir.Buffer:
        """A fresh HBM buffer with exactly the sizes and strides eager gives ``node``'s result."""
        return self.new_buffer(node.meta["val"], stem)

    def new_buffer(self, meta: torch.Tensor, stem: str) -> ir.Buffer:
        """A fresh HBM buffer with the sizes, strides and dtype of the (fake) tensor ``meta``."""
        layout = ir.Layout(tuple(meta.shape), tuple(meta.stride()), 0)
        buffer = ir.Buffer(self.fresh_name(stem), dtype_name(meta.dtype), layout)
        self.buffers[buffer.name] = buffer
        return buffer

    def scratch_buffer(self, shape: tuple[int, ...], dtype: str, stem: str) -> ir.Buffer:
        """A fresh contiguous HBM buffer for an intermediate no FX node stands for."""
        buffer = ir.Buffer(self.fresh_name(stem), dtype, ir.Layout(tuple(shape), ir.contiguous_strides(shape), 0))
        self.buffers[buffer.name] = buffer
        return buffer

    def emit(self, node: ir.Node) -> None:
        self.nodes.append(node)


def broadcast_layout(layout: ir.Layout, shape: tuple[int, ...]) -> ir.Layout:
    """``layout`` expanded to ``shape`` by numpy broadcasting rules (new and size-1 dims get stride 0)."""
    pad = len(shape) - len(layout.shape)
    if pad < 0:
        raise LoweringError(f"cannot broadcast shape {list(layout.shape)} to {list(shape)}")
    sizes = (1,) * pad + layout.shape
    strides = (0,) * pad + layout.strides
    out = []
    for size, stride, target in zip(sizes, strides, shape):
        if size == target:
            out.append(stride if size != 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            raise LoweringError(f"cannot broadcast shape {list(layout.shape)} to {list(shape)}")
    return ir.Layout(tuple(shape), tuple(out), layout.offset)


def emit_strided_copy(ctx, value: TensorValue, buffer: ir.Buffer, domain, read_strides, write_strides) -> TensorValue:
    """One copy kernel over ``domain``: ``value`` read and ``buffer`` written through the given strides (each from
    its own offset); a stride of 0 on the read side repeats the source. ``buffer`` as the lowered value."""
    domain = tuple(domain)
    read = ir.Layout(domain, tuple(read_strides), value.layout.offset)
    write = ir.Layout(domain, tuple(write_strides), buffer.layout.offset)
    expr = ir.Load(value.buffer, broadcast_layout(read, domain), value.dtype)
    ctx.emit(ir.Pointwise(ctx.fresh_name("kernel"), domain, (ir.Store(buffer, expr, write),)))
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)


def input_layout(meta: torch.Tensor) -> tuple[ir.Layout, str]:
    """A graph input's buffer layout and kernel dtype; a complex64 input is read as its fp32 pairs: one more dim
    of 2 (real, imaginary), every stride doubled (the region binds ``torch.view_as_real`` of the tensor)."""
    if meta.dtype is torch.complex64:
        return ir.Layout((*meta.shape, 2), (*(2 * stride for stride in meta.stride()), 1), 0), "float32"
    return ir.Layout(tuple(meta.shape), tuple(meta.stride()), 0), dtype_name(meta.dtype)


def load(ctx: LoweringContext, arg, shape: tuple[int, ...]) -> ir.Expr:
    """An operand as an expression over a domain of ``shape``: a broadcast Load, or a Scalar."""
    if isinstance(arg, bool):
        return ir.Scalar(float(arg))
    if isinstance(arg, (int, float)):
        return ir.Scalar(float(arg))
    value = ctx.value(arg)
    return ir.Load(value.buffer, broadcast_layout(value.layout, shape), value.dtype)


def lower_graph(gm: torch.fx.GraphModule, target: Target | str | None = None, *,
                flash_attention: bool = True, flash_decode: bool = True) -> LoweredRegion:
    """Lower every ATen node of ``gm`` (whose nodes carry meta['val']) to IR for ``target`` (None: the default)."""
    target = resolve_target(target)
    ctx = LoweringContext(target, flash_attention, flash_decode)
    inputs, outputs, output_dtypes, aten_nodes = [], [], [], 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            meta = node.meta.get("val")
            if not isinstance(meta, torch.Tensor):
                raise LoweringError(f"graph input {node.name} is not a tensor ({type(meta).__name__})")
            layout, dtype = input_layout(meta)
            buffer = ir.Buffer(node.name, dtype, layout)
            ctx.buffers[buffer.name] = buffer
            ctx.values[node] = TensorValue(buffer.name, layout, buffer.dtype)
            inputs.append(buffer)
        elif node.op == "call_function" and node.target is operator.getitem:
            produced = ctx.values.get(node.args[0])
            if not isinstance(produced, tuple):
                raise LoweringError(f"getitem ({node.name}) of a node that is not a lowered multi-output op")
            ctx.values[node] = produced[node.args[1]]
        elif node.op == "call_function":
            reason = unsupported_reason(node, target)
            if reason is not None:
                raise LoweringError(f"{node.target} ({node.name}): {reason}")
            if produces_no_elements(node):
                ctx.values[node] = _empty_value(ctx, node)
            elif node.target in _EMPTY_INPUT_LOWERINGS and reads_an_empty_tensor(node):
                ctx.values[node] = _EMPTY_INPUT_LOWERINGS[node.target].lower(ctx, node)
            else:
                ctx.values[node] = _LOWERINGS[node.target].lower(ctx, node)
            aten_nodes += 1
        elif node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            for arg in results:
                outputs.append(ctx.value(arg))
                output_dtypes.append(arg.meta["val"].dtype)
        else:
            raise LoweringError(f"unsupported FX node kind {node.op} ({node.name})")
    return LoweredRegion(inputs, ctx.nodes, outputs, aten_nodes, dict(ctx.buffers), list(ctx.mutations),
                         output_dtypes)


def _empty_value(ctx: LoweringContext, node: torch.fx.Node):
    """A numel-0 result: a fresh buffer with eager's sizes and strides that no instruction writes."""
    value = node.meta["val"]
    if isinstance(value, (list, tuple)):
        return tuple(_empty_tensor_value(ctx, v) if v is not None else None for v in value)
    return _empty_tensor_value(ctx, value)


def _empty_tensor_value(ctx: LoweringContext, meta: torch.Tensor) -> TensorValue:
    buffer = ctx.new_buffer(meta, "empty")
    return TensorValue(buffer.name, buffer.layout, buffer.dtype)
