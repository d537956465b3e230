"""Runtime stage: a compiled NKI region, ready to launch (``CompiledRegion``).

Input: the region's input buffers, its kernels (source and loaded function), and where each graph output is
read from. Output, per call: one torch tensor per graph output with eager's dtype, shape and strides; graph
inputs the region mutates are written after every kernel ran (outputs that are views of inputs need no kernel).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import torch

from neuron_compile import ir
from neuron_compile.codegen.render import KernelSource
from neuron_compile.lowering.registry import SUPPORTED_DTYPES, LoweringError
from neuron_compile.runtime import stats

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "bool": np.uint8, "int32": np.int32}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bool": torch.bool, "int32": torch.int32}
INT32_RANGE = (-(2**31), 2**31 - 1)


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
