"""Runtime stage: what a compiled region does on every call, worked out once (``LaunchPlan``).

Input: a compiled region's input buffers, launched kernels, graph outputs, mutations and eager's output dtypes.
Output: a ``LaunchPlan`` of plain tuples: per input its buffer name, the storage span its kernels read and whether
int64 values are narrowed to the int32 kernel dtype; per launched kernel the buffers it takes, in order; per graph
output where it is read from (an input's storage or a kernel-written buffer) and the torch dtype handed back; per
mutation the input it writes. ``CompiledRegion`` builds one when it is made
and reads it on every call, so a cache hit does no layout arithmetic, name search or dtype table lookup.

``ValidatedSignatures`` remembers the input signatures (shape, strides, dtype per tensor) a region's first-call
checks accepted: the checks are a function of exactly those, so a later call with one of them skips them, and any
other signature is checked in full.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from neuron_compile import ir
from neuron_compile.errors import LoweringError
from neuron_compile.kernel_dtypes import TORCH_DTYPES
from neuron_compile.runtime.launcher import LoadedKernel

INT32_RANGE = (-(2**31), 2**31 - 1)
# torch's C++ tensor over another's storage with given sizes, strides and offset: not a view, with a version counter
# of its own, made without the dispatcher and without a bounds check (what Inductor's generated code calls
# ``reinterpret_tensor``); None in a torch without it, where callers make the same tensor through ops.
REINTERPRET_TENSOR = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", None)
SIGNATURES_KEPT = 16  # validated input signatures remembered per region (one per distinct strides; usually one)


@dataclasses.dataclass(frozen=True)
class InputSlot:
    name: str  # the region's input buffer
    span: int  # elements of the input's storage its kernels read, from its storage offset
    narrow_to_int32: bool  # the kernel dtype is int32: int64 values are narrowed per call
    # Whether the narrowed values are checked against int32's range per call: not when the caller's dispatch key
    # already bounds them (``CompiledRegion.trust_values``).
    check_int32_range: bool = True


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    buffer: str  # where the output is read from: an input buffer (a view) or a kernel-written buffer
    layout: ir.Layout
    input_index: int  # the input it views, -1 for a kernel-written buffer
    # the dtype handed back for a kernel-written buffer (int32 widened where eager's is int64)
    dtype: torch.dtype | None


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One launched kernel and where its arguments come from."""

    kernel: LoadedKernel
    parameters: tuple[str, ...]  # the buffers it takes, in order
    # The region inputs it takes, by position, when every parameter is one (a region kernel's usual case); else None
    input_positions: tuple[int, ...] | None
    takes_every_input: bool = False  # it takes the region's inputs, all and in order (a region kernel usually does)
    output_names: tuple[str, ...] = ()  # the buffers it writes, in the order the launcher returns them


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    inputs: tuple[InputSlot, ...]
    kernels: tuple[KernelCall, ...]
    outputs: tuple[OutputSlot, ...]
    mutations: tuple[tuple[int, str, ir.Layout], ...]  # (input index written, buffer read, layout in that buffer)
    input_index: dict[str, int]  # each input buffer's position, by name
    # When every output is read from a buffer a kernel writes, in that buffer's dtype (a model's usual outputs), and
    # torch has ``REINTERPRET_TENSOR`` to make them: per output (buffer, shape, strides, offset in the buffer); None
    # otherwise
    written_outputs: tuple[tuple[str, tuple, tuple, int], ...] | None = None


def launch_plan(inputs: list[ir.Buffer], launched: list[LoadedKernel], outputs, mutations,
                output_dtypes: list[torch.dtype]) -> LaunchPlan:
    """The plan of a region (see the module docstring); ``outputs``: a TensorValue per graph output,
    ``mutations``: (input buffer name, TensorValue) pairs."""
    input_index = {buffer.name: index for index, buffer in enumerate(inputs)}
    output_slots = []
    for index, value in enumerate(outputs):
        if value.buffer in input_index:
            output_slots.append(OutputSlot(value.buffer, value.layout, input_index[value.buffer], None))
            continue
        dtype = TORCH_DTYPES[value.dtype]
        if value.dtype == "int32" and output_dtypes[index:index + 1] == [torch.int64]:
            dtype = torch.int64  # NKI has no int64: widen
        output_slots.append(OutputSlot(value.buffer, value.layout, -1, dtype))
    return LaunchPlan(
        inputs=tuple(InputSlot(buffer.name, buffer.layout.span(), buffer.dtype == "int32") for buffer in inputs),
        kernels=tuple(kernel_call(kernel, input_index) for kernel in launched),
        outputs=tuple(output_slots),
        mutations=tuple((input_index[name], value.buffer, value.layout) for name, value in mutations),
        input_index=input_index,
        written_outputs=written_outputs(output_slots, outputs, launched),
    )


