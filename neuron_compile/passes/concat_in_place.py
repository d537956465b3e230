"""Fusion stage: a concatenation assembled in place, its inputs written by their producers into its output.

Input: a region's IR nodes before grouping (``mark_in_place``), then its fused kernels in launch order
(``assemble_in_place``). Output: the nodes with the eligible concats marked (``ir.Concat.in_place``); then the
kernels with each marked concat's inputs stored by their writers straight into their slices of its output, every
other reader of an input reading it there, and the concat kernel gone.

Why: ``cat`` of values that kernels produce (Flux's joint q, k and v: the text tokens' rows, then the image
tokens'; its single block's ``cat([attention, mlp], -1)``) is otherwise one more kernel that reads every input back
from HBM and writes it again, an HBM round trip of its whole output. A producer stores through an access pattern
anyway, so storing into a slice of a larger buffer (another row stride, an offset) costs it nothing (Inductor
realizes a concat's inputs into the output's buffer the same way).

Which concats: every part copies one whole buffer (no math; every element once, in the buffer's own order), a buffer
a node of the region writes (not a graph input), not a region output, each buffer once, into a slice of contiguous
runs of at least ``MIN_RUN_BYTES`` (a stack on the last dim stays a concat: it interleaves on chip). A marked concat
takes no prologue or epilogue, so its parts stay copies. After grouping, a part's input has one writer kernel; its
stores and every read of it are restated in the output (``restated_in``); when a restatement does not exist, or a
kernel would store the output twice or no longer tile, the concat stays a kernel (a plain copy) and the decision
says why. The output then has several writer kernels, each writing disjoint elements, which only a region launched
as one kernel allows (its subkernels write into the buffers the region kernel allocates): the caller asks for this
pass only then, and passes the assembled buffers to ``pipeline.check_single_writer``.
"""

from __future__ import annotations

import dataclasses
import math

from neuron_compile import ir, kinds


