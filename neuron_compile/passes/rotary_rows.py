"""Fusion stage helper: a rotary over joint rows, split into one rotary per kernel writing its rows.

Input: a rotary concat (a whole kernel), the fused kernels and the buffers assembled in place (passes/
concat_in_place.py: several kernels write disjoint slices of each). Output: the rotary's row slices, one per writer
of the rows it reads, or the reason there are none.

Why: Flux's double block rotates the joint rows ``cat([text_q, image_q], 1)``, which the text and the image
projections' norms store in place, each its own rows; a rotary of the joint buffer has no one projection to run in.
Split by those rows, each slice reads the rows one writer stores and rotates them with cos and sin at its row
offset, so each can run in the epilogue of the projection behind its writer (passes/rotary_epilogues.py). A slice
is the rotary's own parts over fewer rows: every layout of the rotary (its reads, cos and sin included, and its
stores) starts ``first`` rows further and walks ``count`` rows on the split dim; nothing else changes.
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir, kinds


def _outer_rows(buffer: ir.Buffer) -> tuple[int, int] | None:
    """(size, stride) of the outermost dim of ``buffer`` that has more than one index (a joint buffer's rows)."""
    return next(((size, stride) for size, stride in zip(buffer.layout.shape, buffer.layout.strides) if size > 1), None)


def _writers_rows(joint: ir.Buffer, kernels: list[ir.Node]) -> list[tuple[int, int]] | None:
    """The [first, end) rows of ``joint`` each kernel writing it stores, in order, when each stores whole rows
    and together they store every row once; else None."""
    size, stride = _outer_rows(joint) or (0, 0)
    ranges = []
    for kernel in kernels:
        layouts = [store.layout for store in kinds.stores(kernel) if store.buffer.name == joint.name]
        if not layouts:
            continue
        first, end = min(layout.extent()[0] for layout in layouts), max(layout.extent()[1] for layout in layouts)
        if stride <= 0 or first % stride or end % stride:
            return None
        ranges.append((first // stride, end // stride))
    ranges.sort()
    tiled = [first for first, _ in ranges] == [0, *(end for _, end in ranges[:-1])]
    return ranges if len(ranges) > 1 and tiled and ranges[-1][1] == size else None


def _split_dim(rotary: ir.Concat, joint: ir.Buffer) -> int | None:
    """The dim of ``rotary``'s domain that walks ``joint``'s rows in every read of it, the other dims staying
    inside one row; None if there is none."""
    size, stride = _outer_rows(joint) or (0, 0)
    reads = [load.layout for part in rotary.parts for load in kinds.loads(part) if load.buffer == joint.name]
    for dim, rows in enumerate(rotary.domain):
        if rows != size or any(starts[dim] for starts in rotary.starts):
            continue
        inside = all(layout.strides[dim] == stride and layout.offset + sum(
            (count - 1) * step for index, (count, step) in enumerate(zip(layout.shape, layout.strides))
            if index != dim) < stride for layout in reads)
        if reads and inside:
            return dim
    return None


def _sliced_shape(shape: tuple[int, ...], dim: int, count: int) -> tuple[int, ...]:
    return tuple(count if index == dim else size for index, size in enumerate(shape))


def _sliced_layout(layout: ir.Layout, dim: int, first: int, count: int) -> ir.Layout:
    shape = _sliced_shape(layout.shape, dim, count)
    return ir.Layout(shape, layout.strides, layout.offset + first * layout.strides[dim])


def _sliced(rotary: ir.Concat, dim: int, first: int, count: int) -> ir.Concat:
    """``rotary`` over ``count`` rows from ``first`` on its dim ``dim``."""
    def load(leaf):
        if not isinstance(leaf, ir.Load):
            return leaf
        return dataclasses.replace(leaf, layout=_sliced_layout(leaf.layout, dim, first, count))

    def store(kept: ir.Store) -> ir.Store:
        return ir.Store(kept.buffer, ir.map_leaves(kept.expr, load), _sliced_layout(kept.layout, dim, first, count))

    parts = tuple(dataclasses.replace(part, domain=_sliced_shape(part.domain, dim, count),
                                      stores=tuple(store(kept) for kept in part.stores)) for part in rotary.parts)
    return dataclasses.replace(rotary, name=f"{rotary.name}_rows_{first}",
                               domain=_sliced_shape(rotary.domain, dim, count), parts=parts,
                               epilogue_stores=tuple(store(kept) for kept in rotary.epilogue_stores))


def joint_row_slices(rotary: ir.Node, kernels: list[ir.Node],
                     assembled: frozenset) -> tuple[list[ir.Concat] | None, str | None]:
    """``rotary``'s slices, one per kernel writing the joint rows it reads (module docstring); or None and why not,
    the reason None when ``rotary`` is no concat reading one buffer assembled in place (nothing to split)."""
    if not isinstance(rotary, ir.Concat) or rotary.in_place:
        return None, None
    joints = [buffer for buffer in {store.buffer for kernel in kernels for store in kinds.stores(kernel)}
              if buffer.name in assembled and buffer.name in kinds.read_buffers(rotary)]
    if len(joints) != 1:
        return None, None
    joint = joints[0]
    rows = _writers_rows(joint, [kernel for kernel in kernels if kernel is not rotary])
    if rows is None:
        return None, f"the kernels writing {joint.name} do not each store whole rows of it"
    dim = _split_dim(rotary, joint)
    if dim is None:
        return None, f"no dim of {rotary.name} walks {joint.name}'s rows alone"
    return [_sliced(rotary, dim, first, end - first) for first, end in rows], None
