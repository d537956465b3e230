"""Simulator stage: the DMA instructions of ``nki.isa`` (dma_copy, dma_transpose, dma_compute).

Input: HBM / SBUF views (incl. indirect ``vector_offset`` access patterns). Output: dst written, with the DMA
rules checked (never PSUM, equal element counts, hwdge needs equal dtypes, transpose shapes) and one "dma"
InstructionRecord per transfer.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator import memory
from neuron_compile.runtime.simulator import ops
from neuron_compile.runtime.simulator.errors import NkiNotSimulatedError, NkiValidationError
from neuron_compile.runtime.simulator.replay import refuse_replay, run_step
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    cast_to,
    check_tile,
    destination_view,
    is_float,
    record,
    require_buffers,
    require_tensor,
    source_view,
    store,
    store_into,
)


# The API's permutation when none is given: 2-d and 3-d reverse the dims, 4-d swaps the first and the last.
DEFAULT_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_copy(dst, src, priority=None, oob_mode=None, dge_mode=None, engine=None, mask=None, name=None):
    """dst = src between HBM and SBUF (either way) or within one; never PSUM; dtype cast via fp32."""
    name = "dma_copy"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    if src.kind == "psum":
        raise NkiValidationError("err_dma_from_psum", f"DMA cannot read PSUM: src {src.name} is in PSUM", name)
    if dst.kind == "psum":
        raise NkiValidationError("err_dma_to_psum", f"DMA cannot write PSUM: dst {dst.name} is in PSUM", name)
    check_tile(name, "dst", dst, compute=False)
    check_tile(name, "src", src, compute=False)
    if dst.size != src.size:
        raise NkiValidationError(
            "err_dma_shape_mismatch", f"DMA copy in/out shape must match: dst {dst.shape} ({dst.size} elements), "
            f"src {src.shape} ({src.size} elements)", name,
        )
    mode = getattr(dge_mode, "name", dge_mode)
    if mode == "hwdge" and dst.dtype != src.dtype:
        raise NkiValidationError(
            "err_dma_hwdge_dtype", f"hwdge DMA needs equal dtypes, got src {src.dtype.name}, dst {dst.dtype.name} "
            "(use .view())", name,
        )
    if getattr(oob_mode, "name", oob_mode) == "skip":
        refuse_replay("dma_copy with oob_mode=skip (which elements move depends on the offsets' values)")
        if not (src.in_bounds() and dst.in_bounds()):
            _dma_skip_oob(dst, src)
        else:
            run_step(_copy_step(dst, src))
    else:
        run_step(_copy_step(dst, src))
    record(name, "dma", dst, [("src", src)],
           {"dge_mode": mode, "indirect": src.indirect is not None or dst.indirect is not None},
           hbm_partitions=_on_chip_partitions(dst, src))


def _copy_step(dst, src):
    """The step of a copy: src's values (gathered through its offsets when indirect; floats of another dtype via
    fp32) into dst (scattered through its offsets when indirect), rounded to dst's dtype."""
    widen = src.dtype != dst.dtype and is_float(src.dtype) and is_float(dst.dtype)
    shape = dst.shape
    read = _indirect_read(src) if src.indirect is not None else _direct_read(src)
    write = _indirect_write(dst) if dst.indirect is not None else _direct_write(dst)

    def step():
        values = read()
        if widen:
            values = values.astype(FLOAT32)
        write(values.reshape(shape) if values.shape != shape else values)

    return step


def _direct_read(src):
    view = source_view(src)
    return lambda: view


def _direct_write(dst):
    view = destination_view(dst)
    return lambda values: store_into(view, values)


def _indirect_read(src):
    elements, addresses = src.storage_elements(), src.indirect_addresses()
    return lambda: elements[addresses()]


def _indirect_write(dst):
    dst.storage.written = True
    elements, addresses, shape, dtype = dst.storage_elements(), dst.indirect_addresses(), dst.shape, dst.dtype

    def write(values):
        elements[addresses()] = cast_to(np.asarray(values), dtype).reshape(shape)

    return write


