"""Simulator stage: ``nki.isa`` — one function per ISA instruction, dst first, returning nothing.

Input: NkiTensor operands (dst first) and instruction attributes. Output: dst (and reduce results) written
in place, every hardware rule of nki-spec.md §1.6 checked (NkiValidationError naming the rule, the values and
the instruction), and one InstructionRecord per instruction appended to the kernel trace. Engines compute in
fp32 and round to the destination dtype; matmul accumulates in PSUM with the first-write-overwrites rule.
"""

from __future__ import annotations

import numpy as np

from neuron_compile.runtime.simulator import isa_constants as constants
from neuron_compile.runtime.simulator import ops as _ops
from neuron_compile.runtime.simulator.errors import NkiNotSimulatedError, NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.tensor import NkiTensor
from neuron_compile.runtime.simulator.isa_constants import (
    dge_mode,
    dma_engine,
    engine,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
    scalar_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)
from neuron_compile.runtime.simulator.isa_activation import (
    ACTIVATION_RANGES,
    activate2,
    activation,
    activation_reduce,
)
from neuron_compile.runtime.simulator.isa_accumulate import exponential, tensor_scalar_cumulative, tensor_scalar_reduce
from neuron_compile.runtime.simulator.isa_dma import dma_compute, dma_copy, dma_transpose
from neuron_compile.runtime.simulator.isa_lnc import core_barrier, sendrecv
from neuron_compile.runtime.simulator.isa_gather import local_gather, nc_n_gather, nonzero_with_count, sequence_bounds
from neuron_compile.runtime.simulator.isa_registers import (
    VirtualRegister,
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from neuron_compile.runtime.simulator.isa_random import (
    dropout,
    rand2,
    rand_get_state,
    rand_set_state,
    rng,
    set_rng_seed,
)
from neuron_compile.runtime.simulator.isa_stats import (
    bn_aggr,
    bn_stats,
    max8,
    nc_find_index8,
    nc_match_replace8,
    tensor_partition_reduce,
    tensor_tensor_scan,
)
from neuron_compile.runtime.simulator.isa_select import range_select, select_reduce
from neuron_compile.runtime.simulator.isa_shuffle import nc_stream_shuffle
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    cast_to,
    check_elementwise,
    check_no_psum_on_gpsimd,
    check_same_free,
    check_same_partitions,
    check_tile,
    engine_name,
    fp32_tile,
    int_values,
    is_float,
    record,
    reduce_axes,
    require_buffers,
    require_tensor,
    scalar_or_vector,
    store,
)

__all__ = [
    "NkiValidationError", "engine", "reduce_cmd", "dge_mode", "oob_mode", "nc_version", "matmul_perf_mode",
    "get_nc_version", "nc_matmul", "nc_transpose", "activation", "activation_reduce", "tensor_tensor",
    "tensor_scalar", "scalar_tensor_tensor", "tensor_reduce", "tensor_copy", "tensor_copy_predicated", "memset", "iota",
    "affine_select", "dma_copy", "dma_transpose", "bn_stats", "bn_aggr", "tensor_tensor_scan", "reciprocal",
    "tensor_partition_reduce", "max8", "nc_find_index8", "set_rng_seed", "rand_set_state", "rand_get_state", "rng",
    "rand2", "dropout", "activate2", "dma_engine", "constants", "tensor_engine", "vector_engine", "scalar_engine",
    "gpsimd_engine", "unknown_engine", "VirtualRegister", "register_alloc", "register_move", "register_load",
    "register_store", "get_nc_sub_version", "tensor_scalar_reduce", "tensor_scalar_cumulative", "exponential",
    "select_reduce", "range_select", "local_gather", "nc_n_gather", "sequence_bounds", "nonzero_with_count",
    "nc_match_replace8", "nc_stream_shuffle", "core_barrier", "sendrecv", "dma_compute",
]


def get_nc_version() -> nc_version:
    return nc_version[current().target.nc_version]


