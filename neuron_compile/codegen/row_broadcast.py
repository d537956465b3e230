"""Codegen for loads the same on every partition of a row kernel (a norm's weight): stage "render".

A row kernel (reduction with row stores, the RMSNorm / LayerNorm epilogue) multiplies each row by a weight that
does not depend on the row. Loaded like the rows, it would be a DMA repeating the weight to all 128 partitions of
every row block: 128 x its bytes per block (1 MB for a 2048-wide bf16 weight over 256 rows). Here it is loaded
once, before the kernel's loops, as one [1, width] row, and spread to every partition on TensorE: a ones row as
the stationary operand (contraction over one partition) gives ``psum[p, c] = 1.0 * row[c]`` exactly, one PSUM bank
of 512 columns at a time, copied into a [partitions, width] tile the loops read like any loaded tile.

A value computed from such loads alone (Gemma's ``1 + w.float()``, inlined from a kernel of its own by
passes/broadcast_reads.py) is the same on every row too: it is computed once, over the spread tiles, right after
them, instead of once per row block.

Input: the kernel's plan, its allocator and the load or expression. Output: the tile's name, with the lines that
fill it appended to ``lines`` (the template places them before the loops).
"""

from __future__ import annotations

import math

from neuron_compile import ir
from neuron_compile.codegen.expressions import (
    NL_DTYPES,
    AccessPattern,
    Ref,
    TileAllocator,
    TileScope,
    bind_load,
    emit,
)
from neuron_compile.tiles import TilePlan

PSUM_BANK_COLUMNS = 512  # fp32 columns of one PSUM bank: one matmul's moving free size
SPREADABLE_DTYPES = ("bfloat16", "float16", "float32")  # TensorE inputs that 1.0 x value reproduces exactly
# Below this the broadcast DMA is cheaper than the spread's chain (a DMA, a matmul, a PSUM copy before the first
# use): a decode step's single row, a narrow weight over a few rows.
MIN_REPEATED_BYTES = 256 * 1024


