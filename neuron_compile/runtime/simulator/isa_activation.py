"""Simulator stage: the Scalar engine's activation instructions of ``nki.isa`` (activation, activation_reduce,
activate2) and the valid input ranges of its function approximations.

Input: SBUF/PSUM tiles, an activation function (``nl.exp`` ...), scale / bias / immediates. Output: dst written
(fp32 math rounded to dst's dtype), ScalarE's accumulator registers driven by ``reduce_cmd`` (accumulators.py),
``reduce_res`` written when given, every documented rule checked, one InstructionRecord each.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator import accumulators
from neuron_compile.runtime.simulator import ops as _ops
from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.replay import refuse_replay, run_step
from neuron_compile.runtime.simulator.tensor import NkiTensor
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    check_elementwise,
    destination_view,
    fp32_rows,
    fp32_tile,
    operand_values,
    record,
    require_tensor,
    require_version,
    scalar_or_vector,
    source_view,
    store,
    store_into,
)

SIN_LIMIT = np.float32(np.pi)  # the fp32 nearest pi (slightly above it): the widest fp32 reading of [-pi, pi]
# Valid inputs of the Scalar engine's piecewise approximations (nki-spec §1.5): outside, the hardware gives invalid
# results where numpy would be right, so the simulator refuses. Per function: the range as the error states it,
# and which inputs are valid.
ACTIVATION_RANGES = {
    "sin": ("[-pi, pi]", lambda x: np.abs(x) <= SIN_LIMIT),  # no range reduction: sin(9.0) gives ~27.65
    "arctan": ("[-pi/2, pi/2]", lambda x: np.isnan(x) | (np.abs(x) <= np.float32(np.pi / 2))),
    "log": ("[2**-64, 2**64]", lambda x: np.isnan(x) | ((x >= 2.0**-64) & (x <= 2.0**64))),
    "sqrt": ("[2**-116, 2**118]", lambda x: np.isnan(x) | ((x >= 2.0**-116) & (x <= 2.0**118))),
    "rsqrt": ("[2**-87, 2**97]", lambda x: np.isnan(x) | ((x >= 2.0**-87) & (x <= 2.0**97))),
    "reciprocal": ("+-[2**-42, 2**42]", lambda x: np.isnan(x) | ((np.abs(x) >= 2.0**-42) & (np.abs(x) <= 2.0**42))),
}
# activation's reduction is an add; activate2's may also be a max / min (of values or magnitudes)
ACTIVATE2_REDUCE_OPS = ("add", "maximum", "minimum", "abs_max", "abs_min")
# activate2's tensor-scalar stage: the (op0, op1) pairs the hardware has (bypass skips a stage)
ACTIVATE2_OP_PAIRS = {("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"), ("add", "bypass"),
                      ("subtract", "bypass"), ("bypass", "bypass")}


def check_activation_range(op: str, function: str, x: np.ndarray) -> None:
    """Refuse inputs outside a function's valid range. nan passes (it propagates), except into sin, whose
    valid range is all that is known of it."""
    if function not in ACTIVATION_RANGES:
        return
    valid_range, valid = ACTIVATION_RANGES[function]
    with np.errstate(invalid="ignore"):
        outside = ~valid(x)
    if outside.any():
        raise NkiValidationError(
            "err_activation_input_out_of_range",
            f"{function} is valid on {valid_range} only; {int(outside.sum())} input(s) outside, e.g. "
            f"{x[outside].flat[0]!r}",
            op,
        )


def _activate(op: str, func, x: np.ndarray, relu_param=None) -> np.ndarray:
    """The activation function on fp32 inputs (prelu takes its slope from relu_param)."""
    check_activation_range(op, func.name, x)
    if func.name == "prelu":
        slope = np.float32(0) if relu_param is None else relu_param
        return np.where(x > 0, x, x * slope).astype(FLOAT32, copy=False)
    return func.fn(x).astype(FLOAT32, copy=False)


def activation_values(op: str, func, data, bias, scale):
    """op(data * scale + bias) as a function giving it (fp32, shape (P, free)) from the operands' values when it
    is called, the operands checked now and the function's valid input range at every call (it depends on the
    values). ``bias`` may be of any dtype (the API refuses only tfloat32, which this simulator stores as float32);
    ``scale`` must be float32."""
    p = data.partitions
    gen2 = current().target.nc_version == "gen2"
    if bias is not None and gen2 and not hasattr(bias, "shape"):
        raise NkiValidationError("err_activation_bias_invalid_type", "bias must be a (P, 1) tile on gen2", op)
    bias_values = None
    if bias is not None:
        bias_values = operand_values(op, "bias", bias, p, "err_activation_bias_invalid_type", require_fp32=False)
    scale_values = operand_values(op, "scale", scale, p, "err_activation_scale_scalar_or_vector")
    data_view = source_view(data)

    def values() -> np.ndarray:
        x, factor = fp32_rows(data_view, p), scale_values()
        if not (factor.ndim == 0 and factor == 1):
            x = x * factor
        if bias_values is not None:
            x = x + bias_values()
        return _activate(op, func, x)

    return values


def _reduce_res_tile(op: str, reduce_res, partitions: int):
    reduce_res = require_tensor(op, "reduce_res", reduce_res)
    if reduce_res.partitions != partitions or reduce_res.free_size != 1:
        raise NkiValidationError(
            "err_activation_reduce_res_shape", f"reduce_res {reduce_res.shape} must be ({partitions}, 1)", op
        )
    return reduce_res


def _reduce_on_scalar_engine(op: str, command: str, reduce_name: str, reduce_res, y: np.ndarray, data) -> None:
    """Fold y into ScalarE's registers by ``command`` and write them to reduce_res; with ``idle`` and a
    reduce_res, reduce this instruction's values alone (activation's one-shot form)."""
    p = y.shape[0]
    partial = accumulators.partial_reduce(y, reduce_name)
    if command == "idle":
        if reduce_res is not None:
            store(_reduce_res_tile(op, reduce_res, p), partial[:, None])
        return
    initial = None
    if command == "load_reduce":
        if reduce_res is None:
            raise NkiValidationError("err_activation_reduce_res_shape", "load_reduce needs reduce_res to load", op)
        initial = fp32_tile(_reduce_res_tile(op, reduce_res, p))[:, 0]
    lanes = accumulators.accumulate("scalar", command, reduce_name, partial, data.start_partition, initial)
    if reduce_res is not None:
        store(_reduce_res_tile(op, reduce_res, p), lanes[:, None])


def _activation_operands(name: str, dst, op, data, bias, scale):
    """The checks the activation instructions share: (dst, data, the resolved op, activation_values)."""
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    func = _ops.resolve(op, name)
    check_elementwise(name, dst, [("data", data)], "scalar")
    return dst, data, func, activation_values(name, func, data, bias, scale)


def _activation_step(values, dst_view: np.ndarray, sums_view: np.ndarray | None, reduce_name: str):
    """The step of an activation: its values into dst and, with a (P, 1) view for it, their per-partition
    reduction (one instruction's, through no accumulator register)."""

    def step():
        y = values()
        store_into(dst_view, y)
        if sums_view is not None:
            store_into(sums_view, accumulators.partial_reduce(y, reduce_name)[:, None])

    return step


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None, name=None):
    """dst = op(data * scale + bias) on ScalarE; optional add-reduction along the free dim into reduce_res."""
    name = "activation"
    dst, data, func, values = _activation_operands(name, dst, op, data, bias, scale)
    command = accumulators.command_name(reduce_cmd)
    reduce_name = accumulators.resolve_reduce_op(name, reduce_op, ("add",), "add", "err_activation_reduce_op")
    dst_view = destination_view(dst)
    if command == "idle":
        sums = None if reduce_res is None else destination_view(_reduce_res_tile(name, reduce_res, data.partitions))
        run_step(_activation_step(values, dst_view, sums, reduce_name))
    else:  # the registers carry values from one instruction to the next
        refuse_replay(f"activation with reduce_cmd {command} (the accumulator registers)")
        y = values()
        store_into(dst_view, y)
        _reduce_on_scalar_engine(name, command, reduce_name, reduce_res, y, data)
    srcs = [("data", data), ("bias", bias), ("scale", scale)]
    if reduce_res is not None:
        srcs.append(("reduce_res", reduce_res))
    reduces = reduce_res is not None or command != "idle"
    record(name, "scalar", dst, srcs, {"op": func.name, "reduce": reduces, "reduce_cmd": command}, flops=data.size)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """activation with a per-partition add-reduction of the result into reduce_res (P, 1)."""
    name = "activation_reduce"
    dst, data, func, values = _activation_operands(name, dst, op, data, bias, scale)
    reduce_name = accumulators.resolve_reduce_op(name, reduce_op, ("add",), "add", "err_activation_reduce_op")
    sums = destination_view(_reduce_res_tile(name, reduce_res, data.partitions))
    run_step(_activation_step(values, destination_view(dst), sums, reduce_name))
    record(name, "scalar", dst, [("data", data), ("bias", bias), ("scale", scale), ("reduce_res", reduce_res)],
           {"op": func.name, "reduce": True}, flops=data.size)


