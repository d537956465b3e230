"""Simulator stage: ``nki.isa.nc_stream_shuffle``, the Vector engine's cross-partition move within each
quadrant of 32 partitions.

Input: a source and a destination SBUF/PSUM tile and a 32-entry shuffle mask. Output: dst partition i of each
quadrant copied from src partition mask[i] of the same quadrant (255: left unchanged), the start-partition rules
of the active quadrants checked, one InstructionRecord.
"""

from __future__ import annotations

import math

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.rules import check_same_free, record, require_buffers, require_tensor, store

QUADRANT = 32
UNCHANGED = 255  # a mask entry that leaves its destination partition alone
LEGAL_STARTS = {32: (0, 32, 64, 96), 64: (0, 64), 96: (0,), 128: (0,)}


def _mask(name: str, shuffle_mask) -> list[int]:
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != QUADRANT or any(not (0 <= m < QUADRANT or m == UNCHANGED) for m in mask):
        raise NkiValidationError(
            "err_shuffle_mask", f"shuffle_mask must be 32 entries, each a partition 0..31 or 255, got {shuffle_mask}",
            name,
        )
    return mask


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """dst[q*32 + i] = src[q*32 + shuffle_mask[i]] in every quadrant q of the accessed partitions (VectorE);
    partitions are counted from each tile's start; dst and src share dtype and elements per partition."""
    name = "nc_stream_shuffle"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    for role, tile in (("dst", dst), ("src", src)):
        require_buffers(name, role, tile, ("sbuf", "psum"))
    if dst.dtype != src.dtype:
        raise NkiValidationError("err_shuffle_dtype", f"dst is {dst.dtype.name}, src {src.dtype.name}", name)
    check_same_free(name, src, dst, "src", "dst")
    mask = _mask(name, shuffle_mask)
    active = math.ceil(max(src.partitions, dst.partitions) / QUADRANT) * QUADRANT
    if active > 128:
        raise NkiValidationError("err_num_partition_exceed_arch_limit", f"{active} active partitions", name)
    for role, tile in (("src", src), ("dst", dst)):
        if tile.start_partition not in LEGAL_STARTS[active]:
            raise NkiValidationError(
                "err_start_partition", f"{role} {tile.name} starts at partition {tile.start_partition}; with {active} "
                f"active partitions it must start at one of {LEGAL_STARTS[active]}", name,
            )
    values = np.array(src.read()).reshape(src.partitions, -1)
    out = np.array(dst.read()).reshape(dst.partitions, -1)
    for row in range(dst.partitions):
        entry = mask[row % QUADRANT]
        if entry == UNCHANGED:
            continue
        source = row - row % QUADRANT + entry
        if source >= src.partitions:
            raise NkiValidationError(
                "err_shuffle_mask", f"dst partition {row} copies src partition {source}, past src's {src.partitions}",
                name,
            )
        out[row] = values[source]
    store(dst, out)
    record(name, "vector", dst, [("src", src), ("dst", dst)])