def get_nc_sub_version() -> int:
    """The silicon revision within the NeuronCore generation: 0 (the first) for every simulated target."""
    return 0


MATMUL_INPUT_DTYPES = {"float8_e4m3", "float8_e5m2", "float8_e4m3fn", "bfloat16", "float16", "float32"}


def _check_tiling(op: str, stationary, tile_position, tile_size) -> None:
    """PE-array tiling: (row, col) sizes of 128 / 64 (/ 32 on gen3+), positions multiples of the size."""
    if not tile_position and not tile_size:
        return
    if not tile_position or not tile_size or len(tile_position) != 2 or len(tile_size) != 2:
        raise NkiValidationError(
            "err_matmul_tile_position",
            f"tile_position {tile_position} and tile_size {tile_size} must both be (row, col) pairs", op,
        )
    legal = (128, 64, 32) if current().target.nc_version != "gen2" else (128, 64)
    for what, position, size, used in (("row", tile_position[0], tile_size[0], stationary.partitions),
                                       ("col", tile_position[1], tile_size[1], stationary.free_size)):
        if size not in legal or position % size or position + size > 128 or used > size:
            raise NkiValidationError(
                "err_matmul_tile_position",
                f"{what} tile size {size} (legal {legal}) at position {position} for {used} stationary "
                f"{'partitions' if what == 'row' else 'columns'}: the position must be a multiple of the size, "
                "the tile must lie in the 128x128 array and hold the operand", op,
            )