def _tensor_scalar_stage(name: str, x: np.ndarray, stage_ops, immediates, reverses) -> np.ndarray:
    """activate2's ``(data op0 imm0) op1 imm1``, a bypass op skipping its stage."""
    for func, value, reverse in zip(stage_ops, immediates, reverses):
        if func.name == "bypass":
            continue
        x = func.fn(value, x) if reverse else func.fn(x, value)
    return x


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None,
              reduce_res=None, reduce_cmd=None, name=None):
    """dst = op((data op0 imm0) op1 imm1) on ScalarE (NeuronCore-v4+), with an optional add / max / min /
    abs_max / abs_min reduction through ScalarE's accumulator registers."""
    name = "activate2"
    require_version(name, "gen4")
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    func = _ops.resolve(op, name)
    stage_ops = [_ops.resolve(o, name, role) for o, role in ((op0, "op0"), (op1, "op1"))]
    pair = tuple(f.name for f in stage_ops)
    if pair not in ACTIVATE2_OP_PAIRS:
        raise NkiValidationError(
            "err_activate2_op_pair", f"(op0, op1) = {pair} is not one of {sorted(ACTIVATE2_OP_PAIRS)}", name
        )
    for reverse, stage, role in ((reverse0, pair[0], "reverse0"), (reverse1, pair[1], "reverse1")):
        if reverse and stage == "bypass":
            raise NkiValidationError("err_activate2_reverse", f"{role} needs its op to be set, not bypass", name)
    check_elementwise(name, dst, [("data", data)], "scalar")
    p = data.partitions
    immediates = [scalar_or_vector(name, role, value, p, "err_activate2_immediate", require_fp32=False)
                  for role, value in (("imm0", imm0), ("imm1", imm1))]
    if isinstance(imm0, NkiTensor) and isinstance(imm1, NkiTensor) and imm0.dtype != imm1.dtype:
        raise NkiValidationError(
            "err_activate2_immediate", f"imm0 ({imm0.dtype.name}) and imm1 ({imm1.dtype.name}) tiles must share a "
            "dtype", name,
        )
    slope = scalar_or_vector(name, "relu_param", relu_param, p, "err_activate2_immediate", require_fp32=False)
    x = _tensor_scalar_stage(name, fp32_tile(data), stage_ops, immediates, (reverse0, reverse1))
    y = _activate(name, func, x.astype(FLOAT32, copy=False), slope)
    store(dst, y)
    command = accumulators.command_name(reduce_cmd)
    reduce_name = accumulators.resolve_reduce_op(name, reduce_op, ACTIVATE2_REDUCE_OPS, "add")
    if command == "load_reduce":
        raise NkiValidationError("err_reduce_cmd", "activate2 takes reset, reset_reduce, reduce or idle", name)
    _reduce_on_scalar_engine(name, command, reduce_name, reduce_res, y, data)
    srcs = [("data", data), ("imm0", imm0), ("imm1", imm1)] + ([("reduce_res", reduce_res)] if reduce_res is not None else [])
    record(name, "scalar", dst, srcs, {"op": func.name, "reduce": reduce_res is not None or command != "idle"},
           flops=2 * data.size)
