"""Runtime stage: a compiled NKI region, ready to launch (``CompiledRegion``).

Input: the region's input buffers, its kernels, what is launched (loaded by a launcher: one region kernel that calls
every kernel, codegen/region_text.py, or each kernel, with ``Config.launch_unit`` "kernel"), the launcher, and where
each graph output is read from. Output, per call: one torch tensor per graph output with eager's dtype, shape and
strides, aliasing what eager's would: a view of a region input is a view of that input; any other output is an
ordinary (non-view) tensor over the torch-allocated storage of the buffer a kernel wrote, so it can be resized and
written in place like eager's (``output_tensor``); graph inputs the region mutates are written after every kernel
ran (outputs that are views of inputs need no kernel). Kernels run only through the launcher (runtime/launcher.py:
the simulator or a Neuron device); this module hands it flat torch tensors and gets torch tensors back, and adds
every launch to the stats. What a call does is planned once per region (runtime/launch_plan.py): a cache hit reads
the plan and checks its inputs only when their shapes, strides or dtypes are new to the region; the inputs whose
metadata the caller's dispatch key holds (``trust_inputs``: graph inputs) are not even read for that.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from neuron_compile import ir
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.errors import LoweringError
from neuron_compile.kernel_dtypes import SUPPORTED_DTYPES, TORCH_DTYPES
from neuron_compile.runtime import stats
from neuron_compile.runtime.launch_plan import (REINTERPRET_TENSOR, KernelCall, ValidatedSignatures, input_signature,
                                                 launch_plan)
from neuron_compile.runtime.stable_views import StableViews
from neuron_compile.runtime.launcher import Launcher, LoadedKernel, select_launcher

def output_tensor(written: torch.Tensor, layout: ir.Layout) -> torch.Tensor:
    """A graph output read from a kernel-written buffer (``written``: flat, torch-allocated, resizable): an
    ordinary tensor over that buffer's storage with eager's shape, strides and offset, which autograd does not
    see as a view. An ``as_strided`` view here would be an output of the autograd Function aot_autograd wraps
    the graph in that is a view, and autograd forbids in-place ops on those ("Output 0 of CompiledFunction is a
    view and is being modified inplace"), which eager allows: the Trainer's ``loss *= scale``. Outputs read
    from one buffer share its storage, as eager's views of one intermediate do (aot_autograd regenerates those
    aliases itself), each with its own version counter (an in-place op on one is not one on another); no other
    output shares it."""
    offset = written.storage_offset() + layout.offset
    if REINTERPRET_TENSOR is not None:
        return REINTERPRET_TENSOR(written, layout.shape, layout.strides, offset)
    return written.new_empty((0,)).set_(written.untyped_storage(), offset, layout.shape, layout.strides)


def fill_random_seeds(buffers: dict[str, ir.Buffer], flat: dict[str, torch.Tensor]) -> None:
    """Fresh seeds for the region's random ops (dropout), one int32 each from torch's default generator on every
    call: ``torch.manual_seed`` makes a run repeat, and each call draws new masks."""
    seeds = buffers.get(ir.RANDOM_SEEDS)
    if seeds is not None:
        flat[ir.RANDOM_SEEDS] = torch.randint(0, 2**31 - 1, (seeds.numel,), dtype=torch.int32)


class CompiledRegion:
    """The region's kernels, ready to launch. Call with the region's tensors; returns a tuple of outputs."""

    def __init__(self, inputs, kernels, outputs, nki_nodes, target, decisions, buffers=None, mutations=(),
                 output_dtypes=(), launcher: Launcher | None = None, launched=None):
        self.inputs: list[ir.Buffer] = inputs
        self.buffers: dict[str, ir.Buffer] = buffers or {}  # for buffers no kernel writes (empty tensors)
        self.mutations = list(mutations)  # (input buffer name, TensorValue) pairs: copy_ into a graph input
        self.kernels: list[KernelSource] = list(kernels)  # the region's kernels, in order
        # What is launched, loaded by the launcher, in order: the region kernel that calls every kernel
        # (codegen/region_text.py), or each kernel (launched=None: the kernels are loaded here).
        self.launcher: Launcher = launcher if launcher is not None else select_launcher(target=target)
        self.launched: list[LoadedKernel] = (
            list(launched) if launched is not None else [self.launcher.load(source) for source in self.kernels]
        )
        self.outputs = outputs  # TensorValue per graph output
        self.output_dtypes = list(output_dtypes)  # eager's torch dtype per output (int64 for int32 buffers)
        self.nki_nodes = nki_nodes
        self.target = target
        self.fusion_decisions: list[str] = decisions
        # What every call does, worked out once; the input signatures whose checks passed (runtime/launch_plan.py).
        self.plan = launch_plan(self.inputs, self.launched, self.outputs, self.mutations, self.output_dtypes)
        self.validated = ValidatedSignatures()
        self.views = StableViews(len(self.inputs))
        # The inputs whose shape, strides and dtype later calls still read for the validated-signature check: all
        # but those a caller's dispatch key fixes (``trust_inputs``).
        self.checked_inputs: tuple[int, ...] = tuple(range(len(self.inputs)))
        self.outputs_planned = True  # every call's outputs have the plan's shapes and dtypes (RegionModule)
        self.maybe_complex: tuple[int, ...] | None = None  # the inputs that may be complex64 (``_real_pairs``)
        self.disk_key: str | None = None  # its on-disk cache entry's key, when it was stored or loaded there

    def trust_inputs(self, positions) -> None:
        """The caller's dispatch key holds the shape, strides, storage offset and dtype of the inputs at
        ``positions`` (graph inputs of a graph keyed on exactly those): a call's input signature then reads only the
        other inputs. The first call of each signature still checks every input."""
        trusted = set(positions)
        self.checked_inputs = tuple(index for index in range(len(self.inputs)) if index not in trusted)
        self.maybe_complex = None  # found again on the next call

    def trust_values(self, positions) -> None:
        """The caller's dispatch key bounds the values of the integer inputs at ``positions`` within int32
        (passes/input_ranges.py's guard): narrowing them to the int32 kernel dtype needs no range check per call."""
        trusted = set(positions)
        self.plan = dataclasses.replace(self.plan, inputs=tuple(
            dataclasses.replace(slot, check_int32_range=False) if index in trusted and slot.narrow_to_int32 else slot
            for index, slot in enumerate(self.plan.inputs)))

    @property
    def launch_sources(self) -> list[KernelSource]:
        """The sources launched per call: one region kernel, or every kernel."""
        return [loaded.source for loaded in self.launched]

    def with_launcher(self, launcher: Launcher) -> CompiledRegion:
        """The same region with its launched sources loaded by ``launcher`` (the same text on another target)."""
        return CompiledRegion(
            self.inputs, self.kernels, self.outputs, self.nki_nodes, self.target, self.fusion_decisions,
            self.buffers, self.mutations, self.output_dtypes, launcher,
            [launcher.load(source) for source in self.launch_sources],
        )

    def __call__(self, *tensors: torch.Tensor, validate=None):
        tensors, arguments = self.prepare(tensors)
        return self.finish(tensors, arguments, validate)

    def prepare(self, tensors) -> tuple[tuple, list[torch.Tensor]]:
        """The call's tensors (complex ones as real pairs) and the kernels' flat arguments; the tensors' checks the
        first time their signature comes."""
        plan = self.plan
        if len(tensors) != len(plan.inputs):
            raise LoweringError(f"region expects {len(plan.inputs)} inputs, got {len(tensors)}")
        tensors = self._real_pairs(tensors)
        signature = input_signature([tensors[index] for index in self.checked_inputs]) if self.checked_inputs else ()
        if signature not in self.validated:
            for buffer, tensor in zip(self.inputs, tensors):
                self._check_input(buffer, tensor)
            self.validated.add(signature)
        return tensors, self.views.arguments(tensors, plan.inputs)

    def finish(self, tensors, arguments: list[torch.Tensor], validate=None) -> tuple[torch.Tensor, ...]:
        """Launch the kernels on ``arguments`` (``prepare``'s), then the graph outputs; inputs the region mutates are
        written last. ``tensors``: the call's tensors, read only by outputs that view an input and by mutations
        (``reads_tensors``)."""
        written = self._launch_all(arguments)
        results = self._outputs(tensors, written)
        if validate is not None:
            validate(results)  # before any input is written: a failure here can still fall back eagerly
        for index, buffer, layout in self.plan.mutations:
            # On the device the kernel's store could target the input's HBM directly; launched kernels return fresh
            # outputs, so the stored view is written into the input tensor here, once every kernel ran.
            tensors[index].copy_(torch.as_strided(self._read(buffer, arguments, written), layout.shape,
                                                  layout.strides, layout.offset))
        return results

    @property
    def reads_tensors(self) -> tuple[int, ...]:
        """The inputs ``finish`` reads as tensors (not as flat arguments): those outputs view and mutations write."""
        return tuple(sorted({slot.input_index for slot in self.plan.outputs if slot.input_index >= 0}
                            | {index for index, _, _ in self.plan.mutations}))

    def _real_pairs(self, tensors: tuple) -> tuple:
        """``tensors`` with each complex64 one as its fp32 (real, imaginary) pairs, as it was compiled
        (lowering/registry.py input_layout). Only the inputs that may be complex are looked at: the trusted ones
        (``trust_inputs``) keep the dtype they had on the first call."""
        if self.maybe_complex is None:  # the first call: trusted inputs keep the dtype they have now
            trusted = set(range(len(tensors))) - set(self.checked_inputs)
            self.maybe_complex = tuple(index for index, tensor in enumerate(tensors)
                                       if index not in trusted or tensor.is_complex())
        for index in self.maybe_complex:
            if tensors[index].is_complex():
                return tuple(torch.view_as_real(tensor) if tensor.is_complex() else tensor for tensor in tensors)
        return tensors

    def _launch_all(self, arguments: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Launch every kernel on the inputs' flat ``arguments``; the buffers they wrote, by name (and the random
        seeds and never-written buffers read on the way)."""
        written: dict[str, torch.Tensor] = {}
        if ir.RANDOM_SEEDS in self.buffers:
            fill_random_seeds(self.buffers, written)
        for call in self.plan.kernels:
            if call.takes_every_input:
                taken = arguments
            elif call.input_positions is not None:
                taken = [arguments[index] for index in call.input_positions]
            else:
                taken = [self._read(name, arguments, written) for name in call.parameters]
            self._launch(call, taken, written)
        return written

    def _read(self, name: str, arguments: list[torch.Tensor], written: dict[str, torch.Tensor]) -> torch.Tensor:
        """Buffer ``name``'s flat tensor: a region input's argument, or a buffer kernels wrote (``_buffer``)."""
        position = self.plan.input_index.get(name)
        return arguments[position] if position is not None else self._buffer(name, written)

    def _outputs(self, tensors, written: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The graph outputs: views of region inputs as eager's view ops give them, the others over the storage of
        the buffers kernels wrote (one torch tensor per buffer, shared by the outputs it holds)."""
        if self.plan.written_outputs is not None:
            # output_tensor, inline: a Python call per output costs as much as the tensor
            return tuple([REINTERPRET_TENSOR(written[buffer], shape, strides, written[buffer].storage_offset() + offset)
                          for buffer, shape, strides, offset in self.plan.written_outputs])
        results = []
        converted: dict[str, torch.Tensor] = {}  # kernel-written buffer -> its flat tensor in the output dtype
        for slot in self.plan.outputs:
            layout = slot.layout
            if slot.input_index >= 0:
                tensor = tensors[slot.input_index]
                # as_strided's offset is absolute in the storage; layouts are relative to the buffer's first element.
                results.append(torch.as_strided(tensor, layout.shape, layout.strides,
                                                tensor.storage_offset() + layout.offset))
                continue
            buffer = converted.get(slot.buffer)
            if buffer is None:
                buffer = self._buffer(slot.buffer, written)
                buffer = converted[slot.buffer] = buffer if buffer.dtype == slot.dtype else buffer.to(slot.dtype)
            results.append(output_tensor(buffer, layout))
        return tuple(results)

    @staticmethod
    def _check_input(buffer: ir.Buffer, tensor: torch.Tensor) -> None:
        # An empty tensor has no element to read, and a dim of size 1 is only ever read at index 0: their strides
        # (which eager picks freely, and may pick differently from the fake tensors the region was compiled for)
        # do not change which elements the kernels read.
        strides_differ = tensor.numel() > 0 and any(
            size > 1 and stride != compiled
            for size, stride, compiled in zip(tensor.shape, tensor.stride(), buffer.layout.strides))
        if tuple(tensor.shape) != buffer.layout.shape or strides_differ:
            raise LoweringError(
                f"input {buffer.name}: compiled for shape {list(buffer.layout.shape)} strides "
                f"{list(buffer.layout.strides)}, called with {list(tensor.shape)} {list(tensor.stride())}"
            )
        if SUPPORTED_DTYPES.get(tensor.dtype) != buffer.dtype:
            # A fake tensor whose dtype differs from eager's (bf16 batch-norm running stats) must not be
            # reinterpreted: say so, and the region runs eagerly.
            raise LoweringError(
                f"input {buffer.name}: compiled for dtype {buffer.dtype}, called with {tensor.dtype} (the traced "
                "dtype differs from the one eager produced)"
            )

    def _launch(self, call: KernelCall, arguments: list[torch.Tensor], written: dict[str, torch.Tensor]) -> None:
        """Launch one kernel through the launcher; its outputs join ``written``; the launch joins the stats. Outputs
        are read through their storage (``output_tensor``, ``torch.as_strided``), whatever shape a launcher gives."""
        source = call.kernel.source
        outputs, report = self.launcher.launch(call.kernel, arguments)
        written.update(zip(call.output_names, outputs))
        stats.count_launch(source.name, report, source)

    def _buffer(self, name: str, flat: dict[str, torch.Tensor]) -> torch.Tensor:
        """A buffer's flat tensor; one no kernel writes (aten.empty, a numel-0 result) is NaN-filled like every
        new simulator buffer (uninitialized in eager too); bool and integer buffers are zeros (they have no nan)."""
        if name in flat:
            return flat[name]
        buffer = self.buffers.get(name)
        if buffer is None:
            raise LoweringError(f"buffer {name} is read before any kernel writes it")
        fill = math.nan if buffer.dtype in ("float32", "bfloat16") else 0
        flat[name] = torch.full((buffer.layout.span(),), fill, dtype=TORCH_DTYPES[buffer.dtype])
        return flat[name]
