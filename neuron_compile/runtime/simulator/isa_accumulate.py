"""Simulator stage: the Vector engine's accumulating instructions of ``nki.isa`` (tensor_scalar_reduce,
tensor_scalar_cumulative, exponential).

Input: SBUF/PSUM tiles, an ALU operator and an fp32 scalar or (P, 1) operand, a ``reduce_cmd``. Output: dst
written (fp32 math rounded to dst's dtype), VectorE's accumulator registers updated by the command
(accumulators.py), ``reduce_res`` written when given, every documented rule checked (NkiValidationError naming
the rule, the values and the instruction), one InstructionRecord each.
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
    record,
    require_tensor,
    require_version,
    scalar_or_vector,
    store,
)

# (shape rule, require fp32, dtype rule) of an operand that must be an fp32 scalar or (P, 1) tile
_FP32_OPERAND = (True, "err_operand_dtype")
SCALAR_REDUCE_OPS = ("add", "multiply", "maximum", "minimum")
CUMULATIVE_OPS = ("add", "subtract", "multiply", "maximum", "minimum")
# tensor_scalar_cumulative's inputs and outputs (the ISA has no 32-bit integer form of it)
CUMULATIVE_DTYPES = {"bfloat16", "float16", "float32", "float8_e4m3", "float8_e5m2", "float8_e4m3fn", "uint8",
                     "uint16", "int8", "int16"}
EXPONENTIAL_DST_DTYPES = {"float8_e4m3", "float8_e5m2", "float16", "bfloat16", "float32", "int8", "int16", "int32",
                          "uint8", "uint16"}


def _arithmetic_op(name: str, op, role: str, allow_unary: bool = False):
    func = _ops.resolve(op, name, role)
    kinds = ("arith", "unary") if allow_unary else ("arith",)
    if func.kind not in kinds:
        raise NkiValidationError(
            "err_unsupported_op", f"{role}={func.name} must be an arithmetic ALU operator (not {func.kind})", name
        )
    return func


def _initial(name: str, command: str, value, partitions: int, role: str):
    """The load_reduce initial value (required then, refused otherwise) as fp32 (P,) or a scalar."""
    if command != "load_reduce":
        if value is not None and not (np.isscalar(value) and value == 0):
            raise NkiValidationError(
                "err_reduce_init", f"{role} is only read by reduce_cmd=load_reduce, got {command} with {role}={value!r}",
                name,
            )
        return None
    if value is None:
        raise NkiValidationError("err_reduce_init", f"reduce_cmd=load_reduce needs {role}", name)
    values = scalar_or_vector(name, role, value, partitions, "err_reduce_init", *_FP32_OPERAND)
    return values[:, 0] if values.ndim == 2 else values


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False, reduce_cmd=None,
                         reduce_init=None, reduce_res_negate=False, name=None):
    """dst = data op0 operand0 (VectorE, fp32) and reduce_op (add, multiply, max, min) of it over all free
    dims, through VectorE's accumulator registers, into reduce_res (P, 1)."""
    name = "tensor_scalar_reduce"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    func = _arithmetic_op(name, op0, "op0", allow_unary=True)
    if reverse0:
        raise NkiValidationError("err_tensor_scalar_reduce_reverse", "reverse0 is not supported by the ISA yet", name)
    check_elementwise(name, dst, [("data", data)], "vector")
    command = accumulators.command_name(reduce_cmd, "reset_reduce")
    if command not in ("reset_reduce", "reduce", "load_reduce"):
        raise NkiValidationError("err_reduce_cmd", f"reduce_cmd {command}: reset_reduce, reduce or load_reduce", name)
    reduce_name = accumulators.resolve_reduce_op(name, reduce_op, SCALAR_REDUCE_OPS, "add")
    p = data.partitions
    x = fp32_tile(data)
    if func.kind == "unary":
        if operand0 is not None and not (np.isscalar(operand0) and operand0 == 0):
            raise NkiValidationError(
                "err_tensor_scalar_operand_shape", f"operand0 must be None or 0 with the unary op {func.name}", name
            )
        y = func.fn(x)
    else:
        y = func.fn(x, scalar_or_vector(name, "operand0", operand0, p, "err_tensor_scalar_operand_shape",
                                        True, "err_tensor_scalar_operand_dtype"))
    y = np.asarray(y, dtype=FLOAT32)
    store(dst, y)
    initial = _initial(name, command, reduce_init, p, "reduce_init")
    accumulators.reduce_into(name, "vector", command, reduce_name, accumulators.partial_reduce(y, reduce_name),
                             data.start_partition, reduce_res, initial, negate=reduce_res_negate)
    srcs = [("data", data), ("operand0", operand0)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    record(name, "vector", dst, srcs, {"op": func.name, "reduce_op": reduce_name}, flops=2 * data.size)


def _scan(op: str, start: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Running ``reg = op(value_i, reg)`` along the free axis from ``start`` (P,), in fp32, in element order."""
    if op == "subtract":  # reg = value - reg: no ufunc accumulates that, so step through the elements
        out = np.empty_like(values)
        reg = start
        for i in range(values.shape[1]):
            reg = values[:, i] - reg
            out[:, i] = reg
        return out
    ufunc = accumulators.FOLDS[op][0]
    return ufunc.accumulate(np.concatenate([start[:, None], values], axis=1), axis=1)[:, 1:]


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=None, name=None):
    """dst[:, i] = reg = op1(src[:, i] op0 imm0, reg) along the free dims (VectorE, fp32): a running sum,
    product, max or min (or an alternating difference with subtract) seeded by reduce_cmd."""
    name = "tensor_scalar_cumulative"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    func0 = _arithmetic_op(name, op0, "op0")
    func1 = _arithmetic_op(name, op1, "op1")
    if func1.name not in CUMULATIVE_OPS:
        raise NkiValidationError("err_unsupported_op", f"op1={func1.name} must be one of {list(CUMULATIVE_OPS)}", name)
    for role, tile in (("src", src), ("dst", dst)):
        if tile.dtype.name not in CUMULATIVE_DTYPES:
            raise NkiValidationError(
                "err_cumulative_dtype", f"{role} {tile.name} is {tile.dtype.name}; tensor_scalar_cumulative reads and "
                f"writes {sorted(CUMULATIVE_DTYPES)} (no 32-bit integers)", name,
            )
    check_elementwise(name, dst, [("src", src)], "vector")
    command = accumulators.command_name(reduce_cmd, "reset_reduce")
    if command not in ("reset_reduce", "reduce", "load_reduce"):
        raise NkiValidationError("err_reduce_cmd", f"reduce_cmd {command}: reset_reduce, reduce or load_reduce", name)
    p = src.partitions
    values = func0.fn(fp32_tile(src), scalar_or_vector(name, "imm0", imm0, p, "err_tensor_scalar_operand_shape",
                                                       True, "err_tensor_scalar_operand_dtype"))
    values = np.asarray(values, dtype=FLOAT32)
    lanes = accumulators.registers("vector")[src.start_partition:src.start_partition + p]
    if command == "reset_reduce":
        lanes[...] = 0.0 if func1.name == "subtract" else accumulators.FOLDS[func1.name][1]
    elif command == "load_reduce":
        lanes[...] = _initial(name, command, imm1, p, "imm1")
    result = _scan(func1.name, lanes.copy(), values)
    lanes[...] = result[:, -1]
    store(dst, result)
    record(name, "vector", dst, [("src", src), ("imm0", imm0)], {"op0": func0.name, "op1": func1.name},
           flops=2 * src.size)


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=None, reduce_init=0.0, name=None):
    """dst = exp(src - max_value) on VectorE (NeuronCore-v4+), optionally summed through VectorE's accumulator
    registers into reduce_res."""
    name = "exponential"
    require_version(name, "gen4")
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    check_elementwise(name, dst, [("src", src)], "vector")
    if dst.dtype.name not in EXPONENTIAL_DST_DTYPES:
        raise NkiValidationError(
            "err_exponential_dtype", f"dst {dst.name} is {dst.dtype.name}, not one of {sorted(EXPONENTIAL_DST_DTYPES)}",
            name,
        )
    if src.ndim > 5:
        raise NkiValidationError("err_pattern_rank", f"src {src.shape} has more than 4 free dims", name)
    p = src.partitions
    shift = scalar_or_vector(name, "max_value", max_value, p, "err_tensor_scalar_operand_shape", *_FP32_OPERAND)
    with np.errstate(over="ignore"):
        y = np.exp(fp32_tile(src) - shift).astype(FLOAT32)
    store(dst, y)
    command = accumulators.command_name(reduce_cmd)
    initial = _initial(name, command, reduce_init, p, "reduce_init")
    if command != "idle":
        accumulators.reduce_into(name, "vector", command, "add", accumulators.partial_reduce(y, "add"),
                                 src.start_partition, reduce_res, initial)
    elif reduce_res is not None:
        raise NkiValidationError("err_reduce_cmd", "reduce_res needs a reduce_cmd other than idle", name)
    srcs = [("src", src), ("max_value", max_value)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    record(name, "vector", dst, srcs, {"reduce_cmd": command}, flops=2 * src.size)
