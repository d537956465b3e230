"""Codegen stage helper ("render"): row-vector work hoisted out of a kernel's column loop.

A pointwise kernel walks each row tile in column tiles. A value constant along the columns (a (P, 1) row vector:
a scalar graph input such as AdamW's bias corrections, a per-row statistic) and everything computed from such
values alone (their reciprocals, products) is the same in every column tile, so it is loaded and computed once per
row tile, before the column loop, instead of once per column tile (two small DMAs and two 64-cycle reciprocals per
tile of AdamW's update).

Input: a ``TileScope`` whose ``hoisted`` is a ``HoistedColumns``; ``expressions.emit`` routes every expression that
``expressions.column_invariant`` accepts here. Output: ``allocations`` and ``lines``, which the template places
inside the row loop, before the column loop. The tiles come from an allocator of their own (the column loop
allocates its tiles afresh per column tile, which would drop a hoisted value), numbered on from the scope's so that
every name in the kernel stays distinct.
"""

from __future__ import annotations

import contextlib

from neuron_compile.codegen.expressions import TileAllocator


class HoistedColumns:
    """The row-vector work of one emission of a kernel's tile body (see the module docstring)."""

    def __init__(self, partitions: int, reserved: frozenset[str] = frozenset()):
        self.allocator = TileAllocator(partitions, reserved=reserved)
        self.lines: list[str] = []
        self.invariant: dict = {}  # expression -> whether it is column-invariant (expressions.column_invariant)

    @property
    def allocations(self) -> list[str]:
        return self.allocator.lines

    @contextlib.contextmanager
    def emitting(self, scope):
        """Within the block, ``scope`` allocates its tiles here; yields the list the instructions go to."""
        column_allocator = scope.allocator
        if column_allocator is self.allocator:  # an operand of hoisted work: already here
            yield self.lines
            return
        self.allocator.count = column_allocator.count
        scope.allocator = self.allocator
        try:
            yield self.lines
        finally:
            scope.allocator = column_allocator
            column_allocator.count = self.allocator.count
