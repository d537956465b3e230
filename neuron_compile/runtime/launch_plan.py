"""Runtime stage: what a compiled region does on every call, worked out once (``LaunchPlan``).

Input: a compiled region's input buffers, launched kernels, graph outputs, mutations and eager's output dtypes.
Output: a ``LaunchPlan`` of plain tuples: per input its buffer name, the storage span its kernels read and whether
int64 values are narrowed to the int32 kernel dtype; per launched kernel the buffers it takes, in order; per graph
output where it is read from (an input's storage or a kernel-written buffer) and the torch dtype handed back; per
mutation the input it writes. ``CompiledRegion`` builds one when it is made
and reads it on every call, so a cache hit does no layout arithmetic, name search or dtype table lookup.

``StableViews`` keeps, per input, the flat views of storages that stay put, so a hit does not remake them: each
parameter's (several per input: a regional compile calls one graph with each block's weights), and a buffer's seen
at the same address on two calls in a row; a tensor new on every call (an activation) gets a fresh view, and no
view of it is kept. A column-major weight copy (runtime/weight_layouts.py) is only ever read and owns its storage,
so its view is kept at once and serves the same object without any check. A kept view holds its storage alive:
a parameter's, which its owner holds anyway, and one other storage per input at most.

``ValidatedSignatures`` remembers the input signatures (shape, strides, dtype per tensor) a region's first-call
checks accepted: the checks are a function of exactly those, so a later call with one of them skips them, and any
other signature is checked in full.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch

from neuron_compile import ir
from neuron_compile.lowering import LoweringError
from neuron_compile.runtime.launcher import TORCH_DTYPES, LoadedKernel
from neuron_compile.runtime.weight_layouts import COPIES

INT32_RANGE = (-(2**31), 2**31 - 1)
SIGNATURES_KEPT = 16  # validated input signatures remembered per region (one per distinct strides; usually one)
KEPT_PER_INPUT = 64  # views kept per region input (the blocks of one class a regional compile calls in turn)


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
    dtype: torch.dtype | None  # the dtype handed back for a kernel-written buffer (int32 widened where eager's is int64)
    alone: bool = False  # the only output read from its kernel-written buffer


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One launched kernel and where its arguments come from."""

    kernel: LoadedKernel
    parameters: tuple[str, ...]  # the buffers it takes, in order
    # The region inputs it takes, by position, when every parameter is one (a region kernel's usual case); else None
    input_positions: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    inputs: tuple[InputSlot, ...]
    kernels: tuple[KernelCall, ...]
    outputs: tuple[OutputSlot, ...]
    mutations: tuple[tuple[int, str, ir.Layout], ...]  # (input index written, buffer read, layout in that buffer)


def launch_plan(inputs: list[ir.Buffer], launched: list[LoadedKernel], outputs, mutations,
                output_dtypes: list[torch.dtype]) -> LaunchPlan:
    """The plan of a region (see the module docstring); ``outputs``: a TensorValue per graph output,
    ``mutations``: (input buffer name, TensorValue) pairs."""
    input_index = {buffer.name: index for index, buffer in enumerate(inputs)}
    readers = collections.Counter(value.buffer for value in outputs)
    output_slots = []
    for index, value in enumerate(outputs):
        if value.buffer in input_index:
            output_slots.append(OutputSlot(value.buffer, value.layout, input_index[value.buffer], None))
            continue
        dtype = TORCH_DTYPES[value.dtype]
        if value.dtype == "int32" and output_dtypes[index:index + 1] == [torch.int64]:
            dtype = torch.int64  # NKI has no int64: widen
        output_slots.append(OutputSlot(value.buffer, value.layout, -1, dtype, alone=readers[value.buffer] == 1))
    return LaunchPlan(
        inputs=tuple(InputSlot(buffer.name, buffer.layout.span(), buffer.dtype == "int32") for buffer in inputs),
        kernels=tuple(kernel_call(kernel, input_index) for kernel in launched),
        outputs=tuple(output_slots),
        mutations=tuple((input_index[name], value.buffer, value.layout) for name, value in mutations),
    )


def kernel_call(kernel: LoadedKernel, input_index: dict[str, int]) -> KernelCall:
    """``kernel``'s call; ``input_index``: the region's input buffers' positions by name."""
    parameters = tuple(kernel.source.parameters)
    taken = tuple(input_index[name] for name in parameters if name in input_index)
    return KernelCall(kernel, parameters, taken if len(taken) == len(parameters) else None)


