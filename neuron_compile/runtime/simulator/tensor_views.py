"""Simulator stage: the named view methods of ``NkiTensor`` (slice, select, vector_select, reshape_dim,
flatten_dims, rearrange, is_indirect), as a mixin of tensor.NkiTensor.

Input: a view and the method's arguments. Output: a new view over the same storage, built from the tensor's
indexing and its shape/stride primitives, with the API's constraints as named errors (no view moves or reshapes
the partition dim of an on-chip tensor; an indirect dim is not sliced further).
"""

from __future__ import annotations

import math

import numpy as np

from neuron_compile.runtime.simulator.errors import NkiValidationError


def _dynamic_index(op: str, index) -> int:
    """The value of a one-element tensor used as an index (the simulator knows it when the kernel runs)."""
    if index.size != 1:
        raise NkiValidationError("err_dynamic_index", f"{op}: a dynamic index is one element, got {index.shape}")
    value = np.asarray(index.read()).reshape(-1)[0]
    if not float(value).is_integer():
        raise NkiValidationError("err_dynamic_index", f"{op}: index {index.name} holds {value!r}, not an integer")
    return int(value)


def _split_sizes(op: str, size: int, shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise NkiValidationError("err_reshape_size", f"{op}: at most one -1 in {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or size % known:
            raise NkiValidationError("err_reshape_size", f"{op}: {shape} does not divide {size}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise NkiValidationError("err_reshape_size", f"{op}: {shape} has {math.prod(shape)} elements, the dim {size}")
    return shape


class TensorViews:
    """View methods shared by every NkiTensor (the class provides shape, strides, offset, indirect and _view)."""

    __slots__ = ()

    def is_indirect(self) -> bool:
        return self.indirect is not None

    def _check_not_indirect_dim(self, op: str, dim: int) -> None:
        if self.indirect is not None and dim == self.indirect[1]:
            raise NkiValidationError("err_indirect_dim", f"{op}: dim {dim} of {self.name} is indirect")

    def slice(self, dim: int, start: int, end: int, step: int = 1):  # noqa: A003 - the API's name
        """Elements start..end (exclusive) by step of one dim."""
        dim = dim % self.ndim
        if not (0 <= start < end <= self.shape[dim]) or step < 1:
            raise NkiValidationError(
                "err_tensor_access_out_of_bound", f"slice({dim}, {start}, {end}, {step}) of {self.name} {self.shape}"
            )
        self._check_not_indirect_dim("slice", dim)
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index):
        """One element of a dim, the dim removed (an on-chip partition dim stays, of size 1); ``index`` an int or
        a one-element tensor read when the kernel runs."""
        dim = dim % self.ndim
        if not isinstance(index, (int, np.integer)):
            if self.on_chip and dim == 0:
                raise NkiValidationError("err_dynamic_index", f"select: a dynamic index on the partition dim of "
                                         f"on-chip {self.name}")
            if self.indirect is not None:
                raise NkiValidationError("err_indirect_dim", f"select: {self.name} is already indirect")
            index = _dynamic_index("select", index)
        self._check_not_indirect_dim("select", dim)
        key = [slice(None)] * self.ndim
        key[dim] = int(index)
        return self[tuple(key)]

    def vector_select(self, dim: int, vector_offset):
        """Each partition of ``vector_offset`` (an SBUF (P, 1) tile of row indices) picks its own row of dim 0 of
        this HBM tensor; dim 0 becomes P long."""
        if dim != 0 or self.on_chip or self.indirect is not None:
            raise NkiValidationError(
                "err_vector_select", f"vector_select(dim={dim}) of {self.name} in {self.buffer}: dim 0 of an HBM "
                "tensor that is not indirect yet", "vector_select",
            )
        if not getattr(vector_offset, "on_chip", False) or vector_offset.free_size != 1:
            raise NkiValidationError("err_indirect_offset_buffer", "vector_offset must be an SBUF (P, 1) tile")
        shape = (vector_offset.partitions,) + self.shape[1:]
        return self._view(shape, self.strides, self.offset, indirect=(vector_offset, 0))

    def reshape_dim(self, dim: int, shape):
        """Split one dim into several (one size may be -1)."""
        dim = dim % self.ndim
        sizes = _split_sizes("reshape_dim", self.shape[dim], shape)
        if dim == 0 and (self.on_chip or self.indirect is not None) and len(sizes) > 1:
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition", f"reshape_dim(0, {sizes}) of {self.name}"
            )
        stride = self.strides[dim]
        split = tuple(stride * math.prod(sizes[i + 1:]) for i in range(len(sizes)))
        return self._view(self.shape[:dim] + sizes + self.shape[dim + 1:],
                          self.strides[:dim] + split + self.strides[dim + 1:], self.offset, indirect=self.indirect)

    def flatten_dims(self, start_dim: int, end_dim: int):
        """Merge dims start_dim..end_dim (inclusive), which must be contiguous in memory."""
        start_dim, end_dim = start_dim % self.ndim, end_dim % self.ndim
        if start_dim == 0 and (self.on_chip or self.indirect is not None) and end_dim > 0:
            raise NkiValidationError(
                "err_leading_dimension_of_tensor_must_be_partition", f"flatten_dims(0, {end_dim}) of {self.name}"
            )
        for d in range(start_dim, end_dim):
            if self.shape[d] != 1 and self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise NkiValidationError(
                    "err_reshape_non_contiguous", f"flatten_dims({start_dim}, {end_dim}) of {self.name}: dims "
                    f"{self.shape} with strides {self.strides} are not contiguous",
                )
        merged = math.prod(self.shape[start_dim:end_dim + 1])
        return self._view(self.shape[:start_dim] + (merged,) + self.shape[end_dim + 1:],
                          self.strides[:start_dim] + (self.strides[end_dim],) + self.strides[end_dim + 1:],
                          self.offset, indirect=self.indirect)

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None):
        """einops-style: split the grouped dims of ``src_pattern`` (sizes from ``fixed_sizes``, one inferred),
        reorder to ``dst_pattern``'s names, merge its groups."""
        if len(src_pattern) != self.ndim:
            raise NkiValidationError("err_rearrange", f"pattern {src_pattern} does not name the {self.ndim} dims")
        fixed, view, names = dict(fixed_sizes or {}), self, []
        for dim in reversed(range(self.ndim)):  # split from the last dim, so earlier dims keep their numbers
            group = src_pattern[dim] if isinstance(src_pattern[dim], (tuple, list)) else (src_pattern[dim],)
            if len(group) > 1:
                view = view.reshape_dim(dim, tuple(fixed.get(name, -1) for name in group))
            names[:0] = list(group)
        order = [name for item in dst_pattern for name in (item if isinstance(item, (tuple, list)) else (item,))]
        if sorted(order) != sorted(names):
            raise NkiValidationError("err_rearrange", f"{dst_pattern} does not name the dims of {src_pattern}")
        view = view.permute([names.index(name) for name in order])
        position = 0
        for item in dst_pattern:
            width = len(item) if isinstance(item, (tuple, list)) else 1
            if width > 1:
                view = view.flatten_dims(position, position + width - 1)
            position += 1
        return view