def _check_psum_bank(op: str, role: str, t) -> None:
    """A matmul output must lie within one 2 KiB PSUM bank per partition."""
    bank = current().target.psum_bank_bytes
    if t.free_size * t.itemsize > bank:
        raise NkiValidationError(
            "err_psum_tile_exceeds_bank",
            f"{role} {t.name} {t.shape} {t.dtype.name} needs {t.free_size * t.itemsize} bytes per partition; a "
            f"PSUM tile written by the tensor engine must fit one bank ({bank} bytes)",
            op,
        )
    in_partition = t.offset % t.partition_stride
    last = in_partition + sum((n - 1) * s for n, s in zip(t.shape[1:], t.strides[1:]) if s > 0)
    if (in_partition * t.itemsize) // bank != (last * t.itemsize) // bank:
        raise NkiValidationError(
            "err_psum_tile_exceeds_bank",
            f"{role} {t.name} spans PSUM bytes [{in_partition * t.itemsize}, {last * t.itemsize}] of each partition, "
            f"crossing a {bank}-byte bank boundary",
            op,
        )


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, mask=None, name=None):
    """dst[M, N] (PSUM) = stationary[K, M].T @ moving[K, N]; first write overwrites, later writes accumulate."""
    op = "nc_matmul"
    target = current().target
    dst, stationary, moving = (require_tensor(op, r, t) for r, t in
                               (("dst", dst), ("stationary", stationary), ("moving", moving)))
    require_buffers(op, "dst", dst, ("psum",), "err_matmul_dst_not_psum")
    require_buffers(op, "stationary", stationary, ("sbuf",), "err_matmul_input_not_sbuf")
    require_buffers(op, "moving", moving, ("sbuf",), "err_matmul_input_not_sbuf")
    for role, t in (("dst", dst), ("stationary", stationary), ("moving", moving)):
        check_tile(op, role, t)
    check_same_partitions(op, stationary, moving, "stationary", "moving")
    k, m, n = stationary.partitions, stationary.free_size, moving.free_size
    if m > target.gemm_stationary_fmax:
        raise NkiValidationError(
            "err_matmul_stationary_fmax",
            f"stationary free size {m} exceeds gemm_stationary_fmax {target.gemm_stationary_fmax}", op,
        )
    if n > target.gemm_moving_fmax:
        raise NkiValidationError(
            "err_matmul_moving_fmax", f"moving free size {n} exceeds gemm_moving_fmax {target.gemm_moving_fmax}", op
        )
    for role, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype.name not in MATMUL_INPUT_DTYPES:
            raise NkiValidationError(
                "err_matmul_input_dtype", f"{role} dtype {t.dtype.name} not in {sorted(MATMUL_INPUT_DTYPES)}", op
            )
    if (stationary.dtype == FLOAT32) != (moving.dtype == FLOAT32):
        raise NkiValidationError(
            "err_matmul_fp32_mixed",
            f"if one matmul input is float32 both must be: stationary {stationary.dtype.name}, moving "
            f"{moving.dtype.name}", op,
        )
    allowed_dst = {"float32"} | ({"bfloat16"} if target.nc_version == "gen4" else set())
    if is_transpose:
        allowed_dst |= {stationary.dtype.name}
    if dst.dtype.name not in allowed_dst:
        raise NkiValidationError(
            "err_matmul_dst_dtype", f"dst dtype {dst.dtype.name} not allowed on {target.name}: {sorted(allowed_dst)}",
            op,
        )
    if dst.partitions != m or dst.free_size != n:
        raise NkiValidationError(
            "err_matmul_shape",
            f"dst {dst.shape} must have {m} partitions (stationary free size) and {n} elements per partition "
            f"(moving free size); stationary {stationary.shape}, moving {moving.shape}", op,
        )
    _check_psum_bank(op, "dst", dst)
    _check_tiling(op, stationary, tile_position, tile_size)
    product = fp32_tile(stationary).T @ fp32_tile(moving)
    flags = dst.matmul_flags()
    consumed = dst.psum_flags(dst.storage.matmul_read)
    if accumulate is None:
        # an accumulation group whose result another instruction has read is over: the next matmul into those
        # elements starts a new group (a PSUM tile reused across output tiles, as production kernels reuse their
        # address-placed PSUM banks), so it overwrites them
        flags[consumed] = False
    if accumulate is True and not flags.all():
        raise NkiValidationError(
            "err_matmul_accumulate_uninitialized",
            f"accumulate=True into {int(flags.size - flags.sum())} of {flags.size} elements of dst {dst.name} that no "
            "matmul wrote first (undefined on hardware; use accumulate=None or False for the first K tile)", op,
        )
    if accumulate is False:
        result = product
    elif accumulate is True or flags.all():
        result = _psum_values(dst, m, n) + product
    elif not flags.any():
        result = product
    else:
        result = np.where(flags.reshape(m, n), _psum_values(dst, m, n) + product, product)
    dst.write(cast_to(result, dst.dtype).reshape(dst.shape))
    flags[...] = True
    consumed[...] = False
    record(op, "tensor", dst, [("stationary", stationary), ("moving", moving)],
           {"accumulate": accumulate, "is_transpose": is_transpose,
            "perf_mode": getattr(perf_mode, "name", perf_mode)}, flops=2 * k * m * n)


def _psum_values(dst, m: int, n: int) -> np.ndarray:
    return dst.peek().astype(FLOAT32).reshape(m, n)


def nc_transpose(dst, data, engine=None, name=None):
    """dst[F, P] = data[P, F]: TensorE (SBUF -> PSUM, <= 128x128) or VectorE (<= 32x32)."""
    op = "nc_transpose"
    target = current().target
    dst, data = require_tensor(op, "dst", dst), require_tensor(op, "data", data)
    default = "tensor" if data.kind == "sbuf" and dst.kind == "psum" else "vector"
    eng = engine_name(engine, default)
    check_tile(op, "dst", dst)
    check_tile(op, "data", data)
    p, f = data.partitions, data.free_size
    if eng == "tensor":
        require_buffers(op, "data", data, ("sbuf",), "err_tensor_engine_reads_sbuf")
        require_buffers(op, "dst", dst, ("psum",), "err_matmul_dst_not_psum")
        limit = target.partitions
    else:
        limit = target.vector_transpose_max
    if p > limit or f > limit:
        raise NkiValidationError(
            "err_size_of_dimension_exceed_arch_limit",
            f"{eng} engine transpose of data {data.shape} ({p} x {f}) exceeds {limit} x {limit}", op,
        )
    if dst.partitions != f or dst.free_size != p:
        raise NkiValidationError("err_transpose_shape", f"dst {dst.shape} must be ({f}, {p}) for data {data.shape}", op)
    if dst.dtype != data.dtype:
        raise NkiValidationError(
            "err_transpose_dtype", f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name}", op
        )
    if eng == "tensor":
        _check_psum_bank(op, "dst", dst)
    store(dst, data.read().reshape(p, f).T)
    record(op, eng, dst, [("data", data)])


