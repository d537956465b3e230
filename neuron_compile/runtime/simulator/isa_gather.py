"""Simulator stage: the GpSimd engine's gather and index instructions of ``nki.isa`` (local_gather,
nc_n_gather, sequence_bounds, nonzero_with_count).

Input: SBUF tiles (data, integer indices, segment ids). Output: dst written without any dtype conversion of
gathered data, every documented rule checked (NkiValidationError naming the rule, the values and the
instruction: index dtypes, the 16-partition GpSimd core groups, out-of-range indices), one InstructionRecord each.

GpSimd has eight cores, each wired to 16 consecutive partitions; local_gather gathers within each core's
partitions, nonzero_with_count runs on the first partition of each core only.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.rules import (
    check_same_partitions,
    check_tile,
    int_values,
    record,
    require_buffers,
    require_tensor,
    require_version,
    store,
)

PARTITIONS_PER_CORE = 16
ELEMENTS_PER_INDEX = (1, 2, 4, 8, 16, 32)
MAX_INDICES_PER_CORE = 4096


def _sbuf_tiles(name: str, **tiles) -> list:
    """The named operands as SBUF tiles (GpSimd cannot reach PSUM), partition limits checked."""
    checked = []
    for role, tile in tiles.items():
        tile = require_tensor(name, role, tile)
        require_buffers(name, role, tile, ("sbuf",), "err_gpsimd_psum_access")
        check_tile(name, role, tile)
        checked.append(tile)
    return checked


def _require_dtype(name: str, role: str, tile, allowed: tuple[str, ...]) -> None:
    if tile.dtype.name not in allowed:
        raise NkiValidationError(f"err_{name}_dtype", f"{role} {tile.name} is {tile.dtype.name}, not one of "
                                 f"{list(allowed)}", name)


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Per GpSimd core (16 partitions): the core's uint16 indices, read partition first, are element offsets
    into each of its partitions' free elements; dst[p, j, :] = src_buffer[p, offset_j : offset_j + num_elem_per_idx]
    for the first num_valid_indices offsets."""
    name = "local_gather"
    dst, src, index = _sbuf_tiles(name, dst=dst, src_buffer=src_buffer, index=index)
    check_same_partitions(name, index, src, "index", "src_buffer")
    check_same_partitions(name, dst, src, "dst", "src_buffer")
    p = src.partitions
    if p % PARTITIONS_PER_CORE:
        raise NkiValidationError(
            "err_local_gather_partitions", f"src_buffer and index span {p} partitions, not a multiple of 16", name
        )
    _require_dtype(name, "index", index, ("uint16",))
    if dst.dtype != src.dtype:
        raise NkiValidationError(
            "err_local_gather_dtype", f"dst is {dst.dtype.name}, src_buffer {src.dtype.name}: no conversion", name
        )
    if num_elem_per_idx not in ELEMENTS_PER_INDEX:
        raise NkiValidationError(
            "err_local_gather_elements", f"num_elem_per_idx {num_elem_per_idx} is not one of {ELEMENTS_PER_INDEX}", name
        )
    per_core = PARTITIONS_PER_CORE * index.free_size
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < valid <= min(per_core, MAX_INDICES_PER_CORE):
        raise NkiValidationError(
            "err_local_gather_indices", f"{valid} indices per core: at most the {per_core} of each core's index slice "
            f"and at most {MAX_INDICES_PER_CORE}", name,
        )
    if dst.free_size != valid * num_elem_per_idx:
        raise NkiValidationError(
            "err_local_gather_shape", f"dst {dst.shape} must hold {valid} x {num_elem_per_idx} elements per partition",
            name,
        )
    flat = src.read().reshape(p, -1)
    offsets = int_values(index).astype(np.int64)
    span = np.arange(num_elem_per_idx)
    out = np.empty((p, valid, num_elem_per_idx), dtype=src.dtype)
    for core in range(p // PARTITIONS_PER_CORE):
        rows = slice(core * PARTITIONS_PER_CORE, (core + 1) * PARTITIONS_PER_CORE)
        starts = offsets[rows].reshape(-1, order="F")[:valid]  # partition first: column by column
        positions = starts[:, None] + span[None, :]
        if positions.max() >= flat.shape[1]:
            raise NkiValidationError(
                "err_local_gather_out_of_bounds", f"offset {int(positions.max())} is past the {flat.shape[1]} elements "
                "of a src_buffer partition (undefined on hardware)", name,
            )
        out[rows] = flat[rows][:, positions]
    store(dst, out)
    record(name, "gpsimd", dst, [("src_buffer", src), ("index", index)], {"elements_per_index": num_elem_per_idx})


def nc_n_gather(dst, data, indices, name=None):
    """dst[p, j] = data[p, indices[p, j]] with data's free dims flattened (GpSimd; indices uint32)."""
    name = "nc_n_gather"
    dst, data, indices = _sbuf_tiles(name, dst=dst, data=data, indices=indices)
    check_same_partitions(name, data, dst, "data", "dst")
    check_same_partitions(name, indices, dst, "indices", "dst")
    _require_dtype(name, "indices", indices, ("uint32",))
    if dst.dtype != data.dtype:
        raise NkiValidationError("err_nc_n_gather_dtype", f"dst is {dst.dtype.name}, data {data.dtype.name}", name)
    if dst.free_size != indices.free_size:
        raise NkiValidationError(
            "err_nc_n_gather_shape", f"dst {dst.shape} must hold as many elements per partition as indices "
            f"{indices.shape}", name,
        )
    flat = data.read().reshape(data.partitions, -1)
    where = int_values(indices).astype(np.int64)
    if where.size and where.max() >= flat.shape[1]:
        raise NkiValidationError(
            "err_nc_n_gather_out_of_bounds", f"index {int(where.max())} is outside [0, {flat.shape[1]}) of data "
            f"{data.name} {data.shape}", name,
        )
    store(dst, np.take_along_axis(flat, where, axis=1))
    record(name, "gpsimd", dst, [("data", data), ("indices", indices)], {"groups": -(-dst.free_size // 512)})


def _bounds_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of the run of equal ids each element lies in; id 0 (padding) gets (n, -1)."""
    n = ids.size
    starts_run = np.r_[True, ids[1:] != ids[:-1]]
    run = np.cumsum(starts_run) - 1
    run_starts = np.flatnonzero(starts_run)
    run_ends = np.r_[run_starts[1:], n]
    padding = ids == 0
    return np.where(padding, n, run_starts[run]), np.where(padding, -1, run_ends[run])


def sequence_bounds(dst, segment_ids, name=None):
    """dst[0, 0, i], dst[0, 1, i] = the start and (exclusive) end of the run of equal segment ids element i lies
    in; padding (id 0) gets start n and end -1 (GpSimd; one partition; float32 or int32)."""
    name = "sequence_bounds"
    dst, ids = _sbuf_tiles(name, dst=dst, segment_ids=segment_ids)
    for role, tile in (("dst", dst), ("segment_ids", ids)):
        _require_dtype(name, role, tile, ("float32", "int32"))
    if ids.partitions != 1 or dst.partitions != 1:
        raise NkiValidationError(
            "err_sequence_bounds_partitions", f"segment_ids {ids.shape} and dst {dst.shape} must have one partition",
            name,
        )
    if dst.free_size != 2 * ids.free_size:
        raise NkiValidationError(
            "err_sequence_bounds_shape", f"dst {dst.shape} must be (1, 2, {ids.free_size}) for segment_ids {ids.shape}",
            name,
        )
    values = ids.read().reshape(-1).astype(np.float64)
    if (values < 0).any():
        raise NkiValidationError("err_sequence_bounds_ids", "segment ids must be non-negative", name)
    starts, ends = _bounds_of(values)
    store(dst, np.stack([starts, ends])[None].astype(np.float64))
    record(name, "gpsimd", dst, [("segment_ids", ids)])


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112 (the first of each GpSimd core): dst = the positions of src's nonzero
    elements + index_offset, then padding_val up to src's length, then their count (NeuronCore-v3+)."""
    name = "nonzero_with_count"
    require_version(name, "gen3")
    dst, src = _sbuf_tiles(name, dst=dst, src=src)
    check_same_partitions(name, src, dst, "src", "dst")
    _require_dtype(name, "src", src, ("float32", "int32"))
    _require_dtype(name, "dst", dst, ("int32",))
    if dst.free_size != src.free_size + 1:
        raise NkiValidationError(
            "err_nonzero_with_count_shape", f"dst {dst.shape} must hold one element more per partition than src "
            f"{src.shape} (the count)", name,
        )
    for role, value in (("index_offset", index_offset), ("padding_val", padding_val)):
        if not isinstance(value, (int, np.integer)) or not -(2**31) <= value < 2**31:
            raise NkiValidationError("err_nonzero_with_count_immediate", f"{role} {value!r} is not an int32", name)
    values = src.read().reshape(src.partitions, -1)
    out = np.array(dst.read(), dtype=np.int64).reshape(dst.partitions, -1)
    first = src.start_partition
    for row in range(src.partitions):
        if (first + row) % PARTITIONS_PER_CORE:
            continue  # only each core's first partition is read and written
        found = np.flatnonzero(values[row]) + int(index_offset)
        out[row, :] = padding_val
        out[row, :found.size] = found
        out[row, -1] = found.size
    store(dst, out)
    record(name, "gpsimd", dst, [("src", src), ("dst", dst)])