def flat_argument(tensor: torch.Tensor, slot: InputSlot) -> torch.Tensor:
    """The storage span an input's kernels read, from the tensor's storage offset, as a flat tensor in the
    kernel's dtype (a view where the dtypes agree)."""
    if tensor.requires_grad:
        tensor = tensor.detach()  # the kernels' arguments are data: no autograd view of them
    flat = torch.as_strided(tensor, (slot.span,), (1,), tensor.storage_offset())
    if slot.narrow_to_int32 and flat.dtype != torch.int32:
        # int64 is narrowed to the int32 kernel dtype only when every value fits; otherwise the region fails
        # here and the call runs eagerly (a silent wrap would be a wrong answer).
        if slot.check_int32_range and flat.numel() and (
                int(flat.min()) < INT32_RANGE[0] or int(flat.max()) > INT32_RANGE[1]):
            raise LoweringError(f"input {slot.name}: int64 values beyond int32, the kernel dtype")
        return flat.to(torch.int32)
    return flat


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


class StableViews:
    """Per region input, the flat argument views it may serve again (see the module docstring). A view kept by
    address serves a call when it starts at the tensor's data pointer (its storage's address plus its offset), has
    its dtype, and its storage still covers the slot's span: it then reads the very memory a new view would (two
    live storages cannot share an address unless they share the memory), also after its storage was freed and
    regathered in place (FSDP2's ``resize_``). Parameters keep up to ``KEPT_PER_INPUT`` views each (diffusers'
    regional compile calls one graph with each block's weights in turn); any other tensor one, made when it came
    at the same address on two calls in a row (an activation new on every call keeps none). A weight copy's view
    serves the same copy object (``ColumnMajorCopies.owns``), an empty input's the same empty tensor."""

    def __init__(self, inputs: int):
        # per input: {data pointer: (the kept view, the view's storage, the bytes that storage must hold)}; a
        # storage object's nbytes shows a resize of it (FSDP2 freeing it)
        self._by_pointer: list[dict[int, tuple]] = [{} for _ in range(inputs)]
        self._last_pointer = [0] * inputs  # per input: the data pointer of a non-parameter on the last call
        self._empty: list[torch.Tensor | None] = [None] * inputs  # per input with an empty span: one empty view
        # per input: {id: (a tensor whose view serves it whenever it comes again, that view)}: weight copies (one
        # object is one memory), empty inputs (nothing is read; the dtype is checked before, by the key or region)
        self._by_identity: list[dict[int, tuple]] = [{} for _ in range(inputs)]

    def arguments(self, tensors, slots: tuple[InputSlot, ...]) -> list[torch.Tensor]:
        """The kernels' flat argument for each input, in order: ``view``'s, with its two kept cases first, inline
        (a Python call per input costs more than the checks)."""
        by_identity, by_pointer = self._by_identity, self._by_pointer
        arguments = []
        for index, tensor in enumerate(tensors):
            known = by_identity[index].get(id(tensor))
            if known is not None and known[0] is tensor:
                arguments.append(known[1])
                continue
            pointer = tensor.data_ptr()
            kept = by_pointer[index].get(pointer)
            if kept is not None and kept[0].data_ptr() == pointer and kept[0].dtype == tensor.dtype \
                    and kept[1].nbytes() >= kept[2]:
                arguments.append(kept[0])
                continue
            arguments.append(self.view(index, tensor, slots[index]))
        return arguments

    def view(self, index: int, tensor: torch.Tensor, slot: InputSlot) -> torch.Tensor:
        """The flat view of ``tensor`` for input ``index`` (``slot``), made now and kept where it may serve again
        (``arguments`` finds the kept ones)."""
        if slot.narrow_to_int32:  # a converted copy: its values are checked on every call
            return flat_argument(tensor, slot)
        if slot.span == 0:
            # Nothing is read: any empty view of the dtype serves (an empty tensor's address is 0 or arbitrary).
            kept = self._empty[index]
            if kept is None or kept.dtype != tensor.dtype:
                kept = self._empty[index] = flat_argument(tensor, slot)
            keep(self._by_identity[index], id(tensor), (tensor, kept))
            return kept
        flat = flat_argument(tensor, slot)
        pointer, by_pointer = tensor.data_ptr(), self._by_pointer[index]
        if COPIES.owns(tensor):
            keep(self._by_identity[index], id(tensor), (tensor, flat))
        elif isinstance(tensor, torch.nn.Parameter) and pointer != 0:
            keep(by_pointer, pointer, self._kept(flat, slot))
        else:  # one view at most, of a storage that stayed put
            by_pointer.pop(self._last_pointer[index], None)
            if pointer == self._last_pointer[index] and pointer != 0:
                by_pointer[pointer] = self._kept(flat, slot)
            self._last_pointer[index] = pointer
        return flat

    @staticmethod
    def _kept(flat: torch.Tensor, slot: InputSlot) -> tuple:
        return flat, flat.untyped_storage(), (flat.storage_offset() + slot.span) * flat.element_size()


def keep(kept: dict, key: int, entry: tuple) -> None:
    """``kept[key] = entry``, emptying ``kept`` first when it holds ``KEPT_PER_INPUT`` entries."""
    if len(kept) >= KEPT_PER_INPUT:
        kept.clear()
    kept[key] = entry
