"""Kernel pipeline: one NKI region (an FX GraphModule of ATen ops) -> launched kernels.

Input: ``compile_region(gm, example_inputs, config)`` — a partition submodule with concrete shapes, its example
inputs (real or fake tensors) and the backend Config. Output: ``CompiledRegion``, a callable that takes the
region's torch tensors, launches its kernels in order on the simulator and returns one torch tensor per graph
output with eager's dtype, shape and strides (outputs that are views of inputs need no kernel).

Stages: FakeTensor propagation (when meta["val"] is missing) -> lowering -> fusion -> tiling -> rendering ->
``simulator.load_module``. Every failure is a ``LoweringError`` that names the op or kernel.
"""

from __future__ import annotations

import torch

from neuron_compile import ir
from neuron_compile.codegen.render import render_kernel
from neuron_compile.hardware import get_target
from neuron_compile.lowering import LoweringError, lower_graph
from neuron_compile.passes.activation_ranges import guard_activation_ranges
from neuron_compile.passes.fusion import fuse
from neuron_compile.passes.tiling import TilingError, plan_kernel
from neuron_compile.runtime.region import CompiledRegion


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
    from neuron_compile.runtime.launcher import select_launcher

    _propagate_meta(gm, list(example_inputs))
    target = _target(config)
    launcher = select_launcher(config, target)
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
            kernels.append(launcher.load(source))
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
        kernels.append(launcher.load(source))
    return CompiledRegion(
        lowered.inputs, kernels, lowered.outputs, lowered.aten_nodes, target, fused.decisions, lowered.buffers,
        lowered.mutations, lowered.output_dtypes, launcher=launcher,
    )
