"""Simulator stage: ``nki.language`` — buffers, dtypes, tensor creation, loops, launch ids and the
convenience wrappers (load/store/matmul/elementwise/reductions) that lower to ``nki.isa`` instructions.

Input: NKI kernel code calling ``nl.*``. Output: new NkiTensors (SBUF tiles unless stated) computed by the
ISA instructions the wrappers lower to, so the trace and every hardware rule apply to wrappers as well.
"""

from __future__ import annotations

import builtins
import dataclasses

import numpy as np

from neuron_compile.runtime.simulator import isa as _isa
from neuron_compile.runtime.simulator import ops as _ops
from neuron_compile.runtime.simulator.dtypes import (  # noqa: F401 - re-exported as nl.<dtype>
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from neuron_compile.runtime.simulator.errors import NkiNotSimulatedError, NkiValidationError
from neuron_compile.runtime.simulator.isa_registers import VirtualRegister
from neuron_compile.runtime.simulator.language_wrappers import (  # noqa: F401 - re-exported as nl.<name>
    dropout,
    gather_flattened,
    no_reorder,
    rand,
    random_seed,
    rms_norm,
)
from neuron_compile.runtime.simulator.memory import allocate, current, hbm, private_hbm, psum, sbuf, shared_hbm
from neuron_compile.runtime.simulator.rules import is_float, reduce_axes
from neuron_compile.runtime.simulator.tensor import DynSlice, NkiTensor

# ------------------------------------------------------------------------------------------------ dtypes
# nl.float32 & co. are the dtypes of nki.dtype (dtypes.py)
tensor = NkiTensor  # ``nl.tensor``: the type published kernels annotate their tensor arguments with


class NKIObject:
    """``nl.NKIObject``: the base of kernel dataclasses and configuration objects, built by keyword.

    Published kernels construct their ``@dataclass`` subclasses by keyword even where the class body declares
    attributes without annotations (``section_idx = None``), which a plain dataclass would not take. So every
    subclass gets this keyword constructor unless its body defines ``__init__``: ``@dataclass`` keeps an
    ``__init__`` the class already has, and still adds its comparison and repr. Positional arguments fill the
    dataclass fields in order; fields not given take their defaults (None without one, as published kernels
    construct such classes without every field); ``__post_init__`` runs last."""

    def __init__(self, *args, **kwargs) -> None:
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes {len(fields)} positional arguments, got {len(args)}")
        for field, value in zip(fields, args):
            if field.name in kwargs:
                raise TypeError(f"{type(self).__name__} got two values for {field.name}")
            kwargs[field.name] = value
        for field in fields:
            if field.name in kwargs:
                continue
            if field.default is not dataclasses.MISSING:
                kwargs[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                kwargs[field.name] = field.default_factory()
            else:  # published kernels leave fields out of the keyword constructor: they read as None
                kwargs[field.name] = None
        for key, value in kwargs.items():
            object.__setattr__(self, key, value)  # as a frozen dataclass's own constructor sets its fields
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            cls.__init__ = NKIObject.__init__


# ------------------------------------------------------------------------------------------------ operators
class Operator(_ops.Op):
    """An NKI operator that is also the elementwise function: ``nl.add(x, y)`` computes, ``op=nl.add`` selects."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return apply_op(self, *args, **kwargs)


def _operators() -> dict[str, Operator]:
    derived: dict[int, Operator] = {}  # one object per operator, aliases included (nl.identity is nl.copy)
    return {name: derived.setdefault(id(op), op.derived(Operator)) for name, op in _ops.ALL_OPS.items()}


globals().update(_operators())


# ------------------------------------------------------------------------------------------------ creation
def ndarray(shape, dtype, buffer=sbuf, name: str = "", address=None) -> NkiTensor:
    """An uninitialized tensor (NaN-filled floats, 4-filled ints, as the official simulator does); with
    ``address=(partition, byte offset)``, placed there in the kernel's SBUF / PSUM (memory.allocate)."""
    return allocate(shape, dtype, buffer, name, address)


def full(shape, fill_value, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    tensor = allocate(shape, dtype, buffer, name)
    if tensor.on_chip:
        _isa.memset(tensor, int(fill_value) if not is_float(tensor.dtype) else fill_value)
    else:
        tensor.write(np.asarray(fill_value).astype(tensor.dtype))
    return tensor


def zeros(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name: str = "") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def zeros_like(x: NkiTensor, dtype=None, buffer=None, name: str = "") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype=None, buffer=None, name: str = "") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ds(start, size, step: int = 1) -> DynSlice:
    return DynSlice(start, size, step)


# ------------------------------------------------------------------------------------------------ loops, ids
def affine_range(*args, **kwargs):
    return range(*args)


sequential_range = affine_range
static_range = affine_range


def program_id(axis: int = 0) -> int:
    if axis != 0:
        raise NkiValidationError("err_program_axis", f"program_id axis {axis}: kernels launch on one axis (LNC)")
    return current().program_id


def num_programs(axes=None) -> int:
    return current().num_programs


def program_ndim() -> int:
    return 1


def device_print(prefix, x) -> None:
    print(prefix, np.asarray(x) if isinstance(x, NkiTensor) else x)


class _TileSize:
    """``nl.tile_size``: hardware tile limits of the current target."""

    @property
    def pmax(self):
        return current().target.partitions

    @property
    def psum_bank_fmax(self):
        return current().target.psum_bank_bytes // 4

    psum_fmax = psum_bank_fmax

    @property
    def psum_bank_fmax_bytes(self):
        return current().target.psum_bank_bytes

    @property
    def psum_num_banks(self):
        return current().target.psum_banks

    @property
    def gemm_stationary_fmax(self):
        return current().target.gemm_stationary_fmax

    @property
    def gemm_moving_fmax(self):
        return current().target.gemm_moving_fmax

    @property
    def bn_stats_fmax(self):
        return current().target.bn_stats_fmax

    @property
    def sbuf_size_bytes(self):
        return current().target.sbuf_bytes_per_partition

    total_available_sbuf_size = sbuf_size_bytes

    @property
    def sbuf_fmax(self):
        return current().target.sbuf_fmax

    @property
    def sbuf_fmax_bytes(self):
        return current().target.sbuf_bytes_per_partition

    psum_min_align = 4
    sbuf_min_align = 4


tile_size = _TileSize()


# ------------------------------------------------------------------------------------------------ movement
def _on_chip_shape(shape) -> tuple[int, ...]:
    return tuple(shape) if len(shape) >= 2 else (1,) + tuple(shape)


def load(src: NkiTensor, dtype=None, mask=None) -> NkiTensor:
    """A new SBUF tile holding ``src`` (one dma_copy)."""
    tile = allocate(_on_chip_shape(src.shape), dtype or src.dtype, sbuf)
    _isa.dma_copy(tile, src)
    return tile


def store(dst: NkiTensor, value: NkiTensor, mask=None) -> None:
    """dst = value by DMA; a PSUM value is first copied to SBUF (DMA cannot read PSUM)."""
    if value.kind == "psum":
        staged = allocate(value.shape, value.dtype, sbuf)
        _isa.tensor_copy(staged, value)
        value = staged
    _isa.dma_copy(dst, value)


def copy(x: NkiTensor, dtype=None) -> NkiTensor:
    out = allocate(x.shape, dtype or x.dtype, sbuf)
    _isa.tensor_copy(out, x)
    return out


def load_transpose2d(src: NkiTensor, dtype=None) -> NkiTensor:
    if src.ndim != 2:
        raise NkiValidationError(
            "err_exceed_max_supported_dimension", f"load_transpose2d of rank {src.ndim} {src.shape}"
        )
    tile = allocate((src.shape[1], src.shape[0]), src.dtype, sbuf)
    _isa.dma_transpose(tile, src)
    return copy(tile, dtype) if dtype is not None and np.dtype(dtype) != tile.dtype else tile


def transpose(x: NkiTensor, dtype=None) -> NkiTensor:
    """x.T into a new PSUM tile through TensorE (2-D, x in SBUF)."""
    if x.ndim != 2:
        raise NkiValidationError("err_exceed_max_supported_dimension", f"transpose of rank {x.ndim} {x.shape}")
    out = allocate((x.shape[1], x.shape[0]), x.dtype, psum)
    _isa.nc_transpose(out, x)
    return out


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False) -> NkiTensor:
    """x @ y (x.T @ y with transpose_x) into a new fp32 PSUM tile."""
    if transpose_x:
        stationary = x
    else:
        transposed = transpose(x)
        stationary = allocate(transposed.shape, transposed.dtype, sbuf)
        _isa.tensor_copy(stationary, transposed)
    out = allocate((stationary.free_size, y.free_size), float32, psum)
    _isa.nc_matmul(out, stationary, y)
    return out


def broadcast_to(x: NkiTensor, shape, dtype=None) -> NkiTensor:
    """``x`` with size-1 dims stretched to ``shape`` (same rank). Free dims stretch as a stride-0 view; the
    partition dim of an on-chip tile has no stride to set to 0, so a [1, ...] tile is copied to every partition
    of a new SBUF tile by TensorE (a matmul with a row of ones, exact: 1 * x in fp32), as the compiler does."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim:
        raise NkiValidationError("err_broadcast_rank", f"broadcast_to {shape} must keep the rank of {x.shape}")
    if x.on_chip and shape[0] != x.shape[0]:
        if x.shape[0] != 1:
            raise NkiValidationError(
                "err_broadcast_non_unit", f"broadcast_to {shape}: partition dim {x.shape[0]} of {x.name} is not 1"
            )
        x = _broadcast_partitions(x, shape[0])
    view = x.broadcast_to(shape)
    return copy(view, dtype) if dtype is not None and np.dtype(dtype) != view.dtype else view


def _broadcast_partitions(row: NkiTensor, partitions: int) -> NkiTensor:
    """A new SBUF tile holding the one-partition tile ``row`` on each of ``partitions`` partitions."""
    if row.dtype.name not in _isa.MATMUL_INPUT_DTYPES:
        raise NkiValidationError(
            "err_broadcast_dtype", f"broadcasting {row.name} ({row.dtype.name}) across partitions goes through "
            f"TensorE, which reads {sorted(_isa.MATMUL_INPUT_DTYPES)}; cast it first",
        )
    free = row.free_size
    if row.kind != "sbuf" or not row.is_contiguous():
        row = copy(row)
    flat_row = row.reshape((1, free))
    ones = full((1, partitions), 1.0, row.dtype)
    out = allocate((partitions,) + row.shape[1:], row.dtype, sbuf)
    flat_out = out.reshape((partitions, free))
    chunk = tile_size.gemm_moving_fmax
    for start in range(0, free, chunk):
        size = builtins.min(chunk, free - start)
        product = allocate((partitions, size), float32, psum)
        _isa.nc_matmul(product, ones, flat_row[:, start:start + size])
        _isa.tensor_copy(flat_out[:, start:start + size], product)
    return out


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    return x.expand_dim(axis)


# ------------------------------------------------------------------------------------------------ elementwise
def _weak_dtype(value) -> np.dtype:
    if isinstance(value, NkiTensor):
        return value.dtype
    if isinstance(value, bool):
        return uint8
    return int32 if isinstance(value, (int, np.integer)) else float32


def promote(a: np.dtype, b: np.dtype) -> np.dtype:
    """NKI type promotion (nki.api.shared.rst)."""
    if a == b:
        return a
    fa, fb = is_float(a), is_float(b)
    if fa != fb:
        return a if fa else b
    names = {a.name, b.name}
    if names == {"float16", "bfloat16"}:
        return float32
    if names <= {"float8_e4m3", "float8_e5m2", "float8_e4m3fn"}:
        return bfloat16
    if names == {"int32", "uint32"}:
        return float32
    if fa:
        return a if a.itemsize > b.itemsize else b
    if a.kind != b.kind:
        # signed with unsigned: the next wider signed type ((int8, uint8) -> int16), at most int32
        return int16 if builtins.max(a.itemsize, b.itemsize) == 1 else int32
    return a if a.itemsize > b.itemsize else b


def _is_scalar(value) -> bool:
    return isinstance(value, (bool, int, float, np.integer, np.floating))


def apply_op(op: _ops.Op, *args, dtype=None, **kwargs) -> NkiTensor:
    """``nl.<op>(...)``: a new SBUF tile computed by the matching ISA instruction."""
    if op.kind in ("unary", "bitvec_unary"):
        (x,) = args
        out = allocate(x.shape, dtype or x.dtype, sbuf)
        if op.kind == "bitvec_unary":
            _isa.tensor_scalar(out, x, _ops.BINARY["bitwise_xor"], -1)
        else:
            _isa.activation(out, op, x)
        return out
    x, y = args
    if _is_scalar(x) and _is_scalar(y):
        raise NkiValidationError("err_expected_tensor", f"nl.{op.name} needs at least one tile operand")
    out_dtype = np.dtype(dtype) if dtype is not None else promote(_weak_dtype(x), _weak_dtype(y))
    if _is_scalar(x) or _is_scalar(y):
        tile, scalar, reverse = (y, x, True) if _is_scalar(x) else (x, y, False)
        out = allocate(tile.shape, out_dtype, sbuf)
        _isa.tensor_scalar(out, tile, op, scalar, reverse0=reverse)
        return out
    if x.shape == y.shape:
        out = allocate(x.shape, out_dtype, sbuf)
        _isa.tensor_tensor(out, x, y, op)
        return out
    # free-dim broadcast of a (P, 1) column: tensor_scalar with a vector operand (fp32 per the ISA rule)
    if x.partitions == y.partitions and (x.free_size == 1 or y.free_size == 1):
        tile, column, reverse = (y, x, True) if x.free_size == 1 else (x, y, False)
        if column.dtype != float32:
            column = copy(column, float32)
        out = allocate(tile.shape, out_dtype, sbuf)
        _isa.tensor_scalar(out, tile, op, column, reverse0=reverse)
        return out
    raise NkiValidationError(
        "err_shape_mismatch",
        f"nl.{op.name} operands {x.shape} and {y.shape}: shapes must match, or one must be a (P, 1) column "
        "(partition-dim broadcasting is not supported)",
    )


def where(condition: NkiTensor, x, y, dtype=None) -> NkiTensor:
    """condition ? x : y, as condition * x + (1 - condition) * y on VectorE."""
    picked_x = apply_op(_ops.BINARY["multiply"], condition, x, dtype=float32)
    inverse = apply_op(_ops.BINARY["subtract"], 1.0, condition, dtype=float32)
    picked_y = apply_op(_ops.BINARY["multiply"], inverse, y, dtype=float32)
    return apply_op(_ops.BINARY["add"], picked_x, picked_y, dtype=dtype or promote(_weak_dtype(x), _weak_dtype(y)))


# ------------------------------------------------------------------------------------------------ reductions
def _reduce(op_name: str, x: NkiTensor, axis, dtype, keepdims: bool, negate: bool = False) -> NkiTensor:
    axes = reduce_axes(f"nl.{op_name}", x, axis)
    kept = x.shape[: x.ndim - len(axes)]
    shape = kept + (1,) * len(axes) if keepdims else kept
    out = allocate(_on_chip_shape(shape) if len(shape) >= 2 else (shape[0], 1), dtype or x.dtype, sbuf)
    _isa.tensor_reduce(out, _ops.ALL_OPS[op_name], x, axes, negate=negate, keepdims=keepdims)
    return out


def _reduced_count(x: NkiTensor, axis) -> int:
    axes = reduce_axes("nl.mean", x, axis)
    return int(np.prod([x.shape[a] for a in axes]))


def sum(x, axis, dtype=None, keepdims=False, mask=None):  # noqa: A001 - NKI's name
    return _reduce("add", x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False, mask=None):  # noqa: A001
    return _reduce("maximum", x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False, mask=None):  # noqa: A001
    return _reduce("minimum", x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False, mask=None):
    return _reduce("multiply", x, axis, dtype, keepdims)


def all(x, axis, dtype=None, keepdims=False, mask=None):  # noqa: A001
    return _reduce("logical_and", x, axis, dtype, keepdims)


def mean(x, axis, dtype=None, keepdims=False, mask=None):
    total = _reduce("add", x, axis, float32, keepdims)
    out = allocate(total.shape, dtype or x.dtype, sbuf)
    _isa.tensor_scalar(out, total, _ops.BINARY["multiply"], 1.0 / _reduced_count(x, axis))
    return out


def var(x, axis, dtype=None, keepdims=False, mask=None):
    """Population variance over the free dims: mean of squares minus square of mean... computed as
    mean((x - mean)^2) for accuracy; all free dims must be reduced (the mean is a (P, 1) operand)."""
    axes = reduce_axes("nl.var", x, axis)
    if len(axes) != x.ndim - 1:
        raise NkiNotSimulatedError("nki.language.var over a subset of the free dims")
    center = mean(x, axis, float32)
    diff = allocate(x.shape, float32, sbuf)
    _isa.tensor_scalar(diff, x, _ops.BINARY["subtract"], center)
    squared = allocate(x.shape, float32, sbuf)
    _isa.tensor_tensor(squared, diff, diff, _ops.BINARY["multiply"])
    return mean(squared, axis, dtype or x.dtype, keepdims)


def softmax(x: NkiTensor, axis=-1, dtype=None) -> NkiTensor:
    """softmax over the last free dim, as the Neuron compiler lowers it: max, exp(x - max) with a running sum,
    reciprocal, multiply."""
    if axis not in (-1, x.ndim - 1) or x.ndim != 2:
        raise NkiNotSimulatedError(f"nki.language.softmax over axis {axis} of a rank-{x.ndim} tile")
    p, f = x.shape
    neg_max = allocate((p, 1), float32, sbuf)
    _isa.tensor_reduce(neg_max, _ops.BINARY["maximum"], x, axis=1, negate=True)
    exps = allocate((p, f), float32, sbuf)
    total = allocate((p, 1), float32, sbuf)
    _isa.activation(exps, _ops.UNARY["exp"], x, bias=neg_max, reduce_op=_ops.BINARY["add"], reduce_res=total)
    inverse = allocate((p, 1), float32, sbuf)
    _isa.reciprocal(inverse, total)
    out = allocate((p, f), dtype or x.dtype, sbuf)
    _isa.tensor_scalar(out, exps, _ops.BINARY["multiply"], inverse)
    return out


# ------------------------------------------------------------------------------------------------ constants
def shared_constant(constant) -> NkiTensor:
    """A shared-HBM tensor holding ``constant`` (a numpy array, or the path of a ``.npy`` file), as the
    compiler embeds it in the binary; its dtype must be a Neuron dtype."""
    values = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    tensor = allocate(values.shape or (1,), values.dtype, shared_hbm, "shared_constant")
    tensor.write(values.reshape(tensor.shape))
    return tensor


def shared_identity_matrix(n: int, dtype=uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An (n, n) identity matrix in SBUF (``dst`` when given), loaded by DMA from a constant in HBM."""
    dtype = np.dtype(dtype)
    constant = allocate((n, n), dtype, private_hbm, "identity_constant")
    constant.write(np.eye(n, dtype=np.float32).astype(dtype))
    tile = dst if dst is not None else allocate((n, n), dtype, sbuf, "identity")
    _isa.dma_copy(tile, constant)
    return tile


# ------------------------------------------------------------------------------------------------ dynamic loops
def dynamic_range(start, stop=None, step: int = 1):
    """A loop whose bounds may be registers (``nisa.register_alloc``); the simulator knows their values, so it
    iterates them as Python ints. ``step`` must be a positive compile-time integer."""
    if not isinstance(step, int) or step <= 0:
        raise NkiValidationError("err_dynamic_range_step", f"step must be a positive compile-time int, got {step!r}")
    if stop is None:
        start, stop = 0, start
    return range(int(start), int(stop), step)


def fori_loop(lower, upper, body_fun, step: int = 1) -> None:
    """``body_fun(i)`` for i in [lower, upper) by step; ``i`` is a register holding the iteration value."""
    for value in dynamic_range(lower, upper, step):
        body_fun(VirtualRegister(value))


def while_loop(init, body_fun) -> None:
    """While the condition register is nonzero: ``condition = body_fun(condition)`` (checked before each
    iteration; the body gets a copy of the register and returns the next condition register)."""
    condition = init
    while int(condition) != 0:
        condition = body_fun(VirtualRegister(int(condition)))
        if not isinstance(condition, VirtualRegister):
            raise NkiValidationError(
                "err_while_loop_condition", f"the body of nl.while_loop must return a register, got {condition!r}"
            )


_NOT_SIMULATED = {
    "fmod", "mod",  # "work in simulation but fail when compiled for Trainium hardware": refused here
}


# star imports get the NKI names (dtypes, buffers, operators, functions), not this module's imports
__all__ = sorted(
    key for key, value in globals().items()
    if not key.startswith("_") and key not in {"annotations", "builtins", "dataclasses", "ml_dtypes", "np", "allocate", "current",
                                                "is_float", "promote", "apply_op", "DynSlice", "NkiTensor",
                                                "NkiNotSimulatedError", "NkiValidationError", "Operator",
                                                "VirtualRegister"}
)


def __getattr__(name: str):
    if name in _NOT_SIMULATED:
        def not_simulated(*args, **kwargs):
            raise NkiNotSimulatedError(f"nki.language.{name}")

        not_simulated.__name__ = name
        return not_simulated
    raise AttributeError(f"module 'nki.language' has no attribute {name!r}")
