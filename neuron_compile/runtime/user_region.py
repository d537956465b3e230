"""Runtime stage: the launch of a user kernel (a ``neuron_compile.nki_op``), and an NKI region holding one.

``launch_user_kernel``: input, a registered ``UserKernel``, a launcher (runtime/launcher.py) and the op's input
tensors; output, the kernel's outputs as torch-allocated tensors, checked against the declared spec
(``NkiOpSpecError``), and the launch counted in ``stats()`` with its cost report (none on the device). The kernel
gets contiguous tensors of the shapes the op received (its own shapes, not our flat buffers); its
``KernelSource`` (name, text where ``inspect`` finds it, declared output buffers) serves records and dumps. The
eager op (nki_op.py) and the compiled region both launch through it.

``UserKernelRegion``: input, the region's GraphModule as the partitioner made it (placeholders, one call of a
registered user op, the ``getitem``s of its outputs, the output tuple) and the launcher; output, per call, the
region's outputs from one ``launch_user_kernel``.

Why a region of its own: our generated kernels read flat HBM buffers through access patterns and are fused and
called as subkernels of one region kernel (codegen/region_text.py); a user kernel is arbitrary source with its own
argument shapes, which none of that can look inside. The partitioner (passes/partition.py) therefore cuts the
surrounding regions at a user-op node and gives the node a single-node region; that costs one more launch per
cut, and in return the user kernel runs exactly as written, with no eager fallback and no graph break.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable

import torch

from neuron_compile import ir, user_kernels
from neuron_compile.codegen.kernel_source import KernelSource
from neuron_compile.kernel_dtypes import TORCH_DTYPES
from neuron_compile.runtime import stats
from neuron_compile.runtime.launcher import Launcher
from neuron_compile.user_kernels import UserKernel

BUFFER_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # torch dtype -> buffer dtype name


def user_kernel_node(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The user-kernel call of a region that holds one (the partitioner gives such a node a region of its own)."""
    calls = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is not operator.getitem]
    if len(calls) == 1 and user_kernels.user_call(calls[0]) is not None:
        return calls[0]
    return None


def kernel_text(kernel: Callable) -> str:
    """The kernel's Python source where inspect finds it (for records and dumps), else a one-line note."""
    function = getattr(kernel, "fn", kernel)  # a simulator Kernel keeps the function as ``fn``
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return f"# source of {getattr(function, '__qualname__', function)!r} not available\n"


def kernel_source(user_kernel: UserKernel, inputs) -> KernelSource:
    """The launch unit's description: its name, text, parameter names and declared output buffers."""
    outputs = []
    for index, spec in enumerate(user_kernel.output_specs(inputs)):
        strides = tuple(torch.empty(spec.shape, device="meta").stride())
        dtype = BUFFER_DTYPES.get(spec.dtype, str(spec.dtype).removeprefix("torch."))
        outputs.append(ir.Buffer(f"{user_kernel.launch_name}_out{index}", dtype, ir.Layout(spec.shape, strides)))
    return KernelSource(user_kernel.launch_name, kernel_text(user_kernel.kernel), user_kernel.argument_names,
                        tuple(outputs))


def launch_user_kernel(user_kernel: UserKernel, launcher: Launcher, inputs) -> list[torch.Tensor]:
    """Run the kernel through ``launcher`` on contiguous copies of ``inputs`` (its own shapes); check the outputs
    against the declared spec; count the launch. The outputs own their storage (the launcher allocates them)."""
    specs = user_kernel.output_specs(inputs)
    source = kernel_source(user_kernel, inputs)
    arguments = [tensor.detach().contiguous() for tensor in inputs]
    returned, report = launcher.launch_function(user_kernel.kernel, arguments)
    user_kernels.check_outputs(user_kernel, returned, specs)
    stats.count_launch(source.name, report, source)
    return returned


class UserKernelRegion:
    """One user kernel launch standing for a region; the interface the runtime asks of a ``CompiledRegion``."""

    def __init__(self, gm: torch.fx.GraphModule, call: torch.fx.Node, launcher: Launcher, example_inputs):
        self.graph_module = gm
        self.call = call
        self.user_call = user_kernels.user_call(call)
        self.user_kernel: UserKernel = self.user_call.user_kernel
        self.launcher = launcher
        values = self._bind(example_inputs)
        self.kernels: list[KernelSource] = [kernel_source(self.user_kernel, self._arguments(values))]
        self.launch_sources = list(self.kernels)
        self.nki_nodes = 1
        chosen = f", chosen for {self.user_call.stands_for}" if self.user_call.stands_for else ""
        self.fusion_decisions = [f"{call.name}: user kernel {self.user_kernel.qualname}{chosen}, launched as written"]
        self.mutations: list = []
        self.inputs: list = []
        self.buffers: dict = {}

    def _bind(self, tensors) -> dict:
        placeholders = [node for node in self.graph_module.graph.nodes if node.op == "placeholder"]
        return dict(zip(placeholders, tensors, strict=True))

    def _arguments(self, values: dict) -> list:
        return [values[arg] if isinstance(arg, torch.fx.Node) else arg for arg in self.user_call.arguments]

    def __call__(self, *tensors: torch.Tensor, validate=None):
        values = self._bind(tensors)
        outputs = launch_user_kernel(self.user_kernel, self.launcher, self._arguments(values))
        values[self.call] = outputs[0] if self.user_kernel.num_outputs == 1 else tuple(outputs)
        for node in self.graph_module.graph.nodes:
            if node.op == "call_function" and node.target is operator.getitem:
                values[node] = values[node.args[0]][node.args[1]]
        results = tuple(values[node] for node in self.graph_module.graph.output_node().args[0])
        if validate is not None:
            validate(results)
        return results
