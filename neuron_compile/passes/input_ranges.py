"""Specialization stage (graph pass, after ``specialize``): bounds on graph inputs, from a call-time guard.

Input: an ATen GraphModule with concrete shapes and the real arguments of one call. Output: the same graph (a copy,
when anything is bounded) whose integer placeholders carry ``meta[RANGE_KEY] = Interval(-GUARD_BOUND,
GUARD_BOUND)`` when the call's values lie within it, so ``passes/value_range.py`` can prove the integer arithmetic
built on them (a decode step's ``cache_position + 1``, ``arange(n) + position``) exact in fp32, and the
partitioner puts it in NKI regions instead of eager.

Why a guard: values are not part of a shape signature, so what the compiled graph assumes of them must be checked
on every call. ``guard_bound(tensor)`` is that check — one ``aminmax`` over a small integer tensor (at most
``GUARDED_NUMEL`` elements; larger ones are not guarded and stay unknown) — and its answer is part of the dispatch
key (``runtime/cache.signature_of``). A call whose integers leave the bound gets a different key and compiles
(or finds) the graph without that assumption, where the integer math runs eagerly as before: never a wrong answer.

The bound is one class, not the values seen: +-2**20 leaves room below the fp32-exact +-2**24 for the sums and
offsets position arithmetic adds, and a single class means a value moving inside it (the next token's position,
labels with or without -100) never recompiles.

Float inputs are guarded only where a bound pays: float inputs of up to ``GUARDED_FLOAT_NUMEL`` elements whose
values reach the argument of a sin or cos through ops value ranges follow (``range_guarded_floats``: a rotary
embedding's ``inv_freq`` times the positions, or the angles a backward recomputes cos and sin from), so
lowering/trigonometry.py can choose a cheap argument reduction, or a cast to an integer, which lowers only when its
float values are proved within +-2**24 (positions a backward recomputes from a saved float cumsum). Their guard
(``guard_float_bound``) checks that every value is finite and within a power of two (at least 1, at most
``FLOAT_GUARD_MAX``): a class per binade, so a buffer that never changes compiles once, and a value leaving its
class compiles (or finds) the graph for the new class, or the unbounded one with the exact reduction. A tensor a
forward graph returned with a bound it proved (``proved_output_bounds``: the rotary angles saved for the backward)
carries that class (runtime/proved_bounds.py), and the guard takes it without reading the values.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from neuron_compile.passes.graph_copies import lazy_copy
from neuron_compile.passes.value_range import RANGE_KEY, RULES, Interval, value_range
from neuron_compile.runtime import proved_bounds

# Integer inputs whose every value lies within +-GUARD_BOUND are bounded by it (2**4 below the exact fp32 integers:
# room for a few additions and small multiples).
GUARD_BOUND = 2**20
# Larger integer tensors are not checked (the guard runs on every call and must stay cheap): they stay unknown.
GUARDED_NUMEL = 4096
# Float inputs reaching a sin or cos are checked up to this size: a rotary embedding's angles, which aot_autograd's
# partitioner saves for the backward to recompute cos and sin from ([seq, head_dim]: 16384 at 256 x 64, 65536 at
# 1024 x 64). One fp32 aminmax of 65536 elements takes ~10 us on the host (4096: ~2 us); the bound it gives spares
# each of the backward's cos and sin kernels the full argument reduction (~400 instructions per element instead of
# ~20, lowering/trigonometry.py).
GUARDED_FLOAT_NUMEL = 2**16
GUARDED_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
GUARDED_INTERVAL = Interval(-float(GUARD_BOUND), float(GUARD_BOUND))
# Float inputs: finite values within +-2**k for the smallest k >= 0 that holds them, up to 2**20; beyond, unbounded.
FLOAT_GUARD_MAX = 2.0**20
# The bound of each class, made once: a caller may compare the bounds of two calls by identity.
FLOAT_BOUNDS = {exponent: Interval(-2.0**exponent, 2.0**exponent) for exponent in range(21)}
GUARDED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Proved output bounds tag a forward's outputs up to this class: lowering/trigonometry.py's CODY_WAITE_LIMIT, below
# which every class lowers sin and cos the same way (tests/test_proved_bounds.py checks the two agree).
TAGGED_BOUND_MAX = 2.0**12
PROOF_ROUNDING_SLACK = 2.0**-20  # a proved bound widened by this before its class is taken (one fp32 rounding)
# The ops whose argument's range decides the code lowered for them (the trigonometry's argument reduction).
RANGE_CONSUMERS = (torch.ops.aten.sin.default, torch.ops.aten.cos.default)
# Casts whose float argument must be proved within +-2**24 for them to lower at all (integer math runs in fp32):
# OPT's position ids, cumsum -> mul -> sub -> int64, recomputed in the backward from the saved float cumsum.
CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def guard_bound(value) -> Interval | None:
    """``GUARDED_INTERVAL`` if ``value`` is a small integer tensor whose values all lie within it, else None.

    Fake and meta tensors (no values), sparse ones (no cheap minimum and maximum) and empty tensors (no values to
    bound) give None."""
    return integer_values_bound(value) if _checkable(value, GUARDED_DTYPES, GUARDED_NUMEL) else None


def integer_values_bound(tensor: torch.Tensor) -> Interval | None:
    """``guard_bound`` of a tensor known to be one it checks (``guard_reads_values``): one ``aminmax``."""
    low, high = torch.aminmax(tensor.detach() if tensor.requires_grad else tensor)
    if -GUARD_BOUND <= int(low) and int(high) <= GUARD_BOUND:
        return GUARDED_INTERVAL
    return None


def guard_reads_values(value, float_guard: bool = False) -> bool:
    """Whether ``guard_bound`` (``guard_float_bound`` with ``float_guard``) reads ``value``'s values: a tensor's
    type, dtype, layout, device and size decide it, so a caller that knows them unchanged knows the answer."""
    if float_guard:
        return _checkable(value, GUARDED_FLOAT_DTYPES, GUARDED_FLOAT_NUMEL)
    return _checkable(value, GUARDED_DTYPES, GUARDED_NUMEL)


def _checkable(value, dtypes, most: int) -> bool:
    """A real (not fake or meta), strided, non-empty tensor of ``dtypes`` small enough to check on every call (at
    most ``most`` elements)."""
    if not isinstance(value, torch.Tensor) or value.dtype not in dtypes or isinstance(value, FakeTensor):
        return False
    if value.layout != torch.strided or value.device.type == "meta":
        return False
    return 0 < value.numel() <= most


def guard_float_bound(value) -> Interval | None:
    """``Interval(-2**k, 2**k)`` for the smallest ``k >= 0`` holding every value of a small float tensor, if all are
    finite and ``2**k <= FLOAT_GUARD_MAX``; None otherwise (and for what ``guard_bound`` also refuses)."""
    return float_values_bound(value) if _checkable(value, GUARDED_FLOAT_DTYPES, GUARDED_FLOAT_NUMEL) else None


def float_values_bound(tensor: torch.Tensor) -> Interval | None:
    """``guard_float_bound`` of a tensor known to be one it checks (``guard_reads_values``): the bound the graph
    that made it proved (runtime/proved_bounds.py), else one ``aminmax``."""
    proved = proved_bounds.bound_of(tensor)
    if proved is not None:  # no value read
        return proved
    # one op: this runs on every call of the graph
    low, high = torch.aminmax(tensor.detach() if tensor.requires_grad else tensor)
    return _float_class(max(-float(low), float(high)))


def _float_class(magnitude: float) -> Interval | None:
    """The class ``Interval(-2**k, 2**k)`` of the smallest ``k >= 0`` holding ``magnitude``; None past
    ``FLOAT_GUARD_MAX`` (and for nan: max() of a nan and a number may pick either, so nan is refused here)."""
    if math.isnan(magnitude) or not magnitude <= FLOAT_GUARD_MAX:
        return None
    return FLOAT_BOUNDS[max(0, math.ceil(math.log2(magnitude))) if magnitude > 0 else 0]


def proved_output_bounds(gm: torch.fx.GraphModule) -> tuple[tuple[int, Interval], ...]:
    """(output position, float class) for each float output of ``gm`` (a forward graph, its inputs bounded by the
    ``bound inputs`` pass) whose value range the graph proves within ``TAGGED_BOUND_MAX``: the class the float guard
    would find for it, or a wider one, with one fp32 rounding of slack (passes/value_range.py). The forward tags its
    outputs with them (runtime/proved_bounds.py), so the backward's guard reads no values. Only below
    ``TAGGED_BOUND_MAX``: a proof can be looser than the values (positions that are an integer input prove only the
    integer guard's +-2**20), and a class the lowering tells apart from a finer one would then cost code."""
    bounds = []
    for position, node in enumerate(gm.graph.output_node().args[0]):
        if not isinstance(node, torch.fx.Node) or not _is_float(node.meta.get("val")):
            continue
        proved = value_range(node)
        if proved is None:
            continue
        bound = _float_class(max(-proved.low, proved.high) * (1 + PROOF_ROUNDING_SLACK))
        if bound is not None and bound.high <= TAGGED_BOUND_MAX:
            bounds.append((position, bound))
    return tuple(bounds)


def range_guarded_floats(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the placeholders whose float values reach a ``RANGE_CONSUMERS`` argument or a cast to an
    integer through ops value ranges follow (passes/value_range.py's rules): the float inputs worth a call-time
    guard."""
    reached, stack = set(), [node.args[0] for node in gm.graph.nodes if _consumes_a_range(node)]
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in reached:
            continue
        reached.add(node)
        if node.op == "call_function" and node.target in RULES:
            stack.extend(node.all_input_nodes)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    return frozenset(position for position, node in enumerate(placeholders)
                     if node in reached and _is_float(node.meta.get("val")))


def _consumes_a_range(node: torch.fx.Node) -> bool:
    """A ``RANGE_CONSUMERS`` op, or a cast to an integer dtype."""
    if node.op != "call_function":
        return False
    if node.target in RANGE_CONSUMERS:
        return True
    result = node.meta.get("val")
    return node.target in CASTS and isinstance(result, torch.Tensor) and result.dtype in GUARDED_DTYPES


def _is_float(meta) -> bool:
    return isinstance(meta, torch.Tensor) and meta.dtype in GUARDED_FLOAT_DTYPES


def input_bounds(args: list, float_guarded: frozenset[int]) -> list[Interval | None]:
    """Each argument's bound: ``guard_bound`` for integers, ``guard_float_bound`` at the float-guarded positions."""
    return [guard_float_bound(arg) if position in float_guarded else guard_bound(arg)
            for position, arg in enumerate(args)]


def bound_integer_inputs(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """``gm`` with each integer placeholder whose argument passes ``guard_bound`` bounded by it, and each float one of
    ``range_guarded_floats`` by ``guard_float_bound`` (a copy of the graph; ``gm`` itself, which the dispatch cache
    shares between signatures, is not touched); ``gm`` when none is bounded."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    bounds = input_bounds(args, range_guarded_floats(gm))
    if not any(bound is not None for bound in bounds):
        return gm
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})  # node metas are copied shallowly: setting a key here leaves gm's alone
    graph.output(output)
    bounded = lazy_copy(gm, graph)
    for node in bounded.graph.nodes:
        node.meta.pop(RANGE_KEY, None)  # ranges inferred without the bounds are recomputed with them
    copies = [node for node in bounded.graph.nodes if node.op == "placeholder"]
    for original, node, bound in zip(placeholders, copies, bounds):
        if bound is not None and original.name == node.name:
            node.meta[RANGE_KEY] = bound
    return bounded


def describe_bounds(gm: torch.fx.GraphModule) -> str:
    """The bounded placeholders, one line each (the pass's dump text)."""
    lines = [f"{node.name}: {node.meta[RANGE_KEY]}" for node in gm.graph.nodes
             if node.op == "placeholder" and node.meta.get(RANGE_KEY) is not None]
    return "\n".join(lines) if lines else "(no input bounded)"
