"""Kernel kind ``matmul``, its epilogue's per-column operands (a linear's bias, a modulation's gate): stage "render".

An epilogue load that is the same for every row of the output (partition stride 0, varying along N) is a DMA that
repeats it to every partition. Loaded like the other epilogue operands, once per (row block, N tile), it moves
128 x its bytes for every row block: as many bytes as the output itself for a bias over 128-row blocks. In the
resident form (matmul_resident.py.j2) the row blocks are the innermost loop, so here it is loaded once per N tile
of a row group, before the row blocks that read it.

Input: the kernel's plan, its allocator and the load. Output: the name of a [partitions, N tile] tile holding the
load's columns of this N tile on every partition, with the lines that fill it appended to ``lines`` (the template
places them in the N tile loop, before the row blocks); None for a load that varies with the row.
"""

from __future__ import annotations

from neuron_compile import ir
from neuron_compile.codegen.expressions import NL_DTYPES, AccessPattern, TileAllocator
from neuron_compile.codegen.kernel_text import Patterns, offset_text
from neuron_compile.tiles import TilePlan


class ColumnOperands:
    """The per-column epilogue loads of one resident-form matmul kernel, each loaded once per N tile."""

    def __init__(self, plan: TilePlan, allocator: TileAllocator):
        self.plan, self.allocator = plan, allocator
        self.lines: list[str] = []
        self.tiles: dict[ir.Load, str] = {}

    def tile_for(self, load: ir.Load) -> str | None:
        if load in self.tiles:
            return self.tiles[load]
        layout, (free,) = load.layout, self.plan.free
        if self.plan.partition.stride(layout) != 0 or free.stride(layout) == 0:
            return None
        partitions, name = self.plan.partition.tile, self.allocator.take_name(f"{load.buffer}_columns")
        terms = Patterns(self.plan).outer_terms(layout) + [("f0", free.stride(layout))]
        source = AccessPattern(load.buffer, ((0, partitions), (free.stride(layout), "cols")),
                               offset_text(layout.offset, terms))
        self.lines += [
            f"{name} = nl.ndarray(({partitions}, {free.tile}), dtype={NL_DTYPES[load.dtype]}, buffer=nl.sbuf)",
            f"nisa.dma_copy(dst={name}[0:{partitions}, 0:cols], src={source})",
        ]
        self.tiles[load] = name
        return name
