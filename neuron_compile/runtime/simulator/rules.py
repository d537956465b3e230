"""Simulator stage: the shared checks and bookkeeping of every ISA instruction.

Input: the operands of one instruction (NkiTensors, scalars). Output: NkiValidationError for a broken rule of
nki-spec.md §1.6 (rule id, values, instruction), the fp32 values the engines compute on, the rounded store
into the destination, and the InstructionRecord appended to the kernel trace.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.memory import current
from neuron_compile.runtime.simulator.tensor import NkiTensor
from neuron_compile.runtime.simulator.trace import InstructionRecord, OperandInfo, Region

FLOAT32 = np.dtype(np.float32)


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.kind == "V" or dtype.name.startswith(("bfloat", "float"))


def require_tensor(op: str, role: str, value) -> NkiTensor:
    if not isinstance(value, NkiTensor):
        raise NkiValidationError(
            "err_expected_tensor", f"{role} must be an nl.ndarray tile, got {type(value).__name__}", op
        )
    return value


def require_buffers(op: str, role: str, tensor: NkiTensor, allowed: tuple[str, ...],
                    rule: str = "err_unsupported_memory") -> None:
    if tensor.kind not in allowed:
        raise NkiValidationError(
            rule, f"{role} {tensor.name} is in {tensor.buffer}, expected one of {', '.join(allowed)}", op
        )


def require_version(op: str, minimum: str, what: str = "") -> None:
    """Refuse an instruction (or a feature of one: ``what``) that the target's NeuronCore version lacks."""
    version = current().target.nc_version
    if version < minimum:  # gen2 < gen3 < gen4
        raise NkiValidationError(
            "err_unsupported_arch", f"{what or op} needs NeuronCore {minimum} or newer; the target "
            f"{current().target.name} is {version}", op,
        )


def check_tile(op: str, role: str, tensor: NkiTensor, compute: bool = True) -> None:
    """Partition count, start partition (compute engines only) and free size of an on-chip operand."""
    if not tensor.on_chip:
        return
    target = current().target
    partitions = tensor.partitions
    if partitions > target.partitions:
        raise NkiValidationError(
            "err_num_partition_exceed_arch_limit",
            f"Size of partition dimension {partitions} of {role} {tensor.name} exceeds architecture limitation of "
            f"{target.partitions}.",
            op,
        )
    if not compute:
        return
    start = tensor.start_partition
    if partitions > 64:
        legal = (0,)
    elif partitions > 32:
        legal = (0, 64)
    else:
        legal = (0, 32, 64, 96)
    if start not in legal:
        raise NkiValidationError(
            "err_start_partition",
            f"{role} {tensor.name} accesses {partitions} partitions starting at partition {start}; an access of "
            f"{partitions} partitions must start at one of {legal}",
            op,
        )
    limit = target.psum_fmax if tensor.kind == "psum" else target.sbuf_fmax
    if tensor.free_size > limit:
        raise NkiValidationError(
            "err_free_size_exceed_arch_limit",
            f"{role} {tensor.name} has {tensor.free_size} elements per partition; the limit on {tensor.buffer} "
            f"is {limit}",
            op,
        )


def check_same_partitions(op: str, a: NkiTensor, b: NkiTensor, a_role: str, b_role: str) -> None:
    if a.partitions != b.partitions:
        raise NkiValidationError(
            "err_num_partition_mismatch",
            f"{a_role} {a.name} has {a.partitions} partitions, {b_role} {b.name} has {b.partitions}",
            op,
        )


def check_same_free(op: str, a: NkiTensor, b: NkiTensor, a_role: str, b_role: str) -> None:
    if a.free_size != b.free_size:
        raise NkiValidationError(
            "err_num_elements_mismatch",
            f"{a_role} {a.name} {a.shape} has {a.free_size} elements per partition, {b_role} {b.name} {b.shape} "
            f"has {b.free_size}",
            op,
        )


def check_no_psum_on_gpsimd(op: str, engine: str, *tensors: tuple[str, NkiTensor]) -> None:
    if engine != "gpsimd":
        return
    for role, tensor in tensors:
        if isinstance(tensor, NkiTensor) and tensor.kind == "psum":
            raise NkiValidationError(
                "err_gpsimd_psum_access", f"GpSimd cannot access PSUM, but {role} {tensor.name} is in PSUM", op
            )