def tensor_tensor(dst, data1, data2, op, engine=None, name=None):
    """dst = op(data1, data2) elementwise (same partitions, same elements per partition)."""
    name = "tensor_tensor"
    dst, data1, data2 = (require_tensor(name, r, t) for r, t in (("dst", dst), ("data1", data1), ("data2", data2)))
    func = _ops.resolve(op, name)
    if func.kind not in ("arith", "bitvec"):
        raise NkiValidationError("err_unsupported_op", f"op {func.name} is not a binary ALU operator", name)
    ints = not is_float(data1.dtype) and not is_float(data2.dtype)
    default = "gpsimd" if func.name == "power" or (ints and data1.dtype.itemsize == 4) else "vector"
    eng = engine_name(engine, default)
    check_elementwise(name, dst, [("data1", data1), ("data2", data2)], eng)
    if data1.kind == "psum" and data2.kind == "psum":
        raise NkiValidationError(
            "err_tensor_tensor_both_psum", f"data1 {data1.name} and data2 {data2.name} cannot both be in PSUM", name
        )
    if func.kind == "bitvec":
        if not ints or is_float(dst.dtype):
            raise NkiValidationError(
                "err_bitvec_op_dtype", f"bitvec op {func.name} needs integer tensors: data1 {data1.dtype.name}, data2 "
                f"{data2.dtype.name}, dst {dst.dtype.name}", name,
            )
        result = func.fn(int_values(data1), int_values(data2))
    elif ints and not is_float(dst.dtype):
        result = func.fn(int_values(data1).astype(np.int64), int_values(data2).astype(np.int64))
    else:
        result = func.fn(fp32_tile(data1), fp32_tile(data2))
    store(dst, result)
    record(name, eng, dst, [("data1", data1), ("data2", data2)], {"op": func.name}, flops=dst.size)


# (shape rule, require fp32, dtype rule) of a tensor_scalar-style operand
_OPERAND_RULES = ("err_tensor_scalar_operand_shape", True, "err_tensor_scalar_operand_dtype")
_SCALAR_ENGINE_PAIRS = {("multiply", "add"), ("multiply", None), ("add", None)}


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, engine=None,
                  name=None):
    """dst = (data op0 operand0) op1 operand1; operands are scalars or (P, 1) fp32 tiles."""
    name = "tensor_scalar"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    func0 = _ops.resolve(op0, name, "op0")
    func1 = _ops.resolve(op1, name, "op1") if op1 is not None else None
    if func1 is not None and func1.kind == "bypass":
        func1 = None
    eng = engine_name(engine, "vector")
    check_elementwise(name, dst, [("data", data)], eng)
    if func1 is not None and (func0.kind == "bitvec") != (func1.kind == "bitvec"):
        raise NkiValidationError(
            "err_tensor_scalar_op_kind", f"op0 {func0.name} and op1 {func1.name} must both be bitvec or arithmetic",
            name,
        )
    if eng == "scalar" and current().target.nc_version == "gen3":
        pair = (func0.name, func1.name if func1 else None)
        if pair not in _SCALAR_ENGINE_PAIRS:
            raise NkiValidationError(
                "err_tensor_scalar_scalar_engine_ops",
                f"op0/op1 {pair} on the Scalar engine of trn2: only {sorted(_SCALAR_ENGINE_PAIRS, key=str)}", name,
            )
    bitvec = func0.kind == "bitvec"
    p = data.partitions
    if bitvec:
        if is_float(data.dtype):
            raise NkiValidationError("err_bitvec_op_dtype", f"bitvec op {func0.name} on {data.dtype.name} data", name)
        x = int_values(data)
        operands = [_int_operand(name, r, v, p) for r, v in (("operand0", operand0), ("operand1", operand1))]
    else:
        x = fp32_tile(data)
        operands = [
            scalar_or_vector(name, "operand0", operand0, p, *_OPERAND_RULES),
            scalar_or_vector(name, "operand1", operand1, p, *_OPERAND_RULES) if func1 else None,
        ]
    x = _tensor_scalar_stage(func0, x, operands[0], reverse0)
    if func1 is not None:
        x = _tensor_scalar_stage(func1, x, operands[1], reverse1)
    store(dst, x)
    record(name, eng, dst, [("data", data), ("operand0", operand0), ("operand1", operand1)],
           {"op0": func0.name, "op1": func1.name if func1 else None, "op": func0.name}, flops=dst.size)


