"""Kernel kind ``matmul``, the implicit GEMM (``ir.MatMul.shifts``): which terms share one load of the moving operand.

Input: the terms' shifts of ``b`` (element offsets), ``b``'s column stride and the N tile. Output: the windows the
moving operand is loaded in, and where in its window each term's columns start.

A term reads ``b`` at its shift. When two terms' shifts differ by a multiple of ``b``'s column stride (a
convolution's kernel positions along a row; with rows computed as wide as the padded input's, along the other
spatial dims too), the second reads the first one's columns moved right by that many: one DMA of ``cols + span``
columns feeds both, each term's matmul taking its slice. A window reaches at most ``span_limit`` columns past its
tile (the N tile: no input column is loaded more than twice per window); terms farther apart (a 3-D kernel's
frames when a frame is larger than a tile) start windows of their own.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Window:
    shift: int  # b's offset of the window's first column, added to the tile's
    span: int  # columns loaded past the N tile's


@dataclasses.dataclass(frozen=True)
class TermColumns:
    window: int  # which window holds the term's columns
    column: int  # where they start in it


def moving_windows(shifts: tuple[int, ...], column_stride: int,
                   span_limit: int) -> tuple[tuple[Window, ...], tuple[TermColumns, ...]]:
    """Greedy over the shifts in increasing order: a term joins the first window whose first shift is a whole
    number of columns (at most ``span_limit``) before its own, else starts a new window."""
    starts: list[int] = []
    spans: list[int] = []
    placed: dict[int, TermColumns] = {}
    for term in sorted(range(len(shifts)), key=lambda t: shifts[t]):
        shift = shifts[term]
        for index, start in enumerate(starts):
            column = _columns_between(start, shift, column_stride)
            if column is not None and column <= span_limit:
                spans[index] = max(spans[index], column)
                placed[term] = TermColumns(index, column)
                break
        else:
            placed[term] = TermColumns(len(starts), 0)
            starts.append(shift)
            spans.append(0)
    windows = tuple(Window(start, span) for start, span in zip(starts, spans))
    return windows, tuple(placed[term] for term in range(len(shifts)))


def _columns_between(start: int, shift: int, column_stride: int) -> int | None:
    """How many columns of stride ``column_stride`` lead from ``start`` to ``shift`` (None: not a whole number)."""
    distance = shift - start
    if distance == 0:
        return 0
    if column_stride == 0 or distance % column_stride:
        return None
    columns = distance // column_stride
    return columns if columns > 0 else None
