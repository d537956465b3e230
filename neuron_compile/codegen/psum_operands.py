"""Codegen stage: the values a pointwise tile writes into PSUM, so that the elementwise ops reading them stream
one operand from PSUM at the full rate.

Input: a tile's stores (``ir.Store``), its free size and the PSUM banks it may take. Output: the set of expressions
to compute into an fp32 PSUM tile: a multiply or an add of a tile by a number (a tensor_scalar, which ScalarE
runs), or of two tiles (a tensor_tensor, which VectorE runs), whose every reader is a tensor_tensor of two tiles.
A VectorE tensor_tensor with one operand in PSUM makes one pass over the elements where two fp32 SBUF operands
take two (nki-spec §2, cost.py), so AdamW's ``g * (1 - beta2) * g`` and ``m + (1 - beta1) * (g - m)`` cost
VectorE one cycle per element each instead of GpSimd 1.6, and with the product ``g * (1 - beta2) * g`` in PSUM
too, the second moment's add one cycle instead of two. The caller tries them one at a time against its engine
plan and keeps those that shorten the tile (kinds/pointwise.py), within the banks' budget.

The rules: GpSimd cannot reach PSUM, so the readers run on VectorE and the writer on ScalarE or VectorE (a
tensor_tensor writer on VectorE, at the passes its operands take: a PSUM destination streams no faster); the DMA
cannot read PSUM, so no stored value; at most one operand of a tensor_tensor may be in PSUM; each value takes one
bank per column tile in flight (``PIPELINED_TILES``), so the tile's free size must fit a bank and the values the
banks. The values are exactly those of the SBUF form: the engines compute in fp32 and PSUM holds fp32.
"""

from __future__ import annotations

from neuron_compile import ir

PSUM_WRITERS = ("mul", "add")  # a tile times or plus a number: a tensor_scalar stage ScalarE runs (trn2)
PSUM_READERS = ("mul", "add", "sub")  # tensor_tensor ops of two tiles


def psum_operands(stores: tuple[ir.Store, ...], free: int, bank_elements: int, banks: int) -> tuple:
    """The expressions of ``stores`` that may be computed into PSUM (see the module docstring), in a fixed order,
    no two read by one instruction: ``free`` elements per partition of a tile, at most ``banks`` values of one bank
    (``bank_elements`` fp32) each."""
    if free > bank_elements or banks <= 0:
        return ()
    readers = _readers(stores)
    stored = {store.expr for store in stores}
    chosen: list[ir.Op] = []
    for expr, parents in readers.items():
        if len(chosen) == banks:
            break
        if _writes_tile_by_number(expr) and expr not in stored and parents and all(
                _reads_with_a_tile(parent, expr) for parent in parents):
            if not any(other in chosen for parent in parents for other in parent.args):
                chosen.append(expr)
    return tuple(chosen)


def _readers(stores: tuple[ir.Store, ...]) -> dict:
    """Each op of the stores' expressions (in a deterministic order) and the distinct ops that read it."""
    readers: dict = {}
    seen: set = set()
    pending = [store.expr for store in stores]
    while pending:
        expr = pending.pop()
        if expr in seen or not isinstance(expr, ir.Op):
            continue
        seen.add(expr)
        for arg in expr.args:
            if isinstance(arg, ir.Op):
                parents = readers.setdefault(arg, [])
                if expr not in parents:
                    parents.append(expr)
                pending.append(arg)
    return readers


def _writes_tile_by_number(expr: ir.Op) -> bool:
    """``tile * number`` or ``tile + number``, or the product or sum of two tiles (VectorE writes it: AdamW's
    ``(g * (1 - beta2)) * g``, read by the second moment's add), computed in fp32 (no cast)."""
    if expr.op not in PSUM_WRITERS or expr.dtype is not None or len(expr.args) != 2:
        return False
    return sum(_constant(arg) for arg in expr.args) <= 1


def _reads_with_a_tile(parent: ir.Op, value: ir.Op) -> bool:
    """``parent`` is a tensor_tensor of ``value`` and another tile (not ``value`` itself: a square is ScalarE's)."""
    if parent.op not in PSUM_READERS or parent.dtype is not None or len(parent.args) != 2:
        return False
    if ir.scaled_square(parent) is not None:
        return False  # ScalarE's activation(square, scale=...): no tensor_tensor reads the scaled value
    other = parent.args[1] if parent.args[0] == value else parent.args[0]
    return not _constant(other) and other != value


def _constant(expr) -> bool:
    """A number, or ops over numbers alone (codegen folds them into one)."""
    if isinstance(expr, ir.Scalar):
        return True
    return isinstance(expr, ir.Op) and all(_constant(arg) for arg in expr.args)
