"""Simulator stage: ``nki.isa.constants`` — the ISA's enums (engines, accumulator commands, DMA descriptor
modes, out-of-bounds modes, matmul performance modes, NeuronCore versions, DMA engines) and the deprecated
engine selectors (``nisa.vector_engine`` ...).

Input: nothing. Output: the enum classes, which ``nki.isa`` re-exports (published kernels import them from
either place: ``from nki.isa.constants import oob_mode`` and ``nisa.oob_mode.skip``).
"""

from __future__ import annotations

import enum


class engine(enum.IntEnum):  # noqa: N801 - NKI's enum names
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


# The module-level engine constants of the API (deprecated there in favour of engine.<name>, still widely used).
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd(enum.IntEnum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.IntEnum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.IntEnum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801 - string values, as the API's
    none = "none"
    double_row = "double_row"


class nc_version(enum.IntEnum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(enum.IntEnum):  # noqa: N801
    dma = 1  # the shared DMA rings, synchronised by core barriers
    gpsimd_dma = 2  # GpSimd's own DMA for SBUF-to-SBUF swaps between the two cores of an LNC=2 pair


__all__ = ["engine", "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine",
           "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version", "dma_engine"]
