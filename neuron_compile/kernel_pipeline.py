"""Kernel pipeline: one NKI region (an FX GraphModule of ATen ops) -> launched kernels.

Input: ``compile_region(gm, example_inputs, config)`` — a partition submodule with concrete shapes, its example
inputs (real or fake tensors) and the backend Config. Output: ``CompiledRegion``, a callable that takes the
region's torch tensors, launches its kernels in order on the simulator and returns one torch tensor per graph
output with eager's dtype, shape and strides (outputs that are views of inputs need no kernel).

Stages: FakeTensor propagation (when meta["val"] is missing) -> lowering -> fusion -> tiling -> rendering ->
``simulator.load_module``. Every failure is a ``LoweringError`` that names the op or kernel.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import torch

from neuron_compile import ir
from neuron_compile.codegen.render import KernelSource, render_kernel
from neuron_compile.lowering.registry import SUPPORTED_DTYPES, LoweringError, lower_graph
from neuron_compile.passes.activation_ranges import guard_activation_ranges
from neuron_compile.passes.fusion import fuse
from neuron_compile.passes.tiling import TilingError, plan_kernel
from neuron_compile.runtime import stats
from neuron_compile.runtime.simulator.hardware import get_target

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "bool": np.uint8, "int32": np.int32}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bool": torch.bool, "int32": torch.int32}
INT32_RANGE = (-(2**31), 2**31 - 1)


def _propagate_meta(gm: torch.fx.GraphModule, example_inputs) -> None:
    """Fill meta['val'] with FakeTensors where tracing did not (FakeTensorProp over the example inputs)."""
    computing = [node for node in gm.graph.nodes if node.op in ("placeholder", "call_function")]
    if all("val" in node.meta for node in computing):
        return
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fakes = [value for value in example_inputs if isinstance(value, FakeTensor)]
    if fakes:
        FakeTensorProp(gm, mode=fakes[0].fake_mode).propagate_dont_convert_inputs(*example_inputs)
    else:
        FakeTensorProp(gm, mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)


def _to_numpy_flat(tensor: torch.Tensor, buffer: ir.Buffer) -> np.ndarray:
    """The storage span a buffer's layouts read, from the tensor's storage offset, as a flat numpy array."""
    span = buffer.layout.span()
    flat = torch.as_strided(tensor.detach(), (span,), (1,), tensor.storage_offset()).cpu()
    if buffer.dtype == "bfloat16":
        return flat.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if buffer.dtype == "bool":
        return flat.numpy().view(np.uint8)
    if buffer.dtype == "int32":
        # int64 is narrowed to the int32 kernel dtype only when every value fits; otherwise the region fails
        # here and the call runs eagerly (a silent wrap would be a wrong answer).
        if flat.dtype == torch.int64 and flat.numel() and (
            int(flat.min()) < INT32_RANGE[0] or int(flat.max()) > INT32_RANGE[1]
        ):
            raise LoweringError(f"input {buffer.name}: int64 values beyond int32, the kernel dtype")
        return flat.to(torch.int32).numpy()
    return flat.numpy()


def _to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    if dtype == "bool":
        return torch.from_numpy(np.ascontiguousarray(array).astype(np.bool_))
    if dtype == "int32":
        return torch.from_numpy(np.ascontiguousarray(array).astype(np.int32, copy=False))
    return torch.from_numpy(np.ascontiguousarray(array).astype(np.float32, copy=False))


@dataclasses.dataclass
class Kernel:
    source: KernelSource
    function: object


class CompiledRegion:
    """The region's kernels, ready to launch. Call with the region's tensors; returns a tuple of outputs."""

    def __init__(self, inputs, kernels, outputs, nki_nodes, target, decisions, buffers=None, mutations=(),
                 output_dtypes=()):
        self.inputs: list[ir.Buffer] = inputs
        self.buffers: dict[str, ir.Buffer] = buffers or {}  # for buffers no kernel writes (empty tensors)
        self.mutations = list(mutations)  # (input buffer name, TensorValue) pairs: copy_ into a graph input
        self._kernels: list[Kernel] = kernels
        self.outputs = outputs  # TensorValue per graph output
        self.output_dtypes = list(output_dtypes)  # eager's torch dtype per output (int64 for int32 buffers)
        self.nki_nodes = nki_nodes
        self.target = target
        self.fusion_decisions: list[str] = decisions

    @property
    def kernels(self) -> list[KernelSource]:
        return [kernel.source for kernel in self._kernels]

    def __call__(self, *tensors: torch.Tensor, validate=None):
        from neuron_compile.runtime import simulator

        if len(tensors) != len(self.inputs):
            raise LoweringError(f"region expects {len(self.inputs)} inputs, got {len(tensors)}")
        arrays: dict[str, np.ndarray] = {}
        storage: dict[str, torch.Tensor] = {}
        for buffer, tensor in zip(self.inputs, tensors):
            # An empty tensor has no element to read: its strides (which eager picks freely) do not matter.
            strides_matter = tensor.numel() > 0
            if tuple(tensor.shape) != buffer.layout.shape or (
                strides_matter and tuple(tensor.stride()) != buffer.layout.strides
            ):
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
            arrays[buffer.name] = _to_numpy_flat(tensor, buffer)
            storage[buffer.name] = torch.as_strided(tensor, (buffer.layout.span(),), (1,), tensor.storage_offset())
        for kernel in self._kernels:
            args = [arrays[name] if name in arrays else self._unwritten(name, arrays)
                    for name in kernel.source.parameters]
            run = simulator.run_kernel(kernel.function, args, target=self.target)
            for buffer, array in zip(kernel.source.outputs, run.outputs):
                arrays[buffer.name] = np.asarray(array).reshape(-1)
            report = run.report
            stats.add(
                kernels_launched=1, hbm_bytes=int(report.hbm_bytes_read + report.hbm_bytes_written),
                flops=int(report.flops), est_time_s=float(report.est_time_s), roofline_s=float(report.roofline_s),
            )
        results = []
        for index, value in enumerate(self.outputs):
            if value.buffer not in storage:
                array = arrays[value.buffer] if value.buffer in arrays else self._unwritten(value.buffer, arrays)
                storage[value.buffer] = _to_torch(array, value.dtype)
                if value.dtype == "int32" and self.output_dtypes[index:index + 1] == [torch.int64]:
                    storage[value.buffer] = storage[value.buffer].to(torch.int64)  # NKI has no int64: widen
            base = storage[value.buffer]
            # as_strided's offset is absolute in the storage; layouts are relative to the buffer's first element.
            offset = base.storage_offset() + value.layout.offset
            results.append(torch.as_strided(base, value.layout.shape, value.layout.strides, offset))
        if validate is not None:
            validate(tuple(results))  # before any input is written: a failure here can still fall back eagerly
        for name, value in self.mutations:
            # On the device the kernel's store targets the input's HBM directly; the simulator's kernel outputs are
            # fresh arrays, so the stored view is written into the input tensor here, once every kernel ran.
            written = _to_torch(arrays[value.buffer], value.dtype)
            target = tensors[[buffer.name for buffer in self.inputs].index(name)]
            target.copy_(torch.as_strided(written, value.layout.shape, value.layout.strides, value.layout.offset))
        return tuple(results)

    def _unwritten(self, name: str, arrays: dict) -> np.ndarray:
        """A buffer no kernel writes (aten.empty, a numel-0 result): NaN-filled like every new simulator buffer
        (uninitialized in eager too); bool and integer buffers are zeros (they have no nan)."""
        buffer = self.buffers.get(name)
        if buffer is None:
            raise LoweringError(f"buffer {name} is read before any kernel writes it")
        fill = np.nan if buffer.dtype in ("float32", "bfloat16") else 0
        arrays[name] = np.full(buffer.layout.span(), fill, dtype=NUMPY_DTYPES[buffer.dtype])
        return arrays[name]


def _target(config):
    name = getattr(config, "target", None) if config is not None else None
    return get_target(name)


def _check_single_writer(kernels: list[ir.Node]) -> None:
    """Every buffer is written by one kernel. A launch returns each output buffer whole (the simulator's outputs
    are fresh arrays; on the device each kernel owns its outputs), so a second writer would replace the first's
    elements: a lowering that writes one buffer in pieces must emit one node (ir.Concat), never several."""
    writers: dict[str, str] = {}
    for node in kernels:
        for buffer in {store.buffer.name for store in (*node.stores, *getattr(node, "row_stores", ()))}:
            if buffer in writers:
                raise LoweringError(f"buffer {buffer} is written by two kernels ({writers[buffer]} and {node.name})")
            writers[buffer] = node.name


def compile_region(gm: torch.fx.GraphModule, example_inputs, config=None) -> CompiledRegion:
    """Lower, fuse, tile, render and load ``gm``'s kernels (see the module docstring)."""
    from neuron_compile.runtime import simulator

    _propagate_meta(gm, list(example_inputs))
    target = _target(config)
    lowered = lower_graph(gm)
    region_outputs = {value.buffer for value in lowered.outputs} | {value.buffer for _, value in lowered.mutations}
    fused = fuse(guard_activation_ranges(lowered.nodes), region_outputs)
    _check_single_writer(fused.kernels)
    kernels = []
    for index, node in enumerate(fused.kernels):
        name = f"{type(node).__name__.lower()}_kernel_{index}"
        if isinstance(node, (ir.Gather, ir.Scatter)):  # indirect-DMA kernels, own tiling (codegen/gather.py)
            from neuron_compile.codegen.gather import render_gather

            source = render_gather(node, name, sorted({load.buffer for load in ir.node_loads(node)}), target)
            kernels.append(Kernel(source, getattr(simulator.load_module(source.source, name), name)))
            continue
        try:
            plan = plan_kernel(node, target)
        except TilingError as error:
            raise LoweringError(f"kernel {name}: shape beyond tiling: {error}") from error
        parameters = sorted({load.buffer for load in ir.node_loads(node)})
        try:
            source = render_kernel(node, plan, name, parameters)
        except Exception as error:
            raise LoweringError(f"kernel {name} ({node.name}) could not be rendered: {error}") from error
        module = simulator.load_module(source.source, name)
        kernels.append(Kernel(source, getattr(module, name)))
    return CompiledRegion(
        lowered.inputs, kernels, lowered.outputs, lowered.aten_nodes, target, fused.decisions, lowered.buffers,
        lowered.mutations, lowered.output_dtypes,
    )
