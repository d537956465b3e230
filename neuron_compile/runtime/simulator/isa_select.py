"""Simulator stage: the Vector engine's select-with-reduce instructions of ``nki.isa`` (select_reduce,
range_select), the masking steps of attention kernels.

Input: SBUF/PSUM tiles (values, an integer predicate or per-partition fp32 bounds), a fill value and a
``reduce_cmd``. Output: dst written, VectorE's accumulator registers updated with the max of the result
(accumulators.py), ``reduce_res`` written when given, every documented rule checked, one InstructionRecord each.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator import accumulators
from neuron_compile.runtime.simulator import ops as _ops
from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    check_elementwise,
    fp32_tile,
    is_float,
    record,
    require_tensor,
    require_version,
    scalar_or_vector,
    store,
)
from neuron_compile.runtime.simulator.tensor import NkiTensor

PREDICATE_DTYPES = ("int8", "uint8", "int16", "uint16")
SELECT_VALUE_REFUSED = ("int32", "uint32")  # and tfloat32, which this simulator stores as float32
COMPARISONS = ("equal", "less", "less_equal", "greater", "greater_equal")
FP32_MIN = np.float32(-3.4028235e38)  # range_select's only fill value (the hardware's)
EXACT_INDEX_LIMIT = 2**24  # range_select compares element indices in fp32


def _finish_reduce(name: str, command: str, values: np.ndarray, first_lane: int, reduce_res) -> None:
    """The max reduction of select results: through the registers, or with ``idle`` and a reduce_res, of
    this instruction's values alone (the registers untouched)."""
    partial = accumulators.partial_reduce(values, "maximum")
    if command == "idle":
        if reduce_res is not None:
            store(accumulators.reduce_res_tile(name, reduce_res, values.shape[0]), partial[:, None])
        return
    accumulators.reduce_into(name, "vector", command, "maximum", partial, first_lane, reduce_res)


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=None, reduce_op=None,
                  reverse_pred=False, name=None):
    """dst = where(predicate != 0, on_true, on_false) (VectorE), with an optional max reduction of dst per
    partition into reduce_res; ``reverse_pred`` selects on_true where the predicate is 0."""
    name = "select_reduce"
    dst, predicate, on_true = (require_tensor(name, r, t) for r, t in
                               (("dst", dst), ("predicate", predicate), ("on_true", on_true)))
    check_elementwise(name, dst, [("predicate", predicate), ("on_true", on_true)], "vector")
    if on_true.kind == predicate.kind == "psum":
        raise NkiValidationError(
            "err_select_both_psum", f"on_true {on_true.name} and predicate {predicate.name} cannot both be in PSUM", name
        )
    if predicate.dtype.name not in PREDICATE_DTYPES:
        raise NkiValidationError(
            "err_predicate_dtype", f"predicate {predicate.name} is {predicate.dtype.name}, not one of "
            f"{list(PREDICATE_DTYPES)}", name,
        )
    if on_true.dtype.name in SELECT_VALUE_REFUSED:
        raise NkiValidationError("err_select_dtype", f"on_true {on_true.name} is {on_true.dtype.name}", name)
    accumulators.resolve_reduce_op(name, reduce_op, ("maximum",), "maximum")
    command = accumulators.command_name(reduce_cmd)
    if command not in ("idle", "reset_reduce", "reduce"):
        raise NkiValidationError("err_reduce_cmd", f"reduce_cmd {command}: idle, reset_reduce or reduce", name)
    p = on_true.partitions
    if isinstance(on_false, NkiTensor):
        fill = scalar_or_vector(name, "on_false", on_false, p, "err_select_on_false", require_fp32=False)
    elif isinstance(on_false, (int, float, np.integer, np.floating)) and not isinstance(on_false, bool):
        fill = np.float32(on_false)
    else:
        raise NkiValidationError("err_select_on_false", f"on_false must be a float or a ({p}, 1) tile", name)
    chosen = predicate.read().reshape(p, -1) != 0
    if reverse_pred:
        chosen = ~chosen
    values = np.where(chosen, fp32_tile(on_true), fill).astype(FLOAT32)
    store(dst, values)
    _finish_reduce(name, command, values, on_true.start_partition, reduce_res)
    srcs = [("predicate", predicate), ("on_true", on_true), ("on_false", on_false)]
    if reduce_res is not None:
        srcs.append(("reduce_res", reduce_res))
    record(name, "vector", dst, srcs, {"reduce_cmd": command}, flops=dst.size)


def _bound(name: str, role: str, bound, partitions: int) -> np.ndarray:
    tile = require_tensor(name, role, bound)
    return scalar_or_vector(name, role, tile, partitions, "err_range_select_bound", True, "err_range_select_bound")


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=None, reduce_res=None,
                 reduce_op=None, range_start=0, on_false_value=FP32_MIN, name=None):
    """dst = on_true_tile where comp_op0(index, bound0) and comp_op1(index, bound1), else FP32_MIN, with
    index = range_start + the element's position along the free dims (VectorE, NeuronCore-v3+); the max of
    dst per partition goes through VectorE's accumulator registers into reduce_res."""
    name = "range_select"
    require_version(name, "gen3")
    dst, on_true = require_tensor(name, "dst", dst), require_tensor(name, "on_true_tile", on_true_tile)
    check_elementwise(name, dst, [("on_true_tile", on_true)], "vector")
    if not is_float(on_true.dtype):
        raise NkiValidationError("err_select_dtype", f"on_true_tile {on_true.name} is {on_true.dtype.name}, not a "
                                 "float", name)
    comparisons = [_ops.resolve(op, name, role) for op, role in ((comp_op0, "comp_op0"), (comp_op1, "comp_op1"))]
    for func in comparisons:
        if func.name not in COMPARISONS:
            raise NkiValidationError("err_unsupported_op", f"{func.name} is not one of {list(COMPARISONS)}", name)
    if np.float32(on_false_value) != FP32_MIN:
        raise NkiValidationError(
            "err_range_select_fill", f"on_false_value must be FP32_MIN ({FP32_MIN}), got {on_false_value!r}", name
        )
    if not isinstance(range_start, (int, np.integer)) or not 0 <= range_start + on_true.free_size <= EXACT_INDEX_LIMIT:
        raise NkiValidationError(
            "err_range_select_start", f"range_start {range_start!r} must be a compile-time int with range_start + "
            f"{on_true.free_size} elements within 2**24 (indices are compared in fp32)", name,
        )
    accumulators.resolve_reduce_op(name, reduce_op, ("maximum",), "maximum")
    command = accumulators.command_name(reduce_cmd, "reset_reduce")
    p = on_true.partitions
    low, high = _bound(name, "bound0", bound0, p), _bound(name, "bound1", bound1, p)
    index = (np.float32(range_start) + np.arange(on_true.free_size, dtype=FLOAT32))[None, :]
    keep = (comparisons[0].fn(index, low) != 0) & (comparisons[1].fn(index, high) != 0)
    values = np.where(keep, fp32_tile(on_true), FP32_MIN).astype(FLOAT32)
    store(dst, values)
    _finish_reduce(name, command, values, on_true.start_partition, reduce_res)
    srcs = [("on_true_tile", on_true), ("bound0", bound0), ("bound1", bound1)]
    if reduce_res is not None:
        srcs.append(("reduce_res", reduce_res))
    record(name, "vector", dst, srcs, {"reduce_cmd": command}, flops=2 * dst.size)
