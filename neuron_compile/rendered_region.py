"""The render pass's output as plain data: ``RenderedRegion``, and its JSON form for the on-disk cache.

Input: the lowered region's interface (input buffers, outputs, buffers no kernel writes, input mutations, eager's
output dtypes), the fusion decisions, and each kernel's source and tile plan. Output: a frozen dataclass that the
load pass turns into a ``CompiledRegion``, and ``to_data`` / ``from_data``: a dict of str, int, list and dict only
(no pickle: a cache directory shared between users must not be a way to run code). ``from_data`` raises
``ValueError`` on anything that is not what ``to_data`` writes. The kernel texts it holds are data too until the
launcher loads them (runtime/launcher.py), and it loads only texts inside the subset our templates emit
(codegen/kernel_check.py), with restricted builtins: a text planted in a shared cache folder is refused there, and
the on-disk cache takes the refusal as a miss. ``check_stored`` applies that check to every kernel text of an
entry, those a load would not execute too (``neuron-compile cache verify``).
"""

from __future__ import annotations

import dataclasses

import torch

from neuron_compile import ir
from neuron_compile.codegen.kernel_check import check_kernel_text
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.ir import TensorValue


@dataclasses.dataclass(frozen=True)
class RenderedRegion:
    """What loading needs, and what the on-disk cache keeps: the kernel sources and the region's metadata."""

    inputs: tuple[ir.Buffer, ...]  # one per region argument, in order
    outputs: tuple[TensorValue, ...]  # where each region output is read from
    buffers: dict[str, ir.Buffer]  # every buffer the region names (those no kernel writes start NaN-filled)
    mutations: tuple[tuple[str, TensorValue], ...]  # (graph-input buffer, value written into it)
    output_dtypes: tuple[torch.dtype, ...]  # eager's dtype per output
    aten_nodes: int  # ATen nodes the region's kernels compute
    decisions: tuple[str, ...]  # the fusion pass's decisions
    sources: tuple[KernelSource, ...]
    plans: tuple[str, ...] = ()  # each kernel's tile plan, described
    ops: tuple[str, ...] = ()  # the region's distinct ATen ops, in graph order
    # The region's kernels as one kernel, launched once (codegen/region_text.py); None: each kernel is launched
    launch: KernelSource | None = None

    def to_data(self) -> dict:
        return {
            "inputs": [_buffer_data(buffer) for buffer in self.inputs],
            "outputs": [_value_data(value) for value in self.outputs],
            "buffers": [_buffer_data(buffer) for buffer in self.buffers.values()],
            "mutations": [[name, _value_data(value)] for name, value in self.mutations],
            "output_dtypes": [str(dtype).removeprefix("torch.") for dtype in self.output_dtypes],
            "aten_nodes": self.aten_nodes,
            "decisions": list(self.decisions),
            "kernels": [
                {
                    **_kernel_source_data(source), "plan": plan,
                }
                for source, plan in zip(self.sources, self.plans or [""] * len(self.sources), strict=True)
            ],
            "ops": list(self.ops),
            "launch": _kernel_source_data(self.launch) if self.launch is not None else None,
        }

    @classmethod
    def from_data(cls, data: dict) -> RenderedRegion:
        try:
            buffers = [_buffer(item) for item in data["buffers"]]
            kernels = data["kernels"]
            return cls(
                inputs=tuple(_buffer(item) for item in data["inputs"]),
                outputs=tuple(_value(item) for item in data["outputs"]),
                buffers={buffer.name: buffer for buffer in buffers},
                mutations=tuple((_text(name), _value(value)) for name, value in data["mutations"]),
                output_dtypes=tuple(_dtype(name) for name in data["output_dtypes"]),
                aten_nodes=_integer(data["aten_nodes"]),
                decisions=tuple(_text(text) for text in data["decisions"]),
                sources=tuple(_kernel_source(kernel) for kernel in kernels),
                plans=tuple(_text(kernel["plan"]) for kernel in kernels),
                ops=tuple(_text(op) for op in data["ops"]),
                launch=_kernel_source(data["launch"]) if data["launch"] is not None else None,
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a rendered region: {type(error).__name__}: {error}") from error


def check_stored(data: dict) -> None:
    """Raise ``ValueError`` unless ``data`` is a rendered region whose every kernel text (each kernel's and the
    region kernel's) stays inside the subset the launcher executes; the message names the kernel, rule and line."""
    rendered = RenderedRegion.from_data(data)
    for source in [*rendered.sources, *([rendered.launch] if rendered.launch is not None else [])]:
        check_kernel_text(source.source, source.name)


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _integer(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _integers(values) -> tuple[int, ...]:
    return tuple(_integer(value) for value in values)


def _layout_data(layout: ir.Layout) -> list:
    return [list(layout.shape), list(layout.strides), layout.offset]


def _layout(data) -> ir.Layout:
    shape, strides, offset = data
    return ir.Layout(_integers(shape), _integers(strides), _integer(offset))


def _buffer_data(buffer: ir.Buffer) -> dict:
    return {"name": buffer.name, "dtype": buffer.dtype, "layout": _layout_data(buffer.layout)}


def _buffer(data: dict) -> ir.Buffer:
    return ir.Buffer(_text(data["name"]), _text(data["dtype"]), _layout(data["layout"]))


def _value_data(value: TensorValue) -> dict:
    return {"buffer": value.buffer, "dtype": value.dtype, "layout": _layout_data(value.layout)}


def _value(data: dict) -> TensorValue:
    return TensorValue(_text(data["buffer"]), _layout(data["layout"]), _text(data["dtype"]))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, _text(name), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name!r} is not a torch dtype")
    return dtype


def _kernel_source_data(source: KernelSource) -> dict:
    return {
        "name": source.name, "parameters": list(source.parameters),
        "outputs": [_buffer_data(buffer) for buffer in source.outputs], "source": source.source,
    }


def _kernel_source(data: dict) -> KernelSource:
    return KernelSource(
        _text(data["name"]), _text(data["source"]), tuple(_text(name) for name in data["parameters"]),
        tuple(_buffer(item) for item in data["outputs"]),
    )
