"""Simulator stage: NkiTensor, a strided view over a flat numpy storage (nki's NkiTensor).

Input: a ``Storage`` (one allocation: flat numpy array, memory kind, partition stride) plus shape, element
strides and element offset. Output: views (indexing, reshape, permute, broadcast, ``.ap()``, ``view(dtype)``)
that share the storage, and ``read()`` / ``write()`` that move whole tiles through strided numpy views (built
once per view), so an instruction costs a few vectorized numpy calls whatever its size.

Element address of a view: ``flat[offset + sum(index_d * stride_d)]`` (SDK ``nki/deep-dives/nki-aps.rst``).
On-chip (SBUF/PSUM) storages are laid out ``[partition, free...]`` row-major; dim 0 of every on-chip view is
the partition dim, whose stride is the storage's ``partition_stride``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from neuron_compile.runtime.simulator.errors import NkiValidationError
from neuron_compile.runtime.simulator.tensor_views import TensorViews

ON_CHIP = ("sbuf", "psum")


class Buffer:
    """A memory kind (nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm)."""

    __slots__ = ("name", "kind")

    def __init__(self, name: str, kind: str):
        self.name = name
        self.kind = kind  # "sbuf" | "psum" | "hbm": what the cost model and the rules see

    def __repr__(self) -> str:
        return f"nl.{self.name}"


class DynSlice:
    """``nl.ds(start, size)``: a slice given by start and size."""

    __slots__ = ("start", "size", "step")

    def __init__(self, start: int, size: int, step: int = 1):
        self.start, self.size, self.step = int(start), int(size), int(step)

    def __repr__(self) -> str:
        return f"ds({self.start}, {self.size})"


_memory_ids = itertools.count()


class Storage:
    """One allocation. ``matmul_written`` (PSUM only) marks the elements a matmul accumulation group owns;
    ``matmul_read`` those of them another instruction has read since (the group's result was consumed).
    ``memory_id`` names the memory it occupies for the cost model's dependencies (trace.Region): unique per
    allocation, except that the allocator hands a released on-chip slot's id to the next tensor of that size."""

    __slots__ = ("data", "buffer", "name", "partition_stride", "matmul_written", "matmul_read", "written",
                 "memory_id", "physical", "recorder", "__weakref__")

    def __init__(self, data: np.ndarray, buffer: Buffer, name: str, partition_stride: int, physical: bool = False):
        self.data = data
        self.buffer = buffer
        self.name = name
        self.partition_stride = partition_stride
        self.matmul_written = np.zeros(data.shape, dtype=bool) if buffer.kind == "psum" else None
        self.matmul_read = np.zeros(data.shape, dtype=bool) if buffer.kind == "psum" else None
        self.written = False  # any instruction wrote into it (kernel outputs must be written)
        self.memory_id = next(_memory_ids)
        # the whole SBUF or PSUM of a kernel as bytes, which tensors allocated at an address view (memory.py)
        self.physical = physical
        # the replay.Recorder of the launch that made it, while that launch records a plan: a value read or written
        # outside an instruction's step (read / write / peek below) makes the launch one that cannot be replayed
        self.recorder = None


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class NkiTensor(TensorViews):
    """A view of a Storage. Strides and offset are in elements of ``dtype``; the named view methods (slice,
    select, vector_select, reshape_dim, flatten_dims, rearrange) come from tensor_views.TensorViews."""

    __slots__ = ("storage", "shape", "strides", "offset", "dtype", "indirect", "_array", "operand_fields",
                 "allocation_free", "__weakref__")

    def __init__(self, storage: Storage, shape, strides, offset: int = 0, dtype=None, indirect=None,
                 allocation_free: int | None = None):
        self.storage = storage
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.dtype = np.dtype(dtype) if dtype is not None else storage.data.dtype
        # (index_tensor, dim) for an indirect (vector_offset) access pattern on HBM, else None
        self.indirect = indirect
        self._array = None  # the numpy view, built on first access (a view's geometry never changes)
        self.operand_fields = None  # cache of rules.operand()
        # elements per partition of the tensor's own allocation, where that differs from the storage's partition
        # stride (a tensor at an address in a kernel's physical SBUF/PSUM); None: the partition stride
        self.allocation_free = allocation_free
    # ---------------------------------------------------------------- properties
    @property
    def buffer(self) -> Buffer:
        return self.storage.buffer

    @property
    def kind(self) -> str:
        return self.storage.buffer.kind

    @property
    def on_chip(self) -> bool:
        return self.storage.buffer.kind in ON_CHIP

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def free_size(self) -> int:
        """Elements per partition."""
        return math.prod(self.shape[1:])

    @property
    def partition_stride(self) -> int:
        """Elements of this view's dtype per partition of the allocation."""
        storage = self.storage
        return storage.partition_stride * storage.data.itemsize // self.itemsize

    @property
    def start_partition(self) -> int:
        return self.offset // self.partition_stride if self.on_chip else 0

    def __repr__(self) -> str:
        return f"NkiTensor({self.name}, {self.buffer}, shape={self.shape}, dtype={self.dtype.name})"

    def __len__(self) -> int:
        return self.shape[0]

    # ---------------------------------------------------------------- data movement
    def _reach(self) -> tuple[int, int]:
        """The lowest and highest element the (direct) view addresses."""
        low = self.offset + sum(s * (n - 1) for s, n in zip(self.strides, self.shape) if s < 0)
        high = self.offset + sum(s * (n - 1) for s, n in zip(self.strides, self.shape) if s > 0)
        return low, high

    def in_bounds(self) -> bool:
        """Whether every element the view addresses lies inside its storage (indirect offsets included)."""
        if self.size == 0:
            return True
        limit = self.storage.data.nbytes // self.itemsize
        if self.indirect is not None:
            index = self.element_indices()
            return bool(index.min() >= 0 and index.max() < limit)
        low, high = self._reach()
        return low >= 0 and high < limit

    def flat(self) -> np.ndarray:
        """The whole storage as a flat array of this view's dtype (element addressing for DMA bookkeeping)."""
        return self._flat()

    def _check_bounds(self) -> None:
        if self.size == 0:
            return
        low, high = self._reach()
        limit = self.storage.data.nbytes // self.itemsize
        if low < 0 or high >= limit:
            raise NkiValidationError(
                "err_tensor_access_out_of_bound",
                f"view of {self.name} (shape {self.shape}, strides {self.strides}, offset {self.offset}) reaches "
                f"elements [{low}, {high}] of a tensor with {limit} elements",
            )

    def _flat(self) -> np.ndarray:
        data = self.storage.data
        return data if data.dtype == self.dtype else data.view(self.dtype)

    def _strided(self) -> np.ndarray:
        array = self._array
        if array is None:
            self._check_bounds()
            flat = self._flat()
            item = flat.itemsize
            array = np.ndarray(self.shape, self.dtype, buffer=flat, offset=self.offset * item,
                               strides=tuple(s * item for s in self.strides))
            self._array = array
        return array

    def element_indices(self) -> np.ndarray:
        """Flat element index of every element of the view (used for indirect access and PSUM flags)."""
        index = np.full(self.shape, self.offset, dtype=np.int64)
        for dim, (size, stride) in enumerate(zip(self.shape, self.strides)):
            shape = [1] * self.ndim
            shape[dim] = size
            if self.indirect is not None and dim == self.indirect[1]:
                values = self.indirect[0].read().reshape(-1).astype(np.int64)
                if values.size != size:
                    raise NkiValidationError(
                        "err_indirect_offset_shape",
                        f"vector_offset has {values.size} offsets but dim {dim} of the pattern has {size} entries",
                    )
                index = index + (values * stride).reshape(shape)
            else:
                index = index + (np.arange(size, dtype=np.int64) * stride).reshape(shape)
        return index

    def _indirect_indices(self) -> np.ndarray:
        index = self.element_indices()
        _check_indirect_bounds(self.name, self.storage.data.nbytes // self.itemsize, index)
        return index

    def indirect_addresses(self):
        """For an indirect view: a function giving the flat element index of each element from the offset tile's
        values at the time it is called (they are data), refusing any outside the storage as ``read`` does. The
        offsets are read through the tile's numpy view: no bookkeeping, so a replayed step can call it."""
        offsets_tile, dim = self.indirect
        if offsets_tile.size != self.shape[dim]:
            raise NkiValidationError(
                "err_indirect_offset_shape",
                f"vector_offset has {offsets_tile.size} offsets but dim {dim} of the pattern has {self.shape[dim]} "
                "entries",
            )
        static = np.full(self.shape, self.offset, dtype=np.int64)
        for axis, (size, stride) in enumerate(zip(self.shape, self.strides)):
            if axis != dim:
                static = static + (np.arange(size, dtype=np.int64) * stride).reshape(_along(axis, size, self.ndim))
        if offsets_tile.storage.matmul_read is not None:  # reading a PSUM tile consumes its matmul result
            offsets_tile.psum_flags(offsets_tile.storage.matmul_read)[...] = True
        offsets, stride, along = offsets_tile.array_view(), self.strides[dim], _along(dim, self.shape[dim], self.ndim)
        name, limit = self.name, self.storage.data.nbytes // self.itemsize  # the function keeps no tensor alive

        def addresses() -> np.ndarray:
            index = static + (offsets.reshape(-1).astype(np.int64) * stride).reshape(along)
            _check_indirect_bounds(name, limit, index)
            return index

        return addresses

    def array_view(self) -> np.ndarray:
        """The numpy view of a direct view's elements (built once; an instruction's step reads and writes it)."""
        self._array_used()
        return self._strided()

    def storage_elements(self) -> np.ndarray:
        """The whole storage as a flat numpy array of this view's dtype (what indirect addresses index)."""
        self._array_used()
        return self._flat()

    def covers_storage(self) -> bool:
        """Whether the view is every element of its storage, each once, in order."""
        data = self.storage.data
        return (self.indirect is None and self.offset == 0 and self.size == data.size and self.dtype == data.dtype
                and self.is_contiguous())

    def _array_used(self) -> None:
        recorder = self.storage.recorder
        if recorder is not None:
            recorder.array_used(self.storage.data)

    def _value_access(self) -> None:
        recorder = self.storage.recorder
        if recorder is not None:
            recorder.value_accessed(self)

    def read(self) -> np.ndarray:
        """The view's values as a numpy array of ``self.dtype`` (a copy-free view where possible)."""
        self._value_access()
        if self.indirect is not None:
            return self._flat()[self._indirect_indices()]
        if self.storage.matmul_read is not None:
            self.psum_flags(self.storage.matmul_read)[...] = True
        return self._strided()

    def peek(self) -> np.ndarray:
        """read() for the tensor engine's own read-accumulate-write of PSUM (not a consumer of the result)."""
        self._value_access()
        return self._strided()

    def write(self, values) -> None:
        """Store ``values`` (already of ``self.dtype``, broadcastable to the view's shape)."""
        self._value_access()
        self.storage.written = True
        if self.indirect is not None:
            self._flat()[self._indirect_indices()] = values
            return
        self._strided()[...] = values

    def matmul_flags(self) -> np.ndarray | None:
        """The PSUM "written by matmul" flags of this view (a writeable strided view), None off PSUM."""
        return self.psum_flags(self.storage.matmul_written)

    def psum_flags(self, flags: np.ndarray | None) -> np.ndarray | None:
        """A per-element flag array of the storage, viewed like this tensor."""
        if flags is None:
            return None
        # flags are kept per element of the storage (per byte of a physical PSUM): scale this view's element
        # offsets and strides to them
        scale = self.dtype.itemsize // self.storage.data.itemsize
        if not self.storage.physical and scale != 1:
            raise NkiValidationError("err_psum_view_dtype", "PSUM views must keep the allocation's element size")
        base = flags[self.offset * scale:] if self.offset else flags
        return as_strided(base, self.shape, tuple(s * scale for s in self.strides), writeable=True)

    # ---------------------------------------------------------------- views
    def _view(self, shape, strides, offset, dtype=None, indirect=None) -> NkiTensor:
        free = self.allocation_free
        if free is not None and dtype is not None and np.dtype(dtype).itemsize != self.itemsize:
            free = free * self.itemsize // np.dtype(dtype).itemsize
        return NkiTensor(self.storage, shape, strides, offset, dtype or self.dtype, indirect, free)

    @property
    def logical_partition_stride(self) -> int:
        """Elements per partition of the allocation as the kernel sees it (the partition step of ``.ap()``)."""
        return self.allocation_free if self.allocation_free is not None else self.partition_stride

    def __getitem__(self, key) -> NkiTensor:
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            at = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:at] + (slice(None),) * fill + key[at + 1:]
        if len(key) > self.ndim:
            raise NkiValidationError(
                "err_too_many_indices", f"{len(key)} indices for {self.name} of rank {self.ndim} (shape {self.shape})"
            )
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset = [], [], self.offset
        for dim, (k, size, stride) in enumerate(zip(key, self.shape, self.strides)):
            if isinstance(k, DynSlice):
                if k.start < 0 or k.size < 0 or (k.size > 0 and k.start + (k.size - 1) * k.step >= size):
                    raise NkiValidationError(
                        "err_tensor_access_out_of_bound",
                        f"nl.ds({k.start}, {k.size}) on dim {dim} of {self.name} with size {size}",
                    )
                offset += k.start * stride
                shape.append(k.size)
                strides.append(stride * k.step)
            elif isinstance(k, slice):
                if k.stop is not None and (k.step or 1) > 0 and k.stop > size:
                    raise NkiValidationError(
                        "err_tensor_access_out_of_bound",
                        f"slice {k.start}:{k.stop} on dim {dim} of {self.name} with size {size}",
                    )
                start, _, step = k.indices(size)
                count = len(range(*k.indices(size)))
                if self.on_chip and dim == 0 and step != 1 and count > 1:
                    raise NkiValidationError(
                        "err_partition_range_not_contiguous",
                        f"slice with step {step} of the partition dim of {self.name}: an access must cover "
                        "consecutive partitions (step 1)",
                    )
                offset += start * stride
                shape.append(count)
                strides.append(stride * step)
            else:
                if not isinstance(k, (int, np.integer)):
                    raise NkiValidationError(
                        "err_unsupported_advanced_indexing",
                        f"index {k!r} on dim {dim} of {self.name}: only ints, slices, nl.ds and ... index a tensor "
                        "(gather through .ap(vector_offset=...) and dma_copy)",
                    )
                index = int(k)
                if index < -size or index >= size:
                    raise NkiValidationError(
                        "err_tensor_access_out_of_bound", f"index {index} on dim {dim} of {self.name} with size {size}"
                    )
                index %= size
                offset += index * stride
                if self.on_chip and dim == 0:  # on-chip keeps the partition dim
                    shape.append(1)
                    strides.append(stride)
        if self.on_chip and len(shape) < 2:
            shape.append(1)
            strides.append(1)
        if not shape:
            shape, strides = [1], [1]
        return self._view(shape, strides, offset)

    def reshape(self, shape) -> NkiTensor:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise NkiValidationError(
                "err_reshape_size", f"cannot reshape {self.shape} ({self.size} elements) to {shape}"
            )
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition",
                f"reshape of on-chip {self.name} from {self.shape} to {shape} changes the partition dim",
            )
        if self.on_chip:
            if not _is_contiguous(self.shape[1:], self.strides[1:]):
                raise NkiValidationError("err_reshape_non_contiguous", f"reshape of non-contiguous view {self}")
            strides = (self.strides[0],) + _row_major_strides(shape[1:])
        else:
            if not _is_contiguous(self.shape, self.strides):
                raise NkiValidationError("err_reshape_non_contiguous", f"reshape of non-contiguous view {self}")
            strides = _row_major_strides(shape)
        return self._view(shape, strides, self.offset)

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError("err_permute_dims", f"permute dims {dims} for rank {self.ndim}")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition",
                f"permute {dims} of on-chip {self.name} moves the partition dim",
            )
        return self._view([self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise NkiValidationError("err_broadcast_non_unit", f"broadcast of dim {dim} of size {self.shape[dim]}")
        if self.on_chip and dim == 0:
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition", "broadcast along the partition dim"
            )
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = size, 0
        return self._view(shape, strides, self.offset)

    def broadcast_to(self, shape) -> NkiTensor:
        view = self
        for dim, (have, want) in enumerate(zip(self.shape, shape)):
            if have != want:
                view = view.broadcast(dim, want)
        return view

    def expand_dim(self, dim: int) -> NkiTensor:
        if self.on_chip and dim == 0:
            raise NkiValidationError("err_leading_dimension_of_tensor_must_be_partition", "expand_dim at dim 0")
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 1)
        return self._view(shape, strides, self.offset)

    def squeeze_dim(self, dim: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise NkiValidationError("err_squeeze_non_unit", f"squeeze of dim {dim} of size {self.shape[dim]}")
        if self.on_chip and (dim == 0 or self.ndim <= 2):
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition", f"squeeze_dim({dim}) of on-chip {self.shape}"
            )
        shape, strides = list(self.shape), list(self.strides)
        del shape[dim], strides[dim]
        return self._view(shape, strides, self.offset)

    def view(self, dtype) -> NkiTensor:
        """Reinterpret the bytes as ``dtype``; a size change rescales the contiguous innermost dim."""
        dtype = np.dtype(dtype)
        if dtype.itemsize == self.itemsize:
            return self._view(self.shape, self.strides, self.offset, dtype)
        old, new = self.itemsize, dtype.itemsize
        last_bytes = self.shape[-1] * old
        aligned = all((s * old) % new == 0 for s in self.strides[:-1]) and (self.offset * old) % new == 0
        if self.strides[-1] != 1 or last_bytes % new or not aligned or self.indirect is not None:
            raise NkiValidationError(
                "err_view_dtype_size",
                f"view({dtype.name}) of {self.name} {self.shape} {self.dtype.name}: a change of element size needs a "
                f"contiguous innermost dim whose bytes ({last_bytes}) and strides divide by {new}",
            )
        strides = tuple(s * old // new for s in self.strides[:-1]) + (1,)
        return self._view(self.shape[:-1] + (last_bytes // new,), strides, self.offset * old // new, dtype)

    def ap(self, pattern, offset: int = 0, scalar_offset=None, vector_offset=None, indirect_dim: int = 0,
           dtype=None) -> NkiTensor:
        """Access pattern view: ``[[stride, count], ...]`` over this tensor's storage, from its offset."""
        pattern = [(int(p[0]), int(p[1])) for p in pattern]
        if not pattern:
            raise NkiValidationError("err_ap_empty", f"empty access pattern on {self.name}")
        if dtype is not None and np.dtype(dtype).itemsize != self.itemsize:
            # the pattern counts elements of the new dtype: view the tensor as it first (same bytes)
            return self._as_dtype_for_ap(np.dtype(dtype)).ap(pattern, offset, scalar_offset, vector_offset,
                                                            indirect_dim)
        logical = self.logical_partition_stride
        if self.on_chip and pattern[0][0] != logical:
            raise NkiValidationError(
                "err_ap_partition_step",
                f"first [step, num] of an access pattern on {self.buffer} is the partition dim: step must be "
                f"{logical} (free elements per partition of {self.name}), got {pattern[0][0]}",
            )
        extra = int(offset)
        if scalar_offset is not None:
            extra += _scalar_offset_value(scalar_offset) * math.prod(self.shape[indirect_dim + 1:])
        start = self.offset + extra
        if self.on_chip and logical != self.partition_stride:  # the kernel's offsets, in its allocation's layout
            partitions, free = divmod(extra, logical)
            start = self.offset + partitions * self.partition_stride + free
            pattern = [(self.partition_stride, pattern[0][1])] + pattern[1:]
        indirect = None
        if vector_offset is not None:
            if self.on_chip:
                raise NkiValidationError("err_indirect_on_chip", "vector_offset is only supported on HBM tensors")
            if not (isinstance(vector_offset, NkiTensor) and vector_offset.on_chip):
                raise NkiValidationError("err_indirect_offset_buffer", "vector_offset must be an SBUF tile (P, 1)")
            indirect = (vector_offset, int(indirect_dim))
        return self._view([c for _, c in pattern], [s for s, _ in pattern], start, dtype, indirect)

    def _as_dtype_for_ap(self, dtype: np.dtype) -> NkiTensor:
        """This tensor's allocation read as ``dtype``: offsets and the partition stride rescaled to its elements."""
        old, new = self.itemsize, dtype.itemsize
        if (self.offset * old) % new or (self.partition_stride * old) % new:
            raise NkiValidationError(
                "err_view_dtype_size", f"ap(dtype={dtype.name}) of {self.name}: its offset and partition size in bytes "
                f"must divide by {new}",
            )
        free = self.logical_partition_stride * old // new
        return NkiTensor(self.storage, (self.partitions, free) if self.on_chip else (self.size * old // new,),
                         (self.partition_stride * old // new, 1) if self.on_chip else (1,), self.offset * old // new,
                         dtype, None, free if self.allocation_free is not None else None)

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_contiguous(self) -> bool:
        return _is_contiguous(self.shape, self.strides)

    # numpy interop for debugging (device_print, tests)
    def __array__(self, dtype=None, copy=None):
        values = np.array(self.read())
        return values.astype(dtype) if dtype is not None else values


def _scalar_offset_value(scalar_offset) -> int:
    """A dynamic offset: an int, a register (nisa.register_alloc), or a one-element on-chip tensor."""
    if isinstance(scalar_offset, NkiTensor):
        if scalar_offset.size != 1 or not scalar_offset.on_chip:
            raise NkiValidationError(
                "err_scalar_offset",
                f"scalar_offset {scalar_offset.name} {scalar_offset.shape} in {scalar_offset.buffer} must be a (1, 1) "
                "SBUF tensor or a register",
            )
        value = np.asarray(scalar_offset.read()).reshape(-1)[0]
        if not float(value).is_integer():
            raise NkiValidationError("err_scalar_offset", f"scalar_offset {scalar_offset.name} holds {value!r}")
        return int(value)
    return int(scalar_offset)


def _check_indirect_bounds(name: str, limit: int, index: np.ndarray) -> None:
    """Every element index of an indirect access lies within its tensor's ``limit`` elements."""
    if index.size and (index.min() < 0 or index.max() >= limit):
        raise NkiValidationError(
            "err_tensor_access_out_of_bound",
            f"indirect access into {name} reaches elements [{index.min()}, {index.max()}] of a tensor with {limit} "
            "elements",
        )


def _along(axis: int, size: int, ndim: int) -> list[int]:
    """The shape that lays ``size`` values along ``axis`` of an ``ndim``-dim array (for broadcasting)."""
    shape = [1] * ndim
    shape[axis] = size
    return shape


def _is_contiguous(shape, strides) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def new_storage_tensor(data: np.ndarray, buffer: Buffer, shape, name: str) -> NkiTensor:
    """A tensor over all of a fresh flat storage ``data`` with the given (row-major) shape."""
    shape = tuple(int(s) for s in shape)
    partition_stride = math.prod(shape[1:]) if buffer.kind in ON_CHIP else 1
    storage = Storage(data, buffer, name, partition_stride)
    return NkiTensor(storage, shape, _row_major_strides(shape), 0)
