"""Runtime stage: an NKI region that holds one user kernel (a ``neuron_compile.nki_op``), ready to launch.

Input: the region's GraphModule as the partitioner made it (placeholders, one call of a registered user op, the
``getitem``s of its outputs, the output tuple) and the launcher. Output, per call: the region's outputs, from one
launch of the user kernel through the launcher (its cost in ``stats()``, its outputs checked against the op's
declared spec).

Why a region of its own: our generated kernels read flat HBM buffers through access patterns and are fused and
called as subkernels of one region kernel (codegen/region_text.py); a user kernel is arbitrary source with its own
argument shapes, which none of that can look inside. The partitioner (passes/partition.py) therefore cuts the
surrounding regions at a user-op node and gives the node a single-node region; that costs one more launch per
cut, and in return the user kernel runs exactly as written, with no eager fallback and no graph break.
"""

from __future__ import annotations

import operator

import torch

from neuron_compile import user_kernels
from neuron_compile.codegen.kernel_text import KernelSource
from neuron_compile.runtime.launcher import Launcher
from neuron_compile.user_kernels import UserKernel


def user_kernel_node(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The user-op call of a region that holds one (the partitioner gives such a node a region of its own)."""
    calls = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is not operator.getitem]
    if len(calls) == 1 and user_kernels.user_kernel_for(calls[0].target) is not None:
        return calls[0]
    return None


class UserKernelRegion:
    """One user kernel launch standing for a region; the interface the runtime asks of a ``CompiledRegion``."""

    def __init__(self, gm: torch.fx.GraphModule, call: torch.fx.Node, launcher: Launcher, example_inputs):
        self.graph_module = gm
        self.call = call
        self.user_kernel: UserKernel = user_kernels.user_kernel_for(call.target)
        self.launcher = launcher
        values = self._bind(example_inputs)
        self.kernels: list[KernelSource] = [user_kernels.kernel_source(self.user_kernel, self._arguments(values))]
        self.launch_sources = list(self.kernels)
        self.nki_nodes = 1
        self.fusion_decisions = [f"{call.name}: user kernel {self.user_kernel.qualname}, launched as written"]
        self.mutations: list = []
        self.inputs: list = []
        self.buffers: dict = {}

    def _bind(self, tensors) -> dict:
        placeholders = [node for node in self.graph_module.graph.nodes if node.op == "placeholder"]
        return dict(zip(placeholders, tensors, strict=True))

    def _arguments(self, values: dict) -> list:
        return [values[arg] if isinstance(arg, torch.fx.Node) else arg for arg in self.call.args]

    def __call__(self, *tensors: torch.Tensor, validate=None):
        values = self._bind(tensors)
        outputs = user_kernels.launch_user_kernel(self.user_kernel, self.launcher, self._arguments(values))
        values[self.call] = outputs[0] if self.user_kernel.num_outputs == 1 else tuple(outputs)
        for node in self.graph_module.graph.nodes:
            if node.op == "call_function" and node.target is operator.getitem:
                values[node] = values[node.args[0]][node.args[1]]
        results = tuple(values[node] for node in self.graph_module.graph.output_node().args[0])
        if validate is not None:
            validate(results)
        return results