# The ALU's unary arithmetic operators (nki-spec §1.5), computed in fp32 over every input: a tensor_scalar stage
# applies them to the data and does not read its operand (the SDK's form is ``op0=nl.rsqrt, operand0=0.0``).
ALU_UNARY = {"rsqrt", "reciprocal", "abs"}


def _tensor_scalar_stage(func, x, operand, reverse: bool):
    if func.kind == "unary":
        if func.name not in ALU_UNARY:
            raise NkiValidationError(
                "err_unsupported_op", f"{func.name} is an activation function, not an ALU operator: tensor_scalar "
                f"takes the unary ALU operators {sorted(ALU_UNARY)} only", "tensor_scalar")
        return func.fn(x)
    return func.fn(operand, x) if reverse else func.fn(x, operand)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, engine=None,
                         name=None):
    """dst = (data op0 operand0) op1 operand1: operand0 a scalar or (P, 1) fp32 tile, operand1 a tile like data."""
    name = "scalar_tensor_tensor"
    dst, data, other = (require_tensor(name, r, t) for r, t in (("dst", dst), ("data", data), ("operand1", operand1)))
    func0, func1 = _ops.resolve(op0, name, "op0"), _ops.resolve(op1, name, "op1")
    eng = engine_name(engine, "vector")
    check_elementwise(name, dst, [("data", data), ("operand1", other)], eng)
    if data.kind == "psum" and other.kind == "psum":
        raise NkiValidationError("err_tensor_tensor_both_psum", "data and operand1 cannot both be in PSUM", name)
    if "bitvec" in (func0.kind, func1.kind):
        raise NkiValidationError("err_unsupported_op", f"bitvec ops {func0.name}/{func1.name} are not simulated here",
                                 name)
    scalar = scalar_or_vector(name, "operand0", operand0, data.partitions, *_OPERAND_RULES)
    x = fp32_tile(data)
    x = func0.fn(scalar, x) if reverse0 else func0.fn(x, scalar)
    y = fp32_tile(other)
    store(dst, func1.fn(y, x) if reverse1 else func1.fn(x, y))
    record(name, eng, dst, [("data", data), ("operand0", operand0), ("operand1", other)],
           {"op0": func0.name, "op1": func1.name}, flops=2 * dst.size)