def fp32_tile(tensor: NkiTensor) -> np.ndarray:
    """The values of an on-chip tile as fp32 of shape (P, free)."""
    values = tensor.read()
    if values.dtype != FLOAT32:
        values = values.astype(FLOAT32)
    return values.reshape(tensor.partitions, -1)


def source_view(tensor: NkiTensor) -> np.ndarray:
    """The numpy view an instruction's step reads a direct ``tensor`` through; reading a PSUM tile consumes the
    result of its matmul accumulation group (the bookkeeping ``read`` does, once, at the instruction)."""
    if tensor.storage.matmul_read is not None:
        tensor.psum_flags(tensor.storage.matmul_read)[...] = True
    return tensor.array_view()


def destination_view(tensor: NkiTensor) -> np.ndarray:
    """The numpy view an instruction's step writes ``tensor`` through; a non-matmul write ends the matmul
    accumulation group of those PSUM elements (the bookkeeping ``store`` does, once, at the instruction)."""
    tensor.storage.written = True
    flags = tensor.matmul_flags()
    if flags is not None:
        flags[...] = False
    recorder = tensor.storage.recorder
    if recorder is not None and tensor.covers_storage():  # the step writes all of it: its fill is not needed
        recorder.array_overwritten(tensor.storage.data)
    return tensor.array_view()


def fp32_rows(values: np.ndarray, partitions: int) -> np.ndarray:
    """Values as the engines compute on them: fp32, shape (P, free) (``fp32_tile`` on a numpy view)."""
    if values.dtype != FLOAT32:
        values = values.astype(FLOAT32)
    return values.reshape(partitions, -1)


def store_into(view: np.ndarray, values) -> None:
    """Write computed values (any shape with the view's element count), rounded to the view's dtype (``store``
    on a numpy view)."""
    view[...] = cast_to(np.asarray(values), view.dtype).reshape(view.shape)


