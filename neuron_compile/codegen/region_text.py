"""Codegen stage: a region's kernels as one NKI kernel, launched once (``render_region_kernel``).

Input: the region's kernels in launch order (each an IR node, its TilePlan, its name and input buffers) and the
buffers the caller reads afterwards. Output: a ``KernelSource`` (its parameters: the buffers the kernels read and
none writes, the region's inputs among them) whose module defines every kernel as a subkernel
(kernel_text.subkernel_form: a plain function writing the HBM tensors it is given) and one ``@nki.jit`` function
that allocates the region's outputs in ``nl.shared_hbm`` and its intermediates in private HBM, calls the
subkernels in order and returns the outputs.

Why one launch: every launch is a NEFF boundary with a fixed cost (the cost model's ``KERNEL_LAUNCH_S``), and the
instructions of two launches never overlap. Within one kernel the device's engine queues run the next kernel's
loads while the previous one computes, as far as the data dependencies through memory allow; the simulator's
schedule (runtime/simulator/schedule.py) models exactly that. The kernels stay separate functions, so the dump
and the cost report still name each one (the simulator attributes instructions to the subkernel they ran in).
"""

from __future__ import annotations

import dataclasses

from neuron_compile import ir, kinds
from neuron_compile.codegen.expressions import NL_DTYPES
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.codegen.kernel_text import render_template, subkernel_form
from neuron_compile.tiles import TilePlan


@dataclasses.dataclass(frozen=True)
class PlannedKernelText:
    """What the region kernel needs of one kernel: its node, plan, name and the buffers it reads."""

    node: ir.Node
    plan: TilePlan
    name: str
    parameters: tuple[str, ...]


def _allocation(buffer: ir.Buffer, memory: str) -> str:
    return f"{buffer.name} = nl.ndarray(({buffer.layout.span()},), dtype={NL_DTYPES[buffer.dtype]}, buffer={memory})"


def render_region_kernel(name: str, kernels: list[PlannedKernelText], wanted: list[str]) -> KernelSource:
    """The region kernel ``name`` (see the module docstring). ``wanted``: the buffers the caller reads after the
    launch (the region's outputs and the values it writes into its inputs); those a kernel writes are returned,
    in that order. Its parameters are the buffers the kernels read and none writes, in order of first use."""
    written = {store.buffer.name: store.buffer for kernel in kernels for store in kinds.stores(kernel.node)}
    parameters = list(dict.fromkeys(
        buffer for kernel in kernels for buffer in kernel.parameters if buffer not in written
    ))
    returned = [buffer for buffer in dict.fromkeys(wanted) if buffer in written]
    if not returned:
        raise ValueError(f"region kernel {name}: its kernels write none of the buffers the caller reads {wanted}")
    outputs = [written[buffer] for buffer in returned]
    scratch = [buffer for buffer_name, buffer in written.items() if buffer_name not in returned]
    with subkernel_form():
        subkernels = [kinds.kind_of(kernel.node).render(kernel.node, kernel.plan, kernel.name, list(kernel.parameters))
                      for kernel in kernels]
    calls = []
    for kernel in kernels:
        arguments = [*kernel.parameters, *(store.buffer.name for store in kinds.stores(kernel.node))]
        calls.append(f"{kernel.name}({', '.join(arguments)})")
    description = (f"{len(kernels)} kernels launched as one: " + ", ".join(kernel.name for kernel in kernels)
                   + ".\nEach kernel is a subkernel below, called in order by the kernel function at the end.")
    source = render_template(
        "region.py.j2", name=name, description=description, subkernels=[text.strip("\n") for text in subkernels],
        parameters=parameters, outputs=[_allocation(buffer, "nl.shared_hbm") for buffer in outputs],
        scratch=[_allocation(buffer, "nl.hbm") for buffer in scratch], calls=calls,
        returns=", ".join(returned),
        collectives=any(kinds.kind_of(kernel.node).uses_collectives for kernel in kernels),
    )
    return KernelSource(name, source, tuple(parameters), tuple(outputs))
