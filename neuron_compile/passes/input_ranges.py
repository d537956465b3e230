"""Specialization stage (graph pass, after ``specialize``): bounds on integer graph inputs, from a call-time guard.

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
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from neuron_compile.passes.value_range import RANGE_KEY, Interval

# Integer inputs whose every value lies within +-GUARD_BOUND are bounded by it (2**4 below the exact fp32 integers:
# room for a few additions and small multiples).
GUARD_BOUND = 2**20
# Larger integer tensors are not checked (the guard runs on every call and must stay cheap): they stay unknown.
GUARDED_NUMEL = 4096
GUARDED_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
GUARDED_INTERVAL = Interval(-float(GUARD_BOUND), float(GUARD_BOUND))


def guard_bound(value) -> Interval | None:
    """``GUARDED_INTERVAL`` if ``value`` is a small integer tensor whose values all lie within it, else None.

    Fake and meta tensors (no values), sparse ones and empty tensors (no values to bound) give None."""
    if not isinstance(value, torch.Tensor) or value.dtype not in GUARDED_DTYPES:
        return None
    if value.layout != torch.strided or value.device.type == "meta":
        return None  # sparse and meta tensors: no cheap minimum and maximum of their values
    if value.numel() == 0 or value.numel() > GUARDED_NUMEL:
        return None
    if isinstance(value, FakeTensor):
        return None
    low, high = torch.aminmax(value.detach())
    if -GUARD_BOUND <= int(low) and int(high) <= GUARD_BOUND:
        return GUARDED_INTERVAL
    return None


def bound_integer_inputs(gm: torch.fx.GraphModule, args: list) -> torch.fx.GraphModule:
    """``gm`` with each integer placeholder whose argument passes ``guard_bound`` bounded by it (a copy of the graph;
    ``gm`` itself, which the dispatch cache shares between signatures, is not touched); ``gm`` when none does."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    bounds = [guard_bound(arg) for arg in args]
    if not any(bound is not None for bound in bounds):
        return gm
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})  # node metas are copied shallowly: setting a key here leaves gm's alone
    graph.output(output)
    bounded = torch.fx.GraphModule(gm, graph)
    for node in bounded.graph.nodes:
        node.meta.pop(RANGE_KEY, None)  # ranges inferred without the bounds are recomputed with them
    copies = [node for node in bounded.graph.nodes if node.op == "placeholder"]
    for original, node, bound in zip(placeholders, copies, bounds):
        if bound is not None and original.name == node.name:
            node.meta[RANGE_KEY] = bound
    bounded.recompile()
    return bounded


def describe_bounds(gm: torch.fx.GraphModule) -> str:
    """The bounded placeholders, one line each (the pass's dump text)."""
    lines = [f"{node.name}: {node.meta[RANGE_KEY]}" for node in gm.graph.nodes
             if node.op == "placeholder" and node.meta.get(RANGE_KEY) is not None]
    return "\n".join(lines) if lines else "(no integer input bounded)"