def restated_in(layout: ir.Layout, shape: tuple[int, ...], view: ir.Layout) -> ir.Layout | None:
    """``layout``, an access pattern into a contiguous buffer of ``shape``, as one into the buffer that ``view``
    (over ``shape``) places those elements in; None when it cannot be said with strides: a dim that steps across
    the buffer's dims (its index would carry from one into the next) or a negative stride."""
    shape, view = _merged(shape, view)
    contiguous = ir.contiguous_strides(shape)
    if not 0 <= layout.offset < max(1, math.prod(shape)):
        return None
    start = [layout.offset // step % max(size, 1) for step, size in zip(contiguous, shape)]
    reach = list(start)  # the largest index of each buffer dim the layout reaches
    strides = []
    for size, stride in zip(layout.shape, layout.strides):
        if size == 1 or stride == 0:
            strides.append(0)
            continue
        dim = next((dim for dim, step in enumerate(contiguous)
                    if stride > 0 and stride % step == 0 and stride // step < shape[dim]), None)
        if dim is None:
            return None
        reach[dim] += (size - 1) * (stride // contiguous[dim])
        strides.append(stride // contiguous[dim] * view.strides[dim])
    if any(last >= size for last, size in zip(reach, shape)):
        return None
    offset = view.offset + sum(first * stride for first, stride in zip(start, view.strides))
    return ir.Layout(tuple(layout.shape), tuple(strides), offset)


def _merged(shape: tuple[int, ...], view: ir.Layout) -> tuple[tuple[int, ...], ir.Layout]:
    """``shape`` with neighbouring dims that ``view`` also places one after the other merged into one (and size-1
    dims dropped), and ``view`` over it: a layout walking such dims as one (a [rows, heads * 128] store into
    [rows, heads, 128]) then stays one dim."""
    dims: list[list[int]] = []  # [size, view stride]
    for size, stride in zip(shape, view.strides):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    dims = dims or [[1, 0]]
    return tuple(size for size, _ in dims), ir.Layout(tuple(size for size, _ in dims),
                                                      tuple(stride for _, stride in dims), view.offset)


def copied_buffer(part: ir.Pointwise, spans: dict[str, int]) -> str | None:
    """The buffer ``part`` copies whole, in its own order and dtype, into its slice of the concat; None if it
    does anything else (``spans``: the elements of each buffer the region's nodes write)."""
    if len(part.stores) != 1 or not isinstance(part.stores[0].expr, ir.Load):
        return None
    store, load = part.stores[0], part.stores[0].expr
    if load.dtype != store.buffer.dtype or spans.get(load.buffer) != math.prod(part.domain):
        return None
    order = ir.contiguous_strides(tuple(part.domain))
    in_order = all(size == 1 or stride == step for size, stride, step in zip(part.domain, load.layout.strides, order))
    return load.buffer if in_order and load.layout.offset == 0 else None


# A part's slice must hold runs of at least this many contiguous bytes: its writer stores into it run by run, and a
# DMA of short runs is overhead-bound (nki-spec 2: < 256 B per partition). A stack on the last dim (interleaved
# phases, a step of 2 or 3 elements) or a cat of narrow columns stays a concat kernel, which assembles whole rows on
# chip and stores them contiguous (codegen/strided_rows.py).
MIN_RUN_BYTES = 512


def run_bytes(part: ir.Pointwise) -> int:
    """Contiguous bytes per run of ``part``'s slice of the output (its innermost dims merged where contiguous)."""
    store = part.stores[0]
    shape, view = _merged(tuple(part.domain), store.layout)
    return (shape[-1] if view.strides[-1] == 1 else 1) * ir.ITEMSIZE.get(store.buffer.dtype, 4)


def mark_in_place(nodes: list[ir.Node], region_outputs: set[str]) -> list[ir.Node]:
    """``nodes`` with every concat whose parts copy whole buffers that other nodes write, into slices of runs of at
    least ``MIN_RUN_BYTES``, marked ``in_place``."""
    spans = {store.buffer.name: store.buffer.layout.span() for node in nodes for store in kinds.stores(node)}
    marked = []
    for node in nodes:
        if isinstance(node, ir.Concat) and not node.epilogue_stores:
            sources = [copied_buffer(part, spans) for part in node.parts]
            if (len(sources) > 1 and None not in sources and len(set(sources)) == len(sources)
                    and not set(sources) & region_outputs
                    and all(run_bytes(part) >= MIN_RUN_BYTES for part in node.parts)):
                node = dataclasses.replace(node, in_place=True)
        marked.append(node)
    return marked


def _with_stores(node: ir.Node, fn) -> ir.Node:
    """``node`` with ``fn`` applied to the stores its fields hold (``stores``, a reduction's ``row_stores``, an
    attention's ``logsumexp``); stores deeper (in a node held by a field) are not reached: callers check."""
    changed = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if isinstance(value, ir.Store):
            changed[field.name] = fn(value)
        elif isinstance(value, tuple) and value and all(isinstance(item, ir.Store) for item in value):
            changed[field.name] = tuple(fn(item) for item in value)
    return dataclasses.replace(node, **changed) if changed else node


def _moved(node: ir.Node, source: str, shape: tuple[int, ...], view: ir.Layout, output: ir.Buffer) -> ir.Node | None:
    """``node`` storing and reading ``source`` (a contiguous buffer of ``shape``) where ``view`` places it in
    ``output``; None when a layout cannot be restated or ``node`` keeps a reference to ``source`` elsewhere."""
    failed = []

    def load(leaf: ir.Load) -> ir.Load:
        if leaf.buffer != source:
            return leaf
        layout = restated_in(leaf.layout, shape, view)
        failed.extend([leaf] if layout is None else [])
        return leaf if layout is None else dataclasses.replace(leaf, buffer=output.name, layout=layout)

    def store(kept: ir.Store) -> ir.Store:
        if kept.buffer.name != source:
            return kept
        layout = restated_in(kept.layout, shape, view)
        failed.extend([kept] if layout is None else [])
        return kept if layout is None else ir.Store(output, kept.expr, layout)

    moved = _with_stores(kinds.map_loads(node, load), store)
    touched = {load.buffer for load in kinds.loads(moved)} | {store.buffer.name for store in kinds.stores(moved)}
    return None if failed or source in touched else moved


def _assembled(kernels: list[ir.Node], concat: ir.Concat, fits) -> tuple[list[ir.Node] | None, str]:
    """``kernels`` without ``concat``, its inputs stored into its output by their writers (None and the reason
    when that cannot be done)."""
    spans = {store.buffer.name: store.buffer.layout.span() for kernel in kernels for store in kinds.stores(kernel)}
    kept = [kernel for kernel in kernels if kernel is not concat]
    for part in concat.parts:
        source = copied_buffer(part, spans)
        if source is None:
            return None, f"{part.name} no longer copies a whole buffer"
        view = part.stores[0].layout
        for index, kernel in enumerate(kept):
            touched = {load.buffer for load in kinds.loads(kernel)} | {s.buffer.name for s in kinds.stores(kernel)}
            if source not in touched:
                continue
            moved = _moved(kernel, source, tuple(part.domain), view, concat.output)
            if moved is None:
                return None, f"{kernel.name}'s access to {source} has no layout in {concat.output.name}"
            written = [store.buffer.name for store in kinds.stores(moved)]
            if written.count(concat.output.name) > 1:
                return None, f"{kernel.name} would store {concat.output.name} twice"
            if fits is not None and not fits(moved):
                return None, f"{kernel.name} would no longer tile"
            kept[index] = moved
    return kept, "its inputs' writers store into it"


def assemble_in_place(kernels: list[ir.Node], decisions: list[str], fits=None) -> tuple[list[ir.Node], frozenset]:
    """The kernels with every marked concat assembled in place where it can be (see the module docstring), and the
    buffers that several kernels now write; a decision per marked concat."""
    assembled = set()
    for concat in [kernel for kernel in kernels if isinstance(kernel, ir.Concat) and kernel.in_place]:
        result, reason = _assembled(kernels, concat, fits)
        decisions.append(f"{concat.name} ({concat.output.name}) assembled in place: "
                         + ("yes, " if result is not None else "no, ") + reason)
        if result is not None:
            kernels = result
            assembled.add(concat.output.name)
    return kernels, frozenset(assembled)
