"""Simulator stage: the statistics, scan and selection instructions of ``nki.isa`` (bn_stats, bn_aggr,
tensor_tensor_scan, tensor_partition_reduce, max8, nc_find_index8, nc_match_replace8).

Input: SBUF/PSUM tiles. Output: dst written (fp32 math, rounded to dst), rules checked, one InstructionRecord
each.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator import ops as _ops
from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    check_elementwise,
    check_same_free,
    check_same_partitions,
    check_tile,
    destination_view,
    fp32_rows,
    fp32_tile,
    int_values,
    operand_values,
    record,
    require_buffers,
    require_tensor,
    scalar_or_vector,
    source_view,
    store,
    store_into,
)
from neuron_compile.runtime.simulator.replay import run_step


def bn_stats(dst, data, name=None):
    """Per-partition statistics of data (free size <= bn_stats_fmax): (count, mean, M2) of even, odd elements."""
    name = "bn_stats"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    check_tile(name, "data", data)
    check_tile(name, "dst", dst)
    check_same_partitions(name, data, dst, "data", "dst")
    limit = current().target.bn_stats_fmax
    if data.free_size > limit:
        raise NkiValidationError(
            "err_bn_stats_fmax", f"data free size {data.free_size} exceeds bn_stats_fmax {limit}", name
        )
    if dst.free_size != 6:
        raise NkiValidationError("err_bn_stats_dst_shape", f"dst {dst.shape} must hold 6 elements per partition", name)
    x = fp32_tile(data)
    stats = []
    for half in (x[:, 0::2], x[:, 1::2]):
        count = half.shape[1]
        mean = half.mean(axis=1, dtype=FLOAT32) if count else np.zeros(x.shape[0], FLOAT32)
        m2 = ((half - mean[:, None]) ** 2).sum(axis=1, dtype=FLOAT32)
        stats += [np.full(x.shape[0], count, FLOAT32), mean, m2]
    store(dst, np.stack(stats, axis=1))
    record(name, "vector", dst, [("data", data)], flops=data.size)


def bn_aggr(dst, data, name=None):
    """Combine bn_stats groups (P, 6*k) into (mean, variance) per partition (Chan's parallel formula)."""
    name = "bn_aggr"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    check_tile(name, "data", data)
    check_tile(name, "dst", dst)
    check_same_partitions(name, data, dst, "data", "dst")
    if data.free_size % 3 or dst.free_size != 2:
        raise NkiValidationError(
            "err_bn_aggr_shape",
            f"data {data.shape} must hold bn_stats groups (3k elements) and dst {dst.shape} 2", name,
        )
    groups = fp32_tile(data).reshape(data.partitions, -1, 3)
    count, mean, m2 = groups[..., 0], groups[..., 1], groups[..., 2]
    total = count.sum(axis=1)
    safe_total = np.where(total > 0, total, 1)
    grand_mean = (count * mean).sum(axis=1) / safe_total
    grand_m2 = (m2 + count * (mean - grand_mean[:, None]) ** 2).sum(axis=1)
    store(dst, np.stack([grand_mean, grand_m2 / safe_total], axis=1))
    record(name, "vector", dst, [("data", data)], flops=data.size)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """r[:, i] = op1(op0(data0[:, i], r[:, i-1]), data1[:, i]) with r[:, -1] = initial (fp32, per partition)."""
    name = "tensor_tensor_scan"
    dst, data0, data1 = (require_tensor(name, r, t) for r, t in (("dst", dst), ("data0", data0), ("data1", data1)))
    func0, func1 = _ops.resolve(op0, name, "op0"), _ops.resolve(op1, name, "op1")
    check_elementwise(name, dst, [("data0", data0), ("data1", data1)], "vector")
    if data0.kind == "psum" and data1.kind == "psum":
        raise NkiValidationError("err_tensor_tensor_both_psum", "data0 and data1 cannot both be in PSUM", name)
    p = data0.partitions
    initial_values = operand_values(name, "initial", initial, p, "err_scan_initial")
    first, second, dst_view = source_view(data0), source_view(data1), destination_view(dst)
    running_sum = func0.name == "add" and func1.name == "add" and not (reverse0 or reverse1)

    def step():
        a, b = fp32_rows(first, p), fp32_rows(second, p)
        state = np.broadcast_to(initial_values(), (p, 1))[:, 0].astype(FLOAT32)
        out = np.empty_like(a)
        if running_sum:
            # r_i = a_i + r_{i-1} + b_i: a running sum, vectorized (same left-to-right fp32 order)
            out[:] = np.cumsum(np.concatenate([state[:, None], a + b], axis=1), axis=1, dtype=FLOAT32)[:, 1:]
        else:
            for i in range(a.shape[1]):
                inner = func0.fn(state, a[:, i]) if reverse0 else func0.fn(a[:, i], state)
                state = (func1.fn(b[:, i], inner) if reverse1 else func1.fn(inner, b[:, i])).astype(FLOAT32)
                out[:, i] = state
        store_into(dst_view, out)

    run_step(step)
    record(name, "vector", dst, [("data0", data0), ("data1", data1)], {"op0": func0.name, "op1": func1.name},
           flops=2 * data0.size)


def tensor_partition_reduce(dst, op, data, name=None):
    """dst[0, :] = reduce(op) of data across its partitions (GpSimd)."""
    name = "tensor_partition_reduce"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    func = _ops.resolve(op, name)
    for role, t in (("dst", dst), ("data", data)):
        require_buffers(name, role, t, ("sbuf",), "err_gpsimd_psum_access")
        check_tile(name, role, t)
    check_same_free(name, data, dst, "data", "dst")
    if func.reduce_ufunc is None or dst.partitions != 1:
        raise NkiValidationError(
            "err_partition_reduce", f"op {func.name} / dst {dst.shape}: need a reduction op and a 1-partition dst", name
        )
    values = fp32_tile(data) if func.kind != "bitvec" else int_values(data)
    store(dst, func.reduce_ufunc.reduce(values, axis=0, keepdims=True))
    record(name, "gpsimd", dst, [("data", data)], {"op": func.name}, flops=data.size)


def max8(dst, src, name=None):
    """dst[P, 8] = the 8 largest values of each partition of src, in descending order (VectorE)."""
    name = "max8"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    _check_top8(name, dst, src)
    values = fp32_tile(src)
    store(dst, -np.sort(-values, axis=1)[:, :8])
    record(name, "vector", dst, [("src", src)], flops=src.size)


def nc_find_index8(dst, data, vals, name=None):
    """dst[P, 8] = index of the first occurrence of each of the 8 vals in each partition of data (VectorE)."""
    name = "nc_find_index8"
    dst, data, vals = (require_tensor(name, r, t) for r, t in (("dst", dst), ("data", data), ("vals", vals)))
    _check_top8(name, dst, data)
    check_same_partitions(name, vals, data, "vals", "data")
    if vals.free_size != 8 or dst.dtype.name not in ("uint16", "uint32"):
        raise NkiValidationError(
            "err_find_index8_shape", f"vals {vals.shape} must hold 8 values per partition and dst dtype "
            f"{dst.dtype.name} must be uint16 or uint32", name,
        )
    # duplicate vals take successive occurrences, the first duplicate the first occurrence; a value absent from
    # data is undefined on hardware: index 0 is reported, as a first-match search that finds nothing gives
    positions, _ = _match_positions(fp32_tile(data), fp32_tile(vals), range(8))
    store(dst, positions)
    record(name, "vector", dst, [("data", data), ("vals", vals)], flops=data.size)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """dst = data with the first not yet matched occurrence of each of the 8 vals of each partition replaced
    by imm (VectorE); the vals are matched from the last to the first, so duplicate vals take successive
    occurrences, and the matched positions go to dst_idx (the first occurrence in the highest slot)."""
    name = "nc_match_replace8"
    dst, data, vals = (require_tensor(name, r, t) for r, t in (("dst", dst), ("data", data), ("vals", vals)))
    for role, t in (("dst", dst), ("data", data), ("vals", vals)):
        require_buffers(name, role, t, ("sbuf", "psum"))
        check_tile(name, role, t)
    check_same_partitions(name, data, dst, "data", "dst")
    check_same_partitions(name, vals, data, "vals", "data")
    check_same_free(name, dst, data, "dst", "data")
    if not 8 <= data.free_size <= 16384:
        raise NkiValidationError("err_top8_shape", f"data {data.shape} must hold 8..16384 elements per partition", name)
    if vals.free_size != 8:
        raise NkiValidationError("err_match_replace8_shape", f"vals {vals.shape} must hold 8 values per partition", name)
    if dst_idx is not None:
        dst_idx = require_tensor(name, "dst_idx", dst_idx)
        check_same_partitions(name, dst_idx, data, "dst_idx", "data")
        if dst_idx.free_size != 8 or dst_idx.dtype.name not in ("uint16", "uint32", "int32"):
            raise NkiValidationError(
                "err_match_replace8_shape", f"dst_idx {dst_idx.shape} {dst_idx.dtype.name} must hold 8 integer indices "
                "per partition", name,
            )
    values = fp32_tile(data).copy()
    positions, matched = _match_positions(values, fp32_tile(vals), range(7, -1, -1))
    if (matched.sum(axis=1) < 8).any():
        raise NkiValidationError(
            "err_match_replace8_value_absent", f"a value of vals is absent from some partition of data {data.name} "
            "(the hardware result is undefined then)", name,
        )
    values[matched] = np.float32(imm)
    store(dst, values)
    srcs = [("data", data), ("vals", vals)]
    if dst_idx is not None:
        store(dst_idx, positions)
        srcs.append(("dst_idx", dst_idx))
    record(name, "vector", dst, srcs, flops=data.size)


def _match_positions(values: np.ndarray, wanted: np.ndarray, slots) -> tuple[np.ndarray, np.ndarray]:
    """For each partition, the position of the first not yet matched occurrence of each wanted value, taking
    the (P, 8) slots in the order given; also the (P, F) mask of matched positions. Absent values: position 0,
    nothing matched."""
    matched = np.zeros(values.shape, dtype=bool)
    positions = np.zeros(wanted.shape, dtype=np.int64)
    for slot in slots:
        candidates = (values == wanted[:, slot:slot + 1]) & ~matched
        found = candidates.any(axis=1)
        positions[:, slot] = candidates.argmax(axis=1)
        rows = np.flatnonzero(found)
        matched[rows, positions[rows, slot]] = True
    return positions, matched


def _check_top8(name: str, dst, src) -> None:
    for role, t in (("dst", dst), ("src", src)):
        require_buffers(name, role, t, ("sbuf", "psum"))
        check_tile(name, role, t)
    check_same_partitions(name, src, dst, "src", "dst")
    if dst.free_size != 8 or not 8 <= src.free_size <= 16384:
        raise NkiValidationError(
            "err_top8_shape", f"dst {dst.shape} must hold 8 elements per partition and src {src.shape} 8..16384",
            name,
        )
