"""Fusion stage, last step: the order a region's kernels are launched in, keys and values before queries.

Input: the fused kernels in a valid launch order (each kernel after the writers of what it reads). Output: the same
kernels in another valid order: before each attention kernel, first the kernels its keys and values need (their
writers, and theirs, back to the previous attention kernel), then the others in their order; unless q has a
projection of its own. Among the kernels keys and values need, a projection with a rotary epilogue goes ahead of
the plain projections just before it that it does not depend on, and adjacent ones the largest first
(``rotaries_first``).

Why: an attention kernel's first query tile needs every key and value but only its own rows of q, and the engines
take instructions in launch order wherever their data allow (runtime/simulator/schedule.py, as the device's queues
do). Flux computes q and k in one paired projection, then q's norm and rotary before k's (the graph's order), and
its single block's MLP projection before both: the attention kernel waited for all of it. With k's chain first it
starts as soon as k and v are done, while q's rows and the MLP projection finish beside it (the single block:
725.5 -> 699.6 us at the mid size). Where q has a projection of its own (Llama: four times the weights of k and
v's), q's chain is the one the attention waits for, and it keeps its place (moving k's first costs the 1-layer
Llama 3.4 us).
"""

from __future__ import annotations

import math

from neuron_compile import ir, kinds


def _writers(kernels: list[ir.Node]) -> dict[str, list[int]]:
    writers: dict[str, list[int]] = {}
    for index, kernel in enumerate(kernels):
        for store in kinds.stores(kernel):
            writers.setdefault(store.buffer.name, []).append(index)
    return writers


def _needed_by(buffers: list[str], kernels: list[ir.Node], writers: dict[str, list[int]]) -> set[int]:
    """The kernels (indices) that write ``buffers``, and those that write what they read, and so on."""
    needed: set[int] = set()
    pending = [index for buffer in buffers for index in writers.get(buffer, [])]
    while pending:
        index = pending.pop()
        if index not in needed:
            needed.add(index)
            pending += [writer for load in kinds.loads(kernels[index]) for writer in writers.get(load.buffer, [])]
    return needed


PROJECTIONS = (ir.MatMul, ir.NormedMatMul, ir.MatMulRotary)


def keys_and_values_first(kernels: list[ir.Node]) -> list[ir.Node]:
    """``kernels`` with, before each attention kernel, the kernels since the previous one that its keys and values
    need moved ahead of the others (see the module docstring), unless q has a projection of its own (Llama's q
    projection, four times its k and v projections' weights, is the chain the attention waits for: it stays first).
    The moved kernels need nothing the others write (what they need is moved too), so the order stays valid."""
    kernels = list(kernels)
    start = 0
    for position in range(len(kernels)):
        attention = kernels[position]
        if not isinstance(attention, ir.Attention):
            continue
        writers = _writers(kernels)
        needed = _needed_by([attention.k.buffer, attention.v.buffer], kernels, writers)
        between = range(start, position)
        queries_only = set(between) & (_needed_by([attention.q.buffer], kernels, writers) - needed)
        if any(isinstance(kernels[index], PROJECTIONS) for index in queries_only):
            start = position + 1  # q's own projection is the longer chain: it leads, as in the graph
            continue
        first = rotaries_first([kernels[index] for index in between if index in needed])
        kernels[start:position] = first + [kernels[index] for index in between if index not in needed]
        start = position + 1
    return kernels


PLAIN_PROJECTIONS = (ir.MatMul, ir.NormedMatMul)


def _independent(first: ir.Node, second: ir.Node) -> bool:
    """Whether neither kernel reads a buffer the other writes: their order does not matter (two writers of one
    buffer, a concat assembled in place, write disjoint slices of it: ``pipeline.check_single_writer``)."""
    def read(kernel: ir.Node) -> set[str]:
        return {load.buffer for load in kinds.loads(kernel)}

    return not (read(first) & _written(second) or read(second) & _written(first))


def _written(kernel: ir.Node) -> set[str]:
    return {store.buffer.name for store in kinds.stores(kernel)}


def rotaries_first(kernels: list[ir.Node]) -> list[ir.Node]:
    """``kernels`` with each projection that rotates its products (``ir.MatMulRotary``) moved ahead of the plain
    projections launched before it, back to the earliest of the kernels just before it that it does not depend on
    (nor they on it): its epilogue (norms and rotaries on the three vector engines, the busier half of its time)
    then starts first, and the plain projections' matmuls fill TensorE while it runs, instead of TensorE idling at
    its end while its last tiles' epilogues finish (Flux's double block: its v projections, then the text and image
    q / k kernels, whose end the attention waits for). Without a plain projection among them it keeps its place."""
    kernels = list(kernels)
    for position, kernel in enumerate(kernels):
        if not isinstance(kernel, ir.MatMulRotary):
            continue
        target, earlier = position, position
        while earlier > 0 and _independent(kernel, kernels[earlier - 1]):
            earlier -= 1
            if isinstance(kernels[earlier], PLAIN_PROJECTIONS):
                target = earlier
        kernels.insert(target, kernels.pop(position))
    return _largest_rotaries_first(kernels)


def _largest_rotaries_first(kernels: list[ir.Node]) -> list[ir.Node]:
    """``kernels`` with each run of adjacent, mutually independent ``MatMulRotary`` kernels ordered by their
    epilogues' work, the largest first (the longest chain starts first: Flux's image q / k kernel, four times its
    text one, whose input norm is done first too)."""
    def work(kernel: ir.MatMulRotary) -> int:
        return math.prod(kernel.domain) * len(kernel.rotaries)

    kernels, start = list(kernels), 0
    while start < len(kernels):
        end = start
        while end < len(kernels) and isinstance(kernels[end], ir.MatMulRotary):
            end += 1
        run = kernels[start:end]
        if all(_independent(first, second) for index, first in enumerate(run) for second in run[index + 1:]):
            kernels[start:end] = sorted(run, key=lambda kernel: -work(kernel))
        start = max(end, start + 1)
    return kernels