class RowBroadcast:
    """The loads of one kernel that every partition reads alike, each spread once (see the module docstring)."""

    def __init__(self, plan: TilePlan, allocator: TileAllocator):
        self.plan, self.allocator = plan, allocator
        self.lines: list[str] = []
        self.ones: dict[str, str] = {}  # dtype -> the ones row of that dtype
        self.tiles: dict[ir.Load, str] = {}  # a load -> its spread tile (several scopes may read it)
        self.values: dict[ir.Op, Ref] = {}  # an expression of spread loads -> the tile computed once from them
        self.invariant: dict[ir.Expr, bool] = {}  # expression -> whether it is one (``row_invariant``)
        self.value_bytes = 0  # bytes per partition of the values' tiles

    def applies(self, load: ir.Load) -> bool:
        layout, plan = load.layout, self.plan
        whole_row = all(dim.tile == dim.size for dim in plan.free)
        along_rows = [plan.partition, *plan.outer]
        return (whole_row and load.dtype in SPREADABLE_DTYPES
                and all(dim.stride(layout) == 0 for dim in along_rows)
                and any(dim.stride(layout) != 0 for dim in plan.free)
                and self.repeated_bytes(load) >= MIN_REPEATED_BYTES)

    def repeated_bytes(self, load: ir.Load) -> int:
        """What the broadcast DMAs would move: the row once per partition of every row block."""
        blocks = math.prod(dim.size for dim in self.plan.outer) * math.ceil(
            self.plan.partition.size / self.plan.partition.tile)
        row = math.prod(dim.size for dim in self.plan.free) * ir.ITEMSIZE[load.dtype]
        return blocks * self.plan.partition.tile * row

    def tile_for(self, load: ir.Load) -> str | None:
        """The name of a [partitions, width] tile holding ``load``'s row on every partition, or None if the load
        varies with the row (or the row is walked in chunks)."""
        if load in self.tiles or not self.applies(load):
            return self.tiles.get(load)
        partitions = self.plan.partition.tile
        width = math.prod(dim.size for dim in self.plan.free)
        entries = ((0, 1), *((dim.stride(load.layout), dim.size) for dim in self.plan.free))
        source = AccessPattern(load.buffer, entries, str(load.layout.offset))
        dtype = NL_DTYPES[load.dtype]
        self.lines.append(f"# {load.buffer} is the same for every row: one [1, {width}] load, spread to the "
                          "partitions on TensorE")
        ones = self._ones(load.dtype, partitions)
        row = self.allocator.take_name(f"{load.buffer}_row")
        tile = self.allocator.take_name(f"{load.buffer}_everywhere")
        spread = self.allocator.take_name("spread")
        self.lines += [
            f"{row} = nl.ndarray((1, {width}), dtype={dtype}, buffer=nl.sbuf)",
            f"nisa.dma_copy(dst={row}[0:1, 0:{width}], src={source})",
            f"{tile} = nl.ndarray(({partitions}, {width}), dtype={dtype}, buffer=nl.sbuf)",
            f"for c0 in range(0, {width}, {PSUM_BANK_COLUMNS}):",
            f"    span = min({PSUM_BANK_COLUMNS}, {width} - c0)",
            f"    {spread} = nl.ndarray(({partitions}, {PSUM_BANK_COLUMNS}), dtype=nl.float32, buffer=nl.psum)",
            f"    nisa.nc_matmul(dst={spread}[0:{partitions}, 0:span], stationary={ones}[0:1, 0:{partitions}], "
            f"moving={row}[0:1, c0:c0 + span])",
            f"    nisa.tensor_copy(dst={tile}[0:{partitions}, c0:c0 + span], src={spread}[0:{partitions}, 0:span])",
        ]
        self.tiles[load] = tile
        return tile

    def row_invariant(self, expr: ir.Expr) -> bool:
        """Whether ``expr`` is an op over loads this kernel spreads (``applies``) and numbers, reading at least one
        such load: the same value on every row."""
        if expr not in self.invariant:
            if isinstance(expr, ir.Load):
                self.invariant[expr] = self.applies(expr)
            elif isinstance(expr, ir.Op):
                flags = [isinstance(arg, ir.Scalar) or self.row_invariant(arg) for arg in expr.args]
                self.invariant[expr] = all(flags) and any(not isinstance(arg, ir.Scalar) for arg in expr.args)
            else:
                self.invariant[expr] = False
        return self.invariant[expr]

    def value_for(self, expr: ir.Op) -> Ref | None:
        """Where ``expr``, an op over spread loads (``row_invariant``), is held on every partition, computed once
        with the spreads (over the whole [partitions, width] tiles); None for any other expression."""
        if expr in self.values or not isinstance(expr, ir.Op) or not self.row_invariant(expr):
            return self.values.get(expr)
        partitions = self.plan.partition.tile
        width = math.prod(dim.size for dim in self.plan.free)
        values = TileAllocator(partitions, reserved=self.allocator.reserved, count=self.allocator.count)
        scope = TileScope(values, width, f"[0:{partitions}, 0:{width}]", load_pattern=None)
        for load in ir.loads_of(expr):
            bind_load(scope, load, Ref(tile=self.tile_for(load), dtype=load.dtype))
        lines: list[str] = []
        ref = emit(expr, scope, lines)
        self.allocator.count = values.count
        self.lines += [f"# {_described(expr)} is the same for every row: computed once, from the spread rows"]
        self.lines += values.lines + lines
        self.value_bytes += values.sbuf_bytes
        self.values[expr] = ref
        return ref

    @property
    def sbuf_bytes(self) -> int:
        """Bytes per partition of the spread tiles (each load's row on every partition; its [1, width] source row
        is on one partition only) and of the values computed from them."""
        width = math.prod(dim.size for dim in self.plan.free)
        return sum(width * ir.ITEMSIZE[load.dtype] for load in self.tiles) + self.value_bytes

    def _ones(self, dtype: str, partitions: int) -> str:
        # TensorE takes fp32 only with fp32: the ones row has the row's dtype
        if dtype not in self.ones:
            name = self.ones[dtype] = self.allocator.take_name("ones")
            self.lines += [f"{name} = nl.ndarray((1, {partitions}), dtype={NL_DTYPES[dtype]}, buffer=nl.sbuf)",
                           f"nisa.memset(dst={name}[0:1, 0:{partitions}], value=1.0)"]
        return self.ones[dtype]


def _described(expr: ir.Op) -> str:
    """``expr`` for a comment: its op over the buffers it reads."""
    return f"{expr.op} of " + ", ".join(load.buffer for load in ir.loads_of(expr))
