"""Runtime stage: a compiled NKI region, ready to launch (``CompiledRegion``).

Input: the region's input buffers, its kernels, what is launched (loaded by a launcher: one region kernel that calls
every kernel, codegen/region_text.py, or each kernel, with ``Config.launch_unit`` "kernel"), the launcher, and where
each graph output is read from. Output, per call: one torch tensor per graph output with eager's dtype, shape and
strides, aliasing what eager's would: a view of a region input is a view of that input; any other output is an
ordinary (non-view) tensor over the torch-allocated storage of the buffer a kernel wrote, so it can be resized and
written in place like eager's (``output_tensor``); graph inputs the region mutates are written after every kernel
ran (outputs that are views of inputs need no kernel). Kernels run only through the launcher (runtime/launcher.py:
the simulator or a Neuron device); this module hands it flat torch tensors and gets torch tensors back, and adds
every launch to the stats.
"""

from __future__ import annotations

import math

import torch

from neuron_compile import ir
from neuron_compile.codegen.render import KernelSource
from neuron_compile.lowering import SUPPORTED_DTYPES, LoweringError
from neuron_compile.runtime import stats
from neuron_compile.runtime.launcher import TORCH_DTYPES, Launcher, LoadedKernel, select_launcher

INT32_RANGE = (-(2**31), 2**31 - 1)


def kernel_argument(tensor: torch.Tensor, buffer: ir.Buffer) -> torch.Tensor:
    """The storage span a buffer's layouts read, from the tensor's storage offset, as a flat tensor in the
    kernel's dtype (a view where the dtypes agree)."""
    flat = torch.as_strided(tensor.detach(), (buffer.layout.span(),), (1,), tensor.storage_offset())
    if buffer.dtype == "int32" and flat.dtype != torch.int32:
        # int64 is narrowed to the int32 kernel dtype only when every value fits; otherwise the region fails
        # here and the call runs eagerly (a silent wrap would be a wrong answer).
        if flat.numel() and (int(flat.min()) < INT32_RANGE[0] or int(flat.max()) > INT32_RANGE[1]):
            raise LoweringError(f"input {buffer.name}: int64 values beyond int32, the kernel dtype")
        return flat.to(torch.int32)
    return flat


def output_tensor(written: torch.Tensor, layout: ir.Layout) -> torch.Tensor:
    """A graph output read from a kernel-written buffer (``written``: flat, torch-allocated, resizable): an
    ordinary tensor over that buffer's storage with eager's shape, strides and offset, which autograd does not
    see as a view. An ``as_strided`` view here would be an output of the autograd Function aot_autograd wraps
    the graph in that is a view, and autograd forbids in-place ops on those ("Output 0 of CompiledFunction is a
    view and is being modified inplace"), which eager allows: the Trainer's ``loss *= scale``. Outputs read
    from one buffer share its storage, as eager's views of one intermediate do (aot_autograd regenerates those
    aliases itself); no other output shares it."""
    offset = written.storage_offset() + layout.offset
    owned = torch.empty((0,), dtype=written.dtype, device=written.device)
    return owned.set_(written.untyped_storage(), offset, layout.shape, layout.strides)


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
        if len(tensors) != len(self.inputs):
            raise LoweringError(f"region expects {len(self.inputs)} inputs, got {len(tensors)}")
        flat: dict[str, torch.Tensor] = {}  # buffer -> flat tensor in the kernel dtype (inputs, kernel outputs)
        storage: dict[str, torch.Tensor] = {}  # input buffer -> the flat view of the input tensor
        written: dict[str, torch.Tensor] = {}  # kernel-written buffer -> its torch-allocated flat tensor
        for buffer, tensor in zip(self.inputs, tensors):
            if tensor.is_complex():  # compiled as its fp32 (real, imaginary) pairs: registry.input_layout
                tensor = torch.view_as_real(tensor)
            self._check_input(buffer, tensor)
            flat[buffer.name] = kernel_argument(tensor, buffer)
            storage[buffer.name] = torch.as_strided(tensor, (buffer.layout.span(),), (1,), tensor.storage_offset())
        fill_random_seeds(self.buffers, flat)
        for kernel in self.launched:
            self._launch(kernel, flat)
        results = []
        for index, value in enumerate(self.outputs):
            if value.buffer in storage:  # a view of a region input, as eager's view op gives
                base = storage[value.buffer]
                # as_strided's offset is absolute in the storage; layouts are relative to the buffer's first element.
                offset = base.storage_offset() + value.layout.offset
                results.append(torch.as_strided(base, value.layout.shape, value.layout.strides, offset))
                continue
            if value.buffer not in written:
                buffer = self._buffer(value.buffer, flat)
                dtype = TORCH_DTYPES[value.dtype]
                if value.dtype == "int32" and self.output_dtypes[index:index + 1] == [torch.int64]:
                    dtype = torch.int64  # NKI has no int64: widen
                written[value.buffer] = buffer if buffer.dtype == dtype else buffer.to(dtype)
            results.append(output_tensor(written[value.buffer], value.layout))
        if validate is not None:
            validate(tuple(results))  # before any input is written: a failure here can still fall back eagerly
        for name, value in self.mutations:
            # On the device the kernel's store could target the input's HBM directly; launched kernels return fresh
            # outputs, so the stored view is written into the input tensor here, once every kernel ran.
            written = self._buffer(value.buffer, flat)
            target = tensors[[buffer.name for buffer in self.inputs].index(name)]
            target.copy_(torch.as_strided(written, value.layout.shape, value.layout.strides, value.layout.offset))
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

    def _launch(self, kernel: LoadedKernel, flat: dict[str, torch.Tensor]) -> None:
        """Launch one kernel through the launcher; its outputs join ``flat``; the launch joins the stats."""
        outputs, report = self.launcher.launch(kernel, [self._buffer(name, flat) for name in kernel.source.parameters])
        for buffer, output in zip(kernel.source.outputs, outputs):
            flat[buffer.name] = output.reshape(-1)
        stats.count_launch(kernel.source.name, report, kernel.source)

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
