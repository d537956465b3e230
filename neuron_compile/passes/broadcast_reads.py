"""Fusion stage helper: a small node's value restated over a reader that reads it through another index map.

``inline_cheap`` (passes/fusion.py) inlines a cheap pointwise node into readers that read it with its own index
map. A parameter-derived value is read otherwise: Gemma's RMSNorm weight used as ``1 + w.float()`` ([hidden]) is read
by its norm through a view repeating it for every row (stride 0 on the rows), a rotary's ``inv_freq.float()`` by the
table for every position. Each was a kernel of its own, run on every call, storing a value its one reader then loads
back. Restated over the reader's domain (each of its loads' layouts composed with the view the reader reads through),
the expression is computed where it is consumed; the reader's codegen computes a value that is the same for every row
once (codegen/row_broadcast.py). A value repeated along the reader's innermost dim (``position_ids.float()`` read by
the rotary table for every frequency, a per-row mask read across a gradient's columns) keeps its kernel: restated,
the reader's DMA would fetch it once per column.

Input: the cheap node's store and the reader's load of it. Output: the store's expression with every load over the
reader's domain, or None when the view repeats nothing (a slice or a transpose: left to the value's own kernel) or
repeats along its innermost dim, when it does not map each reader dim onto one dim of the store in the store's order
(a view that regroups or transposes its elements), when it reads one element for every index (a scalar, as AdamW's
bias corrections: their kernels stay, which the update's DMA-engine sums are planned around), or when the value is
larger than ``MAX_BROADCAST_ELEMENTS`` (then recomputing it for every repeat would cost more than the round trip
saves).
"""

from __future__ import annotations

from neuron_compile import ir

# A value read through a repeating view is recomputed for each repeat: at most a parameter's or a table's row.
MAX_BROADCAST_ELEMENTS = 65536


def _store_coordinates(store: ir.Layout, offset: int) -> dict[int, int] | None:
    """The index of each dim of ``store`` at which it writes flat element ``offset`` (dims of size 1 and stride-0
    dims at 0), or None when it writes no such element or its dims interleave (not a nested layout: an element
    could then be reached by two indices)."""
    dims = sorted((d for d, size in enumerate(store.shape) if size > 1), key=lambda d: -store.strides[d])
    remainder = offset - store.offset
    coordinates = {}
    for position, dim in enumerate(dims):
        inner = sum((store.shape[d] - 1) * store.strides[d] for d in dims[position + 1:])
        if store.strides[dim] <= max(inner, 0):
            return None  # negative, zero or interleaved strides: no unique decomposition
        coordinates[dim], remainder = divmod(remainder, store.strides[dim])
        if not 0 <= coordinates[dim] < store.shape[dim]:
            return None
    return coordinates if remainder == 0 else None


def _reader_dims(read: ir.Layout, store: ir.Layout, start: dict[int, int]) -> dict[int, int] | None:
    """For each reader dim that moves through the buffer, the store dim it walks (same stride, staying in range
    from ``start``); None when a reader dim matches no store dim or two reader dims walk one."""
    walked: dict[int, int] = {}
    for dim, (size, stride) in enumerate(zip(read.shape, read.strides)):
        if size == 1 or stride == 0:
            continue
        matches = [d for d, (s_size, s_stride) in enumerate(zip(store.shape, store.strides))
                   if s_size > 1 and s_stride == stride]
        if len(matches) != 1 or matches[0] in walked.values() or start[matches[0]] + size > store.shape[matches[0]]:
            return None
        walked[dim] = matches[0]
    order = list(walked.values())
    if order != sorted(order, key=lambda d: -store.strides[d]):
        return None  # a transposing read: recomputed, its loads would stride (the value's own kernel reads rows)
    return walked


def _repeats_innermost(layout: ir.Layout) -> bool:
    """Whether ``layout`` repeats its element along its innermost dim (stride 0 on the last dim of more than one
    element): a per-row value read across a row's columns. Restated, the reader's DMA would fetch each of its
    elements once per column (a training step's embedding-gradient mask, 2048 columns: 13.3 -> 96.4 us); its own
    kernel stores it once, and the reader reads it as any other broadcast."""
    moving = [(size, stride) for size, stride in zip(layout.shape, layout.strides) if size > 1]
    return bool(moving) and moving[-1][1] == 0


def restated(store: ir.Store, read: ir.Load) -> ir.Expr | None:
    """``store``'s expression with each of its loads over ``read``'s domain (see the module docstring); None when
    the read cannot be restated so or the value is too large to recompute per repeat."""
    if ir.same_index_map(read.layout, store.layout):
        return store.expr
    if not any(size > 1 and stride == 0 for size, stride in zip(read.layout.shape, read.layout.strides)):
        return None  # not a repeating view (a slice, a transpose): left to the value's own kernel
    if _repeats_innermost(read.layout):
        return None
    if store.buffer.numel > MAX_BROADCAST_ELEMENTS or any(
            isinstance(node, (ir.Iota, ir.RandomKeep, ir.Result)) for node in ir.nodes_of(store.expr)):
        return None
    start = _store_coordinates(store.layout, read.layout.offset)
    walked = None if start is None else _reader_dims(read.layout, store.layout, start)
    if not walked:  # None, or one element for every reader index: a scalar (AdamW's bias corrections) keeps its kernel
        return None
    shape = read.layout.shape

    def over_reader(leaf: ir.Expr) -> ir.Expr:
        if not isinstance(leaf, ir.Load):
            return leaf
        inner = leaf.layout
        offset = inner.offset + sum(inner.strides[d] * index for d, index in start.items())
        strides = tuple(inner.strides[walked[dim]] if dim in walked else 0 for dim in range(len(shape)))
        return ir.Load(leaf.buffer, ir.Layout(shape, strides, offset), leaf.dtype)

    return ir.map_leaves(store.expr, over_reader)