def written_outputs(slots: list[OutputSlot], outputs, launched: list[LoadedKernel]) -> tuple | None:
    """``LaunchPlan.written_outputs`` of a region whose outputs are ``slots`` (``outputs``: their TensorValues), whose
    ``launched`` kernels write the buffers."""
    written = {buffer.name for kernel in launched for buffer in kernel.source.outputs}
    if REINTERPRET_TENSOR is None or not all(
            slot.input_index < 0 and slot.buffer in written and slot.dtype == TORCH_DTYPES[value.dtype]
            for slot, value in zip(slots, outputs)):
        return None
    return tuple((slot.buffer, slot.layout.shape, slot.layout.strides, slot.layout.offset) for slot in slots)


def kernel_call(kernel: LoadedKernel, input_index: dict[str, int]) -> KernelCall:
    """``kernel``'s call; ``input_index``: the region's input buffers' positions by name."""
    parameters = tuple(kernel.source.parameters)
    taken = tuple(input_index[name] for name in parameters if name in input_index)
    output_names = tuple(buffer.name for buffer in kernel.source.outputs)
    if len(taken) != len(parameters):
        return KernelCall(kernel, parameters, None, output_names=output_names)
    return KernelCall(kernel, parameters, taken, taken == tuple(range(len(input_index))), output_names)


def flat_argument(tensor: torch.Tensor, slot: InputSlot) -> torch.Tensor:
    """The storage span an input's kernels read, from the tensor's storage offset, as a flat tensor in the
    kernel's dtype (a view where the dtypes agree)."""
    if tensor.requires_grad:
        tensor = tensor.detach()  # the kernels' arguments are data: no autograd view of them
    if slot.narrow_to_int32 and tensor.dtype != torch.int32:
        return narrowed_argument(tensor, slot)
    return torch.as_strided(tensor, (slot.span,), (1,), tensor.storage_offset())


def narrowed_argument(tensor: torch.Tensor, slot: InputSlot) -> torch.Tensor:
    """``flat_argument`` of an int64 input whose kernels read int32: its span's values narrowed, in a new tensor.
    A contiguous tensor that is its whole span is narrowed as it is and flattened by ``REINTERPRET_TENSOR`` (the
    narrowed copy holds exactly the span: nothing to check), one dispatched op fewer than through a flat view."""
    whole = REINTERPRET_TENSOR is not None and tensor.numel() == slot.span and tensor.is_contiguous()
    values = tensor if whole else torch.as_strided(tensor, (slot.span,), (1,), tensor.storage_offset())
    # int64 is narrowed to the int32 kernel dtype only when every value fits; otherwise the region fails here and
    # the call runs eagerly (a silent wrap would be a wrong answer).
    if slot.check_int32_range and values.numel() and (
            int(values.min()) < INT32_RANGE[0] or int(values.max()) > INT32_RANGE[1]):
        raise LoweringError(f"input {slot.name}: int64 values beyond int32, the kernel dtype")
    narrowed = values.to(torch.int32)
    return REINTERPRET_TENSOR(narrowed, (slot.span,), (1,), 0) if whole else narrowed


def input_signature(tensors) -> tuple:
    """What a region's input checks read of its tensors: shape, strides and dtype of each."""
    return tuple([(tensor.shape, tensor.stride(), tensor.dtype) for tensor in tensors])


class ValidatedSignatures:
    """The input signatures whose checks passed (see the module docstring); thread-safe, bounded."""

    def __init__(self, kept: int = SIGNATURES_KEPT):
        self.kept = kept
        self._signatures: set[tuple] = set()
        self._lock = threading.Lock()

    def __contains__(self, signature: tuple) -> bool:
        return signature in self._signatures

    def add(self, signature: tuple) -> None:
        with self._lock:
            if len(self._signatures) >= self.kept:
                self._signatures.clear()  # a region called with ever-new strides: keep checking, bounded memory
            self._signatures.add(signature)