def _int_operand(name: str, role: str, value, partitions: int):
    if value is None:
        return None
    if hasattr(value, "shape"):
        return int_values(value)
    if isinstance(value, float) and not float(value).is_integer():
        raise NkiValidationError(
            "err_tensor_scalar_operand_dtype", f"bitvec {role} must be an integer, got {value}", name
        )
    return np.int32(value)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    """dst = reduce(op) of data over the last free axes (VectorE, fp32)."""
    name = "tensor_reduce"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    func = _ops.resolve(op, name)
    if func.reduce_ufunc is None:
        raise NkiValidationError("err_unsupported_reduce_op", f"{func.name} is not a legal reduction op", name)
    require_buffers(name, "data", data, ("sbuf", "psum"))
    require_buffers(name, "dst", dst, ("sbuf", "psum"))
    check_tile(name, "data", data)
    check_tile(name, "dst", dst)
    check_same_partitions(name, data, dst, "data", "dst")
    axes = reduce_axes(name, data, axis)
    kept = int(np.prod(data.shape[1:data.ndim - len(axes)], dtype=np.int64))
    if dst.free_size != kept:
        raise NkiValidationError(
            "err_reduce_dst_shape",
            f"dst {dst.shape} must hold {kept} elements per partition after reducing axes {axes} of {data.shape}", name,
        )
    values = data.read()
    ints = func.kind == "bitvec"
    values = values if ints else values.astype(FLOAT32, copy=False)
    result = func.reduce_ufunc.reduce(values, axis=axes)
    if func.name.startswith("logical"):
        result = result.astype(FLOAT32)
    if negate:
        result = -result
    store(dst, result)
    record(name, "vector", dst, [("data", data)], {"op": func.name, "negate": negate}, flops=data.size)


def tensor_copy(dst, src, engine=None, name=None):
    """dst = src (same partitions, same elements per partition); bit exact if dtypes match, else via fp32."""
    name = "tensor_copy"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    eng = engine_name(engine, "vector")
    check_elementwise(name, dst, [("src", src)], eng)
    values = src.read() if src.dtype == dst.dtype or not is_float(src.dtype) else fp32_tile(src)
    store(dst, values.reshape(dst.shape) if values.size == dst.size else values)
    record(name, eng, dst, [("src", src)])


PREDICATE_DTYPES = ("uint8", "uint16", "uint32")


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """dst = src where predicate != 0 (== 0 with ``reverse_pred``), dst unchanged elsewhere; VectorE. ``src`` is
    a tile of dst's dtype or a scalar; the predicate a uint8/16/32 tile; src and predicate not both in PSUM."""
    name = "tensor_copy_predicated"
    dst, predicate = require_tensor(name, "dst", dst), require_tensor(name, "predicate", predicate)
    operands = [("predicate", predicate)]
    if isinstance(src, NkiTensor):
        operands.append(("src", src))
        if src.dtype != dst.dtype:
            raise NkiValidationError(
                "err_predicated_copy_dtype", f"src {src.name} is {src.dtype.name}, dst {dst.name} {dst.dtype.name}: "
                "they must share a dtype", name)
        if src.buffer.kind == predicate.buffer.kind == "psum":
            raise NkiValidationError(
                "err_predicated_copy_psum", f"src {src.name} and predicate {predicate.name} are both in PSUM", name)
    if predicate.dtype.name not in PREDICATE_DTYPES:
        raise NkiValidationError(
            "err_predicate_dtype", f"predicate {predicate.name} is {predicate.dtype.name}, not one of "
            f"{list(PREDICATE_DTYPES)}", name)
    check_elementwise(name, dst, operands, "vector")
    chosen = predicate.read().reshape(dst.shape) != 0
    if reverse_pred:
        chosen = ~chosen
    values = src.read().reshape(dst.shape) if isinstance(src, NkiTensor) else np.asarray(src, dtype=dst.dtype)
    store(dst, np.where(chosen, values, dst.read().reshape(dst.shape)))
    record(name, "vector", dst, [*operands, ("dst", dst)], {"reverse_pred": bool(reverse_pred)})


def memset(dst, value, engine=None, name=None):
    """dst[...] = value; the value must match dst's dtype (an int for integer tensors)."""
    name = "memset"
    dst = require_tensor(name, "dst", dst)
    eng = engine_name(engine, "vector")
    require_buffers(name, "dst", dst, ("sbuf", "psum"))
    check_tile(name, "dst", dst)
    check_no_psum_on_gpsimd(name, eng, ("dst", dst))
    if not is_float(dst.dtype) and isinstance(value, (float, np.floating)) and not isinstance(value, bool):
        raise NkiValidationError(
            "err_memset_value_dtype", f"value {value!r} is a float but dst {dst.name} is {dst.dtype.name}", name
        )
    fill = np.asarray(value, dtype=FLOAT32 if is_float(dst.dtype) else np.int64)
    store(dst, np.broadcast_to(fill, dst.shape))
    record(name, eng, dst, [], {"value": value})