def _dma_skip_oob(dst, src) -> None:
    """oob_mode=skip: the elements whose source or destination address falls outside its tensor (an indirect
    offset or a dynamic scalar_offset past the end) are not transferred; the others are."""
    src_index, dst_index = src.element_indices().reshape(-1), dst.element_indices().reshape(-1)
    valid = ((src_index >= 0) & (src_index < src.flat().size)) & ((dst_index >= 0) & (dst_index < dst.flat().size))
    values = src.flat()[src_index[valid]]
    if values.dtype != dst.dtype and is_float(values.dtype) and is_float(dst.dtype):
        values = values.astype(FLOAT32)
    dst.flat()[dst_index[valid]] = cast_to(values, dst.dtype)
    dst.storage.written = True


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=None, oob_mode=None, name=None):
    """dst = src transposed (HBM -> SBUF or SBUF -> SBUF), 2- or 4-byte dtypes, dst shape = transposed src."""
    name = "dma_transpose"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    require_buffers(name, "src", src, ("hbm", "sbuf"))
    require_buffers(name, "dst", dst, ("sbuf",))
    check_tile(name, "dst", dst, compute=False)
    target = memory.current().target
    if not target.dma_transpose:
        raise NkiValidationError(
            "err_dma_transpose_unsupported", f"{target.name} ({target.nc_version}) has no DMA transpose (trn2+)", name
        )
    if src.itemsize not in (2, 4):
        raise NkiValidationError("err_dma_transpose_dtype", f"dtype {src.dtype.name} is not 2 or 4 bytes", name)
    axes = tuple(axes) if axes is not None else DEFAULT_TRANSPOSE_AXES.get(src.ndim, tuple(reversed(range(src.ndim))))
    expected = tuple(src.shape[a] for a in axes)
    if dst.shape != expected:
        raise NkiValidationError(
            "err_dma_transpose_shape", f"dst shape {dst.shape} must equal transposed src shape {expected}", name
        )
    if src.indirect is not None:
        refuse_replay("dma_transpose of an indirect access pattern")
        store(dst, src.read().transpose(axes))
    else:
        src_view, dst_view = source_view(src), destination_view(dst)
        run_step(lambda: store_into(dst_view, src_view.transpose(axes)))
    record(name, "dma", dst, [("src", src)], {"transpose": True}, hbm_partitions=dst.partitions)


def _on_chip_partitions(dst, src) -> int | None:
    """The partitions a DMA spreads over (the SBUF side's), which is how the DMA engines split the transfer."""
    for side in (dst, src):
        if side.on_chip:
            return side.partitions
    return None


DMA_COMPUTE_MAX_SOURCES = 16


def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=None, name=None):
    """dst = srcs[0] + srcs[1] + ... computed in fp32 by the DMA engines (HBM or SBUF, never PSUM); a source
    with a vector_offset makes it a read-modify-write gather (dst in SBUF) or scatter (dst in HBM)."""
    name = "dma_compute"
    dst = require_tensor(name, "dst", dst)
    sources = [require_tensor(name, f"srcs[{i}]", s) for i, s in enumerate(srcs)]
    if not 1 <= len(sources) <= DMA_COMPUTE_MAX_SOURCES:
        raise NkiValidationError("err_dma_compute_sources", f"{len(sources)} sources: 1 to 16", name)
    if ops.resolve(reduce_op, name, "reduce_op").name != "add":
        raise NkiValidationError("err_dma_compute_reduce_op", "reduce_op must be nl.add", name)
    if scales is not None and (len(scales) != len(sources) or any(float(s) != 1.0 for s in scales)):
        raise NkiValidationError("err_dma_compute_scales", f"scales must be all 1.0, one per source: {scales}", name)
    indirect = any(t.indirect is not None for t in (dst, *sources))
    if indirect and (len(sources) != 2 or not unique_indices):
        raise NkiValidationError(
            "err_dma_compute_indirect", "a read-modify-write with vector_offset takes exactly 2 sources and "
            "unique_indices=True", name,
        )
    if indirect and getattr(oob_mode, "name", oob_mode) == "skip":
        raise NkiNotSimulatedError("nki.isa.dma_compute with oob_mode=skip")
    for role, tile in (("dst", dst), *((f"srcs[{i}]", s) for i, s in enumerate(sources))):
        require_buffers(name, role, tile, ("hbm", "sbuf"), "err_dma_from_psum")
        check_tile(name, role, tile, compute=False)
        if tile.size != dst.size:
            raise NkiValidationError(
                "err_dma_shape_mismatch", f"{role} has {tile.size} elements, dst {dst.size}: they must match", name
            )
    if indirect:
        refuse_replay("dma_compute through a vector_offset (which elements it reads depends on the offsets)")
        total = sum(s.read().astype(FLOAT32).reshape(-1) for s in sources)
        store(dst, total.reshape(dst.shape))
    else:
        run_step(_sum_step(dst, sources))
    record(name, "dma", dst, [(f"src{i}", s) for i, s in enumerate(sources)], {"indirect": indirect},
           flops=dst.size * (len(sources) - 1), hbm_partitions=_on_chip_partitions(dst, sources[0]))


def _sum_step(dst, sources):
    """The step of a direct dma_compute: the sources' values summed in fp32, rounded to dst's dtype."""
    views, dst_view = [source_view(source) for source in sources], destination_view(dst)

    def step():
        total = sum(view.astype(FLOAT32).reshape(-1) for view in views)
        store_into(dst_view, total)

    return step
