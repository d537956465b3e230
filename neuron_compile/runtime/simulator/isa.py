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
from neuron_compile.runtime.simulator.replay import run_step
from neuron_compile.runtime.simulator.rules import (
    FLOAT32,
    cast_to,
    check_elementwise,
    check_no_psum_on_gpsimd,
    check_same_free,
    check_same_partitions,
    check_tile,
    destination_view,
    engine_name,
    fp32_rows,
    is_float,
    operand_values,
    record,
    reduce_axes,
    require_buffers,
    require_tensor,
    source_view,
    store_into,
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
    accumulated = _accumulated_elements(op, dst, accumulate, m, n)
    stationary_view, moving_view, dst_view = source_view(stationary), source_view(moving), dst.array_view()
    dst.storage.written = True

    def step():
        product = fp32_rows(stationary_view, k).T @ fp32_rows(moving_view, k)
        if accumulated is False:
            result = product
        elif accumulated is True:
            result = dst_view.astype(FLOAT32).reshape(m, n) + product
        else:
            result = np.where(accumulated, dst_view.astype(FLOAT32).reshape(m, n) + product, product)
        dst_view[...] = cast_to(result, dst_view.dtype).reshape(dst_view.shape)

    run_step(step)
    record(op, "tensor", dst, [("stationary", stationary), ("moving", moving)],
           {"accumulate": accumulate, "is_transpose": is_transpose,
            "perf_mode": getattr(perf_mode, "name", perf_mode)}, flops=2 * k * m * n)


def _accumulated_elements(op: str, dst, accumulate, m: int, n: int):
    """Which elements of a matmul's dst accumulate (True: all, False: none, else an (m, n) mask) under the
    first-write-overwrites rule, from the PSUM flags; the flags then say the matmul wrote them all."""
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
        accumulated = False
    elif accumulate is True or flags.all():
        accumulated = True
    elif not flags.any():
        accumulated = False
    else:
        accumulated = flags.reshape(m, n).copy()
    flags[...] = True
    consumed[...] = False
    return accumulated


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
    data_view, dst_view = source_view(data), destination_view(dst)
    run_step(lambda: store_into(dst_view, data_view.reshape(p, f).T))
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
    p = data1.partitions
    if func.kind == "bitvec":
        if not ints or is_float(dst.dtype):
            raise NkiValidationError(
                "err_bitvec_op_dtype", f"bitvec op {func.name} needs integer tensors: data1 {data1.dtype.name}, data2 "
                f"{data2.dtype.name}, dst {dst.dtype.name}", name,
            )
        form = "bits"
    else:
        form = "int64" if ints and not is_float(dst.dtype) else "fp32"
    first, second, dst_view = source_view(data1), source_view(data2), destination_view(dst)
    run_step(lambda: store_into(dst_view, func.fn(_alu_rows(first, p, form), _alu_rows(second, p, form))))
    record(name, eng, dst, [("data1", data1), ("data2", data2)], {"op": func.name}, flops=dst.size)


def _alu_rows(view: np.ndarray, partitions: int, form: str) -> np.ndarray:
    """An ALU operand's (P, free) values: its integers as they are ("bits", for bitvec ops), as int64 (exact
    integer arithmetic into an integer dst) or as fp32 (the engines' float arithmetic)."""
    if form == "fp32":
        return fp32_rows(view, partitions)
    rows = view.reshape(partitions, -1)
    return rows.astype(np.int64) if form == "int64" else rows


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
    p = data.partitions
    bitvec = func0.kind == "bitvec"
    if bitvec:
        if is_float(data.dtype):
            raise NkiValidationError("err_bitvec_op_dtype", f"bitvec op {func0.name} on {data.dtype.name} data", name)
        operands = [_int_operand(name, r, v, p) for r, v in (("operand0", operand0), ("operand1", operand1))]
    else:
        operands = [
            operand_values(name, "operand0", operand0, p, *_OPERAND_RULES),
            operand_values(name, "operand1", operand1, p, *_OPERAND_RULES) if func1 else None,
        ]
    for func in (func0, func1):
        if func is not None and func.kind == "unary" and func.name not in ALU_UNARY:
            raise NkiValidationError(
                "err_unsupported_op", f"{func.name} is an activation function, not an ALU operator: tensor_scalar "
                f"takes the unary ALU operators {sorted(ALU_UNARY)} only", name)
    data_view, dst_view = source_view(data), destination_view(dst)

    def step():
        x = data_view.reshape(p, -1) if bitvec else fp32_rows(data_view, p)
        x = _tensor_scalar_stage(func0, x, operands[0], reverse0)
        if func1 is not None:
            x = _tensor_scalar_stage(func1, x, operands[1], reverse1)
        store_into(dst_view, x)

    run_step(step)
    record(name, eng, dst, [("data", data), ("operand0", operand0), ("operand1", operand1)],
           {"op0": func0.name, "op1": func1.name if func1 else None, "op": func0.name}, flops=dst.size)


# The ALU's unary arithmetic operators (nki-spec §1.5), computed in fp32 over every input: a tensor_scalar stage
# applies them to the data and does not read its operand (the SDK's form is ``op0=nl.rsqrt, operand0=0.0``).
ALU_UNARY = {"rsqrt", "reciprocal", "abs"}


def _tensor_scalar_stage(func, x, operand, reverse: bool):
    """One stage of a tensor_scalar: a unary ALU operator of the data (its operand unread), or a binary one with
    the operand (a callable giving the scalar or (P, 1) values: read when the step runs, as replays do)."""
    if func.kind == "unary":
        return func.fn(x)
    return func.fn(operand(), x) if reverse else func.fn(x, operand())


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
    p = data.partitions
    scalar = operand_values(name, "operand0", operand0, p, *_OPERAND_RULES)
    data_view, other_view, dst_view = source_view(data), source_view(other), destination_view(dst)

    def step():
        x, constant = fp32_rows(data_view, p), scalar()
        x = func0.fn(constant, x) if reverse0 else func0.fn(x, constant)
        y = fp32_rows(other_view, p)
        store_into(dst_view, func1.fn(y, x) if reverse1 else func1.fn(x, y))

    run_step(step)
    record(name, eng, dst, [("data", data), ("operand0", operand0), ("operand1", other)],
           {"op0": func0.name, "op1": func1.name}, flops=2 * dst.size)


def _int_operand(name: str, role: str, value, partitions: int):
    """A bitvec operand as a function giving its values (a tile's integer rows, or an int32 constant)."""
    if value is None:
        return lambda: None
    if hasattr(value, "shape"):
        view, rows = source_view(value), value.partitions  # the step keeps the view, never the tensor
        return lambda: view.reshape(rows, -1)
    if isinstance(value, float) and not float(value).is_integer():
        raise NkiValidationError(
            "err_tensor_scalar_operand_dtype", f"bitvec {role} must be an integer, got {value}", name
        )
    constant = np.int32(value)
    return lambda: constant


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
    ints = func.kind == "bitvec"
    data_view, dst_view = source_view(data), destination_view(dst)

    def step():
        values = data_view if ints else data_view.astype(FLOAT32, copy=False)
        result = func.reduce_ufunc.reduce(values, axis=axes)
        if func.name.startswith("logical"):
            result = result.astype(FLOAT32)
        store_into(dst_view, -result if negate else result)

    run_step(step)
    record(name, "vector", dst, [("data", data)], {"op": func.name, "negate": negate}, flops=data.size)


def tensor_copy(dst, src, engine=None, name=None):
    """dst = src (same partitions, same elements per partition); bit exact if dtypes match, else via fp32."""
    name = "tensor_copy"
    dst, src = require_tensor(name, "dst", dst), require_tensor(name, "src", src)
    eng = engine_name(engine, "vector")
    check_elementwise(name, dst, [("src", src)], eng)
    exact = src.dtype == dst.dtype or not is_float(src.dtype)
    src_view, dst_view, p = source_view(src), destination_view(dst), src.partitions

    def step():
        values = src_view if exact else fp32_rows(src_view, p)
        store_into(dst_view, values.reshape(dst_view.shape) if values.size == dst_view.size else values)

    run_step(step)
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
    predicate_view, shape = source_view(predicate), dst.shape
    src_view = source_view(src) if isinstance(src, NkiTensor) else None
    constant = None if src_view is not None else np.asarray(src, dtype=dst.dtype)
    kept_view, dst_view = source_view(dst), destination_view(dst)

    def step():
        chosen = predicate_view.reshape(shape) != 0
        if reverse_pred:
            chosen = ~chosen
        values = src_view.reshape(shape) if src_view is not None else constant
        store_into(dst_view, np.where(chosen, values, kept_view.reshape(shape)))

    run_step(step)
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
    fill = cast_to(np.asarray(value, dtype=FLOAT32 if is_float(dst.dtype) else np.int64), dst.dtype)
    dst_view = destination_view(dst)
    run_step(lambda: dst_view.__setitem__(Ellipsis, fill))  # the rounded value, cast once (element by element)
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
    values = _affine_values(name, dst, pattern, offset, channel_multiplier).astype(np.int32)
    values = cast_to(values, dst.dtype).reshape(dst.shape)  # a function of the pattern alone: made once
    dst_view = destination_view(dst)
    run_step(lambda: dst_view.__setitem__(Ellipsis, values))
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
    predicate = cmp.fn(affine, np.float32(0)).astype(bool)  # a function of the pattern alone: made once
    on_true_view, dst_view, p = source_view(on_true), destination_view(dst), on_true.partitions
    on_false = np.float32(on_false_value)
    run_step(lambda: store_into(dst_view, np.where(predicate, fp32_rows(on_true_view, p), on_false)))
    record(name, "gpsimd", dst, [("on_true_tile", on_true)], {"op": cmp.name})


def reciprocal(dst, data, engine=None, name=None):
    """dst = 1 / data (fp32)."""
    name = "reciprocal"
    dst, data = require_tensor(name, "dst", dst), require_tensor(name, "data", data)
    eng = engine_name(engine, "vector")
    check_elementwise(name, dst, [("data", data)], eng)
    data_view, dst_view, p = source_view(data), destination_view(dst), data.partitions

    def step():
        with np.errstate(divide="ignore"):
            store_into(dst_view, np.float32(1) / fp32_rows(data_view, p))

    run_step(step)
    record(name, eng, dst, [("data", data)], flops=data.size)


_NOT_SIMULATED = {"nc_matmul_mx", "quantize_mx", "topk"}


def __getattr__(name: str):
    if name in _NOT_SIMULATED:
        def not_simulated(*args, **kwargs):
            raise NkiNotSimulatedError(f"nki.isa.{name}")

        not_simulated.__name__ = name
        return not_simulated
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")