def _affine_values(name: str, dst, pattern, offset, channel_multiplier) -> np.ndarray:
    pattern = [(int(s), int(n)) for s, n in pattern]
    if len(pattern) > 4:
        raise NkiValidationError("err_pattern_rank", f"pattern {pattern} has more than 4 free dims", name)
    count = int(np.prod([n for _, n in pattern], dtype=np.int64))
    if count != dst.free_size:
        raise NkiValidationError(
            "err_pattern_size",
            f"pattern {pattern} has {count} elements, dst {dst.shape} has {dst.free_size} per partition", name,
        )
    values = np.full((dst.partitions,) + tuple(n for _, n in pattern), int(offset), dtype=np.int64)
    values += (np.arange(dst.partitions, dtype=np.int64) * int(channel_multiplier)).reshape((-1,) + (1,) * len(pattern))
    for dim, (step, size) in enumerate(pattern):
        shape = [1] * (len(pattern) + 1)
        shape[dim + 1] = size
        values += (np.arange(size, dtype=np.int64) * step).reshape(shape)
    return values.reshape(dst.partitions, -1)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[c, ...] = offset + c * channel_multiplier + sum(step_i * index_i), computed in int32 (GpSimd)."""
    name = "iota"
    dst = require_tensor(name, "dst", dst)
    require_buffers(name, "dst", dst, ("sbuf",))
    check_tile(name, "dst", dst)
    store(dst, _affine_values(name, dst, pattern, offset, channel_multiplier).astype(np.int32))
    record(name, "gpsimd", dst, [], {"pattern": pattern})


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None, offset=0, name=None):
    """dst = where(cmp_op(affine_value, 0), on_true_tile, on_false_value) (GpSimd, SBUF)."""
    name = "affine_select"
    dst, on_true = require_tensor(name, "dst", dst), require_tensor(name, "on_true_tile", on_true_tile)
    cmp = _ops.resolve(cmp_op if cmp_op is not None else "equal", name, "cmp_op")
    for role, t in (("dst", dst), ("on_true_tile", on_true)):
        require_buffers(name, role, t, ("sbuf",))
        check_tile(name, role, t)
    check_same_partitions(name, on_true, dst, "on_true_tile", "dst")
    check_same_free(name, on_true, dst, "on_true_tile", "dst")
    if not isinstance(on_false_value, (int, float, np.integer, np.floating)):
        raise NkiValidationError(
            "err_affine_select_false_value", f"on_false_value must be a scalar, got {on_false_value!r}", name
        )
    affine = _affine_values(name, dst, pattern, offset, channel_multiplier).astype(FLOAT32)
    predicate = cmp.fn(affine, np.float32(0)).astype(bool)
    store(dst, np.where(predicate, fp32_tile(on_true), np.float32(on_false_value)))
    record(name, "gpsimd", dst, [("on_true_tile", on_true)], {"op": cmp.name})


def reciprocal(dst, data, engine=None, name=None):
    """dst = 1 / data (fp32)."""
    name = "reciprocal"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    eng = engine_name(engine, "vector")
    check_elementwise(name, dst, [("data", data)], eng)
    with np.errstate(divide="ignore"):
        store(dst, np.float32(1) / fp32_tile(data))
    record(name, eng, dst, [("data", data)], flops=data.size)


_NOT_SIMULATED = {"nc_matmul_mx", "quantize_mx", "topk"}


def __getattr__(name: str):
    if name in _NOT_SIMULATED:
        def not_simulated(*args, **kwargs):
            raise NkiNotSimulatedError(f"nki.isa.{name}")

        not_simulated.__name__ = name
        return not_simulated
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")