def cast_to(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round engine results to the destination dtype (float -> int rounds to nearest, saturating)."""
    if values.dtype == dtype:
        return values
    if dtype.kind in "iub" and values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            values = np.asarray(np.rint(values))
            if dtype.kind != "b":  # clipped in float64, where every int32 bound is exact (2**31 - 1 is not in fp32)
                values = np.clip(_finite(values).astype(np.float64), *_integer_bounds(dtype))
    return values.astype(dtype)


@functools.cache
def _integer_bounds(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return info.min, info.max


@functools.cache
def _float_bounds(dtype: np.dtype) -> tuple[float, float]:
    info = np.finfo(dtype)
    return info.max, info.min


def _finite(values: np.ndarray) -> np.ndarray:
    """``np.nan_to_num`` of a fresh float array, in place (nan -> 0, +-inf -> the dtype's extremes), with its limits
    looked up once per dtype instead of on every call."""
    high, low = _float_bounds(values.dtype)
    np.copyto(values, 0.0, where=np.isnan(values))
    np.copyto(values, high, where=values == np.inf)  # np.isposinf's mask, without its Python-level wrapper
    np.copyto(values, low, where=values == -np.inf)
    return values


def store(dst: NkiTensor, values: np.ndarray) -> None:
    """Write computed values (any shape with dst's element count) into dst, rounded to dst's dtype."""
    values = cast_to(np.asarray(values), dst.dtype)
    dst.write(values.reshape(dst.shape))
    flags = dst.matmul_flags()
    if flags is not None:  # a non-matmul write ends the matmul accumulation group of these PSUM elements
        flags[...] = False


def operand(role: str, tensor: NkiTensor, hbm_partitions: int | None = None) -> OperandInfo:
    """Trace descriptor of one operand; ``hbm_partitions`` is the on-chip side's partition count of a DMA."""
    fields = tensor.operand_fields
    if fields is None:  # computed once per view: instructions reuse the same tiles many times
        shape = tensor.shape
        partitions = shape[0] if len(shape) > 1 or tensor.on_chip else 1
        free = tensor.size // partitions if partitions else 0
        stride = abs(tensor.strides[-1]) * tensor.itemsize if len(shape) > 1 or not tensor.on_chip else tensor.itemsize
        fields = (tensor.kind, shape, tensor.dtype.name, tensor.itemsize, partitions, free, stride)
        tensor.operand_fields = fields
    if hbm_partitions and not tensor.on_chip and tensor.size % hbm_partitions == 0:
        kind, shape, dtype, itemsize, _, _, stride = fields
        return OperandInfo(role, kind, shape, dtype, itemsize, hbm_partitions, tensor.size // hbm_partitions, stride)
    return OperandInfo(role, *fields)


def _whole_region(tensor: NkiTensor) -> Region:
    storage = tensor.storage
    if not tensor.on_chip:
        return Region(storage.memory_id, (0, 1), (0, storage.data.nbytes), hbm=True)
    partitions = storage.data.size // storage.partition_stride if storage.partition_stride else 1
    return Region(storage.memory_id, (0, partitions), (0, storage.partition_stride * storage.data.itemsize))


def _reach(offset: int, dims) -> tuple[int, int]:
    """Lowest and highest element an access pattern (offset, (size, stride) pairs) reaches."""
    dims = list(dims)  # read twice below
    low = offset + sum(stride * (size - 1) for size, stride in dims if stride < 0)
    high = offset + sum(stride * (size - 1) for size, stride in dims if stride > 0)
    return low, high


def region(tensor: NkiTensor) -> Region:
    """The memory a view reaches (trace.Region): its partitions and the hull of its bytes in each; the whole
    allocation when the pattern is indirect or does not stay within a partition."""
    if tensor.indirect is not None or tensor.size == 0:
        return _whole_region(tensor)
    item = tensor.itemsize
    if not tensor.on_chip:
        low, high = _reach(tensor.offset, zip(tensor.shape, tensor.strides))
        return Region(tensor.storage.memory_id, (0, 1), (low * item, (high + 1) * item), hbm=True)
    partition_stride = tensor.partition_stride
    if partition_stride <= 0 or (tensor.shape[0] > 1 and tensor.strides[0] != partition_stride):
        return _whole_region(tensor)
    first = tensor.offset // partition_stride
    low, high = _reach(tensor.offset - first * partition_stride, zip(tensor.shape[1:], tensor.strides[1:]))
    if low < 0 or high >= partition_stride:
        return _whole_region(tensor)
    return Region(tensor.storage.memory_id, (first, first + tensor.shape[0]), (low * item, (high + 1) * item))


# Operand roles an instruction writes although they are passed as sources (activation's reduce_res,
# nc_match_replace8's dst_idx).
_WRITTEN_SOURCES = {"reduce_res", "dst_idx"}


def _regions(dst: NkiTensor | None, srcs: list[tuple[str, NkiTensor]], name: str):
    """(reads, writes) of one instruction. A matmul also reads its dst (it accumulates into it), an indirect
    access reads its offset tile."""
    reads = [region(t) for role, t in srcs if role not in _WRITTEN_SOURCES]
    writes = [region(t) for role, t in srcs if role in _WRITTEN_SOURCES]
    if dst is not None:
        writes.append(region(dst))
        if name == "nc_matmul":
            reads.append(region(dst))
    for tensor in (dst, *(t for _, t in srcs)):
        if tensor is not None and tensor.indirect is not None and isinstance(tensor.indirect[0], NkiTensor):
            reads.append(region(tensor.indirect[0]))
    return tuple(reads), tuple(writes)


KERNEL_SOURCE_PREFIX = "<nki-kernel "  # the file name kernels loaded from source text run under


def calling_section(launch_frame=None) -> str:
    """The module-level function of loaded kernel source that issued the current instruction, one below the
    launched kernel (a region kernel's subkernel), or the launched kernel when it called none; "" outside
    loaded source. Nested helper functions (``<locals>``) belong to the function that defines them. The walk
    stops at ``launch_frame`` (the simulator's launch) or below the kernel's frames: never the caller's stack."""
    names = []
    frame, inside = sys._getframe(1), False
    while frame is not None and frame is not launch_frame:
        code = frame.f_code
        if code.co_filename.startswith(KERNEL_SOURCE_PREFIX):
            inside = True
            if "<locals>" not in code.co_qualname:
                names.append(code.co_name)
        elif inside:  # below the launched kernel: the launcher, then the caller's whole stack
            break
        frame = frame.f_back
    return names[-2] if len(names) >= 2 else (names[0] if names else "")


def record(name: str, engine: str, dst: NkiTensor | None, srcs: list[tuple[str, object]], attrs: dict | None = None,
           flops: int = 0, hbm_partitions: int | None = None) -> None:
    context = current()
    if context.recorder is not None:
        context.recorder.instruction_recorded(name)
    if context.trace is None:  # a launch whose trace its caller already holds: the bookkeeping alone is skipped
        return
    tensors = [(role, t) for role, t in srcs if isinstance(t, NkiTensor)]
    infos = tuple(operand(role, t, hbm_partitions) for role, t in tensors)
    dst_info = operand("dst", dst, hbm_partitions) if dst is not None else None
    reads, writes = _regions(dst, tensors, name)
    context.trace.append(
        InstructionRecord(name=name, engine=engine, dst=dst_info, srcs=infos, attrs=attrs or {}, flops=int(flops),
                          reads=reads, writes=writes, program=context.program_id,
                          section=calling_section(context.launch_frame))
    )


def scalar_or_vector(op: str, role: str, value, partitions: int, rule: str, require_fp32: bool = True,
                     dtype_rule: str | None = None):
    """A scalar operand, or a (P, 1) tile broadcast along the free dim, as fp32 numpy (shape () or (P, 1))."""
    if isinstance(value, NkiTensor):
        scalar_or_vector_checks(op, role, value, partitions, rule, require_fp32, dtype_rule)
        return fp32_tile(value)
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return np.float32(value)
    raise NkiValidationError(rule, f"{role} must be a scalar or a ({partitions}, 1) tile, got {value!r}", op)


def scalar_or_vector_checks(op: str, role: str, value: NkiTensor, partitions: int, rule: str, require_fp32: bool,
                            dtype_rule: str | None) -> None:
    """A (P, 1) operand tile: on chip, P partitions, one element each, fp32 where the operand must be."""
    if not value.on_chip or value.partitions != partitions or value.free_size != 1:
        raise NkiValidationError(
            rule, f"{role} must be a scalar or a ({partitions}, 1) tile, got {value.name} {value.shape} in "
            f"{value.buffer}", op,
        )
    if require_fp32 and value.dtype != FLOAT32:
        raise NkiValidationError(
            dtype_rule or rule, f"{role} tile {value.name} must be float32, got {value.dtype.name}", op
        )


_ENGINE_NAMES = {1: "tensor", 2: "scalar", 3: "gpsimd", 4: "dma", 5: "vector", 6: "sync"}


def engine_name(engine, default: str) -> str:
    if engine is None:
        return default
    value = getattr(engine, "value", engine)
    if isinstance(value, str):
        return value
    name = _ENGINE_NAMES.get(int(value))
    return name or default


def check_elementwise(op: str, dst, srcs: list[tuple[str, object]], eng: str) -> None:
    require_buffers(op, "dst", dst, ("sbuf", "psum"))
    check_tile(op, "dst", dst)
    for role, t in srcs:
        require_buffers(op, role, t, ("sbuf", "psum"))
        check_tile(op, role, t)
        check_same_partitions(op, t, dst, role, "dst")
        check_same_free(op, t, dst, role, "dst")
    check_no_psum_on_gpsimd(op, eng, ("dst", dst), *srcs)


def operand_values(op: str, role: str, value, partitions: int, rule: str, require_fp32: bool = True,
                   dtype_rule: str | None = None):
    """``scalar_or_vector`` for a step: the operand checked now, and a function giving its fp32 values (a
    constant, or the (P, 1) tile's values when called)."""
    if isinstance(value, NkiTensor):
        scalar_or_vector_checks(op, role, value, partitions, rule, require_fp32, dtype_rule)
        view = source_view(value)
        return lambda: fp32_rows(view, partitions)
    constant = scalar_or_vector(op, role, value, partitions, rule, require_fp32, dtype_rule)
    return lambda: constant


def int_values(t) -> np.ndarray:
    return t.read().reshape(t.partitions, -1)


def reduce_axes(name: str, data, axis) -> tuple[int, ...]:
    """The reduced axes of ``data`` (normalized, sorted): the last free dims, never the partition dim."""
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) % data.ndim for a in axes))
    expected = tuple(range(data.ndim - len(axes), data.ndim))
    if not axes or 0 in axes or axes != expected:
        raise NkiValidationError(
            "err_reduce_axis",
            f"axis {axis} of data {data.shape}: reduction axes must be free dims and the last contiguous dims "
            f"ending at the final dim (e.g. {tuple(range(1, data.ndim))[-1:]} or {tuple(range(1, data.ndim))})",
            name,
        )
    return axes
